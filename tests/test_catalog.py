"""PART 13: three hundred tools: a catalog that finds what an identity may use, loads definitions whole under a byte
budget, and authorizes each call again at the gate.
"""

import copy
import dataclasses
import hashlib
import json
import os
import sqlite3
import tempfile
import time

import agent_loop
from agent_loop import call, run_agent, scripted, ToolSpec
from test_agent_loop import (
    any_answer, calls, errors, final, observations, PlainTools, ROOMY, RuntimeTestCase, SLOW_ROOMY,
)
from tests.support import BRIDGES, Recorder, run_in_a_process, utf8_json
from examples.orders import _catalog_accepted, _catalog_model, _raised_version, order_catalog


# PART 13: three hundred tools: a catalog that finds what an identity may use, loads definitions whole under a byte
# budget, and authorizes each call again at the gate

ORDER = {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"],
         "additionalProperties": False}
ORDER_GRANTS = {"orders:read", "shipments:read", "reports:read", "archive:read"}  # every grant but refunds:write


def offered_names(create):
    """The names of the tools each request create() was given offered, sorted, whatever the bridge's shape."""
    return [sorted(tool.get("name") or tool["function"]["name"] for tool in request["tools"])
            for request in create.requests]


def fingerprint_of(catalog, name):
    return hashlib.sha256(utf8_json(catalog.entries[name].definition)).hexdigest()


def small_catalog():
    catalog = agent_loop.Catalog()
    catalog.add("orders_get", ToolSpec(1, True, True, parameters=ORDER, description="Get one order."),
                keywords=("订单", "查询", "状态", "Order"), permission="orders:read")
    catalog.add("shipments_get", ToolSpec(1, True, True, parameters=ORDER, description="Get one shipment."),
                keywords=("物流", "状态"), permission="shipments:read")
    catalog.add("refunds_create", ToolSpec(3, False, False, parameters=ORDER, description="Refund one order."),
                keywords=("退款", "订单", "查询", "状态", "refund"), permission="refunds:write")
    return catalog


class CatalogTests(RuntimeTestCase):
    """PART 13: a catalog's entries, search, loads and gate; and a run with a catalog, through the gate, the bridges
    and a crash."""

    def test_an_entry_is_told_as_its_definition_and_its_digest_is_that_of_its_canonical_json(self):
        catalog = small_catalog()
        definition = {"name": "orders_get", "description": "Get one order.", "parameters": ORDER, "effect": "read",
                      "version": 1}
        digest = hashlib.sha256(utf8_json(definition)).hexdigest()
        (summary,) = catalog.search("order", {"orders:read"})
        self.assertEqual(summary, {"name": "orders_get", "description": "Get one order.", "effect": "read",
                                   "version": 1, "digest": digest})
        loaded = catalog.load(["orders_get"], {"orders:read"})
        self.assertEqual(loaded, {"tools": [{**definition, "digest": digest}],
                                  "bytes": len(utf8_json([{**definition, "digest": digest}]))})
        self.assertEqual(catalog.load(["refunds_create"], {"refunds:write"})["tools"][0]["effect"], "write")

    def test_a_name_is_added_again_only_with_a_higher_version(self):
        catalog = small_catalog()
        spec = catalog.entries["orders_get"].spec
        for version in (1, 0):
            with self.subTest(version=version), self.assertRaises(ValueError):
                catalog.add("orders_get", spec, ("order",), "orders:read", version)
        (before,) = catalog.search("order", {"orders:read"})
        catalog.add("orders_get", dataclasses.replace(spec, description="Get one order, paid or not."), ("order",),
                    "orders:read", 2)
        (after,) = catalog.search("order", {"orders:read"})
        self.assertEqual((after["version"], after["description"]), (2, "Get one order, paid or not."))
        self.assertNotEqual(after["digest"], before["digest"])

    def test_what_an_entry_must_be_is_a_value_error_naming_it(self):
        catalog, spec = agent_loop.Catalog(), ToolSpec(1, True, True, parameters=ORDER)
        cases = [(("orders.get", spec), "a catalog name is 1 to 64 letters, digits, _ or -, as every provider takes it"),
                 (("search_tools", spec), "search_tools: the name of one of the catalog's own tools"),
                 (("a", ToolSpec(1, True, True, validate=lambda args: True)),
                  "a: a catalog entry declares its parameters: they are what a model is told"),
                 (("a", ToolSpec(-1, True, True, parameters=ORDER)), "a: cost must be an int >= 0"),
                 (("a", spec, "order"), "a: keywords must be a collection of strings"),
                 (("a", spec, (), ""), "a: permission must be a non-empty string"),
                 (("a", spec, (), "p", True), "a: version must be an int >= 1")]
        for args, message in cases:
            with self.subTest(args=args[0]), self.assertRaises(ValueError) as refused:
                catalog.add(*args)
            self.assertEqual(str(refused.exception), message)
        self.assertEqual(catalog.entries, {})

    def test_search_scores_the_query_words_among_what_the_grants_may_use_the_best_first_ties_by_name(self):
        catalog = small_catalog()
        everything = {"orders:read", "shipments:read", "refunds:write"}
        self.assertEqual([found["name"] for found in catalog.search("查询 订单 状态", everything)],
                         ["orders_get", "refunds_create", "shipments_get"])  # 3 hits, 3, 1: ties by name
        self.assertEqual([found["name"] for found in catalog.search("查询  订单\t状态", ORDER_GRANTS)],
                         ["orders_get", "shipments_get"])  # refunds_create, hidden, is neither scored nor named
        self.assertEqual([found["name"] for found in catalog.search("状态", ORDER_GRANTS)],
                         ["orders_get", "shipments_get"])  # a tie of one hit each: both, by name
        self.assertEqual([found["name"] for found in catalog.search("ORDER", everything)], ["orders_get"])  # folded
        self.assertEqual([found["name"] for found in catalog.search("状态", everything, limit=1)], ["orders_get"])
        self.assertEqual(catalog.search("火星 着陆", everything), [])  # no match: nothing, never the nearest
        self.assertEqual(catalog.search("退款", ORDER_GRANTS), [])
        for found in catalog.search("状态", everything):
            self.assertEqual(set(found), {"name", "description", "effect", "version", "digest"})  # never a schema

    def test_a_load_is_whole_or_nothing_within_its_budget_a_byte_over_loads_nothing(self):
        catalog = small_catalog()
        whole = catalog.load(["orders_get", "shipments_get"], ORDER_GRANTS, 100_000)
        size = whole["bytes"]
        self.assertEqual(size, len(utf8_json(whole["tools"])))
        self.assertEqual(catalog.load(["orders_get", "shipments_get"], ORDER_GRANTS, size), whole)
        self.assertEqual(catalog.load(["orders_get", "shipments_get"], ORDER_GRANTS, size - 1),
                         {"error": "definition_budget_exceeded", "bytes": size, "budget": size - 1})

    def test_a_hidden_name_and_an_absent_one_load_alike_and_an_old_summary_is_stale(self):
        catalog = small_catalog()
        hidden, absent = (catalog.load([name], ORDER_GRANTS) for name in ("refunds_create", "refunds_creatf"))
        self.assertEqual(hidden, {"error": "unknown_tool", "name": "refunds_create"})
        self.assertEqual(json.dumps(hidden).replace("refunds_create", "X"), json.dumps(absent).replace("refunds_creatf", "X"))
        (old,) = catalog.search("order", {"orders:read"})
        self.assertEqual(catalog.load([old], {"orders:read"})["tools"][0]["digest"], old["digest"])
        catalog.add("orders_get", catalog.entries["orders_get"].spec, ("order",), "orders:read", 2)
        self.assertEqual(catalog.load([old], {"orders:read"}),
                         {"error": "stale_definition", "name": "orders_get", "version": 2})

    def test_the_gate_says_none_stale_denied_or_unknown(self):
        catalog = small_catalog()
        v1 = catalog.load(["orders_get"], {"orders:read"})["tools"][0]["digest"]
        self.assertIsNone(catalog.authorize("orders_get", v1, {"orders:read"}))
        self.assertEqual(catalog.authorize("orders_get", v1, set()), "denied")
        catalog.add("orders_get", catalog.entries["orders_get"].spec, ("order",), "orders:read", 2)
        self.assertEqual(catalog.authorize("orders_get", v1, {"orders:read"}), "stale_definition")
        self.assertEqual(catalog.authorize("orders_get", v1, set()), "denied")
        self.assertEqual(catalog.authorize("orders_get", "0" * 64, {"orders:read"}), "unknown_tool")  # never given out
        self.assertEqual(catalog.authorize("orders_got", v1, {"orders:read"}), "unknown_tool")

    async def catalog_run(self, model, catalog=None, grants=ORDER_GRANTS, **options):
        fixture, _, functions = order_catalog()
        started = []

        def orders_get(order_id):
            started.append(order_id)
            return {"order_id": order_id, "paid": True}

        options.setdefault("limits", ROOMY)
        functions = {name: function for name, function in functions.items() if name in (catalog or fixture).entries}
        result = await run_agent(model, registry={}, catalog=catalog or fixture, grants=grants, accept=options.pop(
            "accept", any_answer), fixtures=agent_loop.FunctionTools({**functions, "orders_get": orders_get}),
            **options)
        return result, started

    async def test_a_model_searches_loads_and_calls_a_tool_through_function_tools_and_completes(self):
        result, started = await self.catalog_run(_catalog_model(), accept=_catalog_accepted)
        self.assertEqual((result["status"], result["answer"], result["used"], started),
                         ("completed", {"order_id": "A", "paid": True}, {"rounds": 4, "calls": 3, "credits": 15}, ["A"]))
        search, load, order = observations(result)
        self.assertEqual([found["name"] for found in search["data"]["candidates"]], ["orders_get", "shipments_get"])
        self.assertEqual([tool["name"] for tool in load["data"]["tools"]], ["orders_get", "shipments_get"])
        self.assertEqual(order["data"], {"order_id": "A", "paid": True})

    async def test_a_tool_is_callable_from_the_round_after_its_load_never_in_its_batch(self):
        model = scripted(calls(call("l", "load_tools", names=["orders_get"]), call("o", "orders_get", order_id="A")))
        result, started = await self.catalog_run(model)
        self.assertEqual((result["status"], result["trace"][-1]["call_id"], started), ("unknown_tool", "o", []))
        model = scripted(calls(call("o", "orders_get", order_id="A")))  # found or not, never loaded
        self.assertEqual((await self.catalog_run(model))[0]["status"], "unknown_tool")

    async def test_a_revoked_grant_ends_the_next_call_denied_and_its_tool_never_starts(self):
        granted = set(ORDER_GRANTS)
        model = _catalog_model(lambda: granted.discard("orders:read"))
        result, started = await self.catalog_run(model, grants=lambda: granted)
        self.assertEqual((result["status"], result["trace"][-1]["reason"], started),
                         ("denied", "the grant for the tool is gone", []))
        self.assertEqual(result["used"], {"rounds": 3, "calls": 2, "credits": 11})

    async def test_a_raised_version_ends_the_next_call_stale_definition(self):
        catalog, _, _ = order_catalog()
        model = _catalog_model(lambda: _raised_version(catalog, None))
        result, started = await self.catalog_run(model, catalog)
        self.assertEqual((result["status"], result["trace"][-1]["name"], started), ("stale_definition", "orders_get", []))

    async def test_observed_the_gates_refusals_are_observations_and_the_model_may_load_again(self):
        catalog, _, _ = order_catalog()
        bumped = []

        async def model(history):
            number = len(history) + 1
            if number == 1:
                return calls(call("c1", "orders_get", order_id="A"))  # not loaded: unknown_tool
            if number == 2:
                return calls(call("l2", "load_tools", names=["orders_get"]))
            if number == 3:
                _raised_version(catalog, None)
                bumped.append(True)
                return calls(call("c3", "orders_get", order_id="A"))  # stale_definition
            if number == 4:
                return calls(call("l4", "load_tools", names=["orders_get"]))
            if number == 5:
                return calls(call("c5", "orders_get", order_id="A"))
            return final("done")

        result, started = await self.catalog_run(model, catalog, on_refused="observe")
        self.assertEqual((result["status"], errors(result), started),
                         ("completed", ["unknown_tool", "stale_definition"], ["A"]))
        self.assertEqual([event["status"] for event in result["trace"] if event["event"] == "refused"],
                         ["unknown_tool", "stale_definition"])

    async def test_a_refused_load_is_a_retryable_observation_with_its_code(self):
        catalog = small_catalog()
        catalog.budget_bytes = 10
        model = scripted(calls(call("a", "load_tools", names=["refunds_create"])),
                         calls(call("b", "load_tools", names=["orders_get"])), final("done"))
        result, _ = await self.catalog_run(model, catalog)
        first, second = observations(result)
        self.assertEqual((first["error"], first["retryable"], first["reason"]),
                         ("unknown_tool", True, "no tool of that name"))
        self.assertEqual((second["error"], second["retryable"], "data" in second),
                         ("definition_budget_exceeded", True, False))
        self.assertRegex(second["reason"], r"^the definitions are \d+ bytes, past the budget of 10: load fewer$")

    async def test_the_grants_are_read_again_before_each_batch(self):
        read = []

        def grants():
            read.append(True)
            return ORDER_GRANTS

        model = scripted(calls(call("s", "search_tools", query="订单")), calls(call("s2", "search_tools", query="状态")),
                         final("done"))
        result, _ = await self.catalog_run(model, grants=grants)
        self.assertEqual((result["status"], len(read)), ("completed", 4))  # when the run joins, then at each decision
        failing = await self.catalog_run(scripted(calls(call("s", "search_tools", query="订单")), final("x")),
                                         grants=lambda: 1 / 0)
        self.assertEqual(observations(failing[0])[0]["data"], {"candidates": []})  # a grant that fails grants nothing

    async def test_what_a_catalog_run_is_given_is_checked_before_the_model_is_asked(self):
        catalog = small_catalog()
        cases = [(dict(catalog=catalog), "grants must be a set of permission names"),
                 (dict(grants=ORDER_GRANTS), "catalog must be a Catalog, given with its grants"),
                 (dict(catalog={}, grants=ORDER_GRANTS), "catalog must be a Catalog, given with its grants"),
                 (dict(catalog=catalog, grants=["orders:read"]), "grants must be a set of permission names"),
                 (dict(catalog=catalog, grants=ORDER_GRANTS, registry={"orders_get": ToolSpec(1, True, True,
                                                                                              parameters=ORDER)}),
                  "orders_get: a name of the registry's and of the catalog's alike")]
        for options, message in cases:
            with self.subTest(options=sorted(options)):
                options = {"registry": {}, "accept": any_answer, "fixtures": PlainTools({}), **options}
                await self.assertRefusedBeforeTheModelIsAsked(message, **options)

    async def test_a_hidden_tool_never_appears_in_a_search_a_load_an_error_or_a_request_a_bridge_sends(self):
        catalog, grants, functions = order_catalog()
        for name, (make_model, options, reply_calls, reply_text) in BRIDGES.items():
            with self.subTest(bridge=name):
                create = Recorder(reply_calls(("r1", "search_tools", {"query": "退款 订单 查询 状态 refund"})),
                                  reply_calls(("r2", "load_tools", {"names": ["refunds_create"]})),
                                  reply_calls(("r3", "refunds_create", {"order_id": "A"})),
                                  reply_text("done"))
                model = make_model(create, "refund order A", {}, catalog=catalog, grants=grants, **options)
                result = await run_agent(model, registry={}, catalog=catalog, grants=grants, accept=any_answer,
                                         fixtures=agent_loop.FunctionTools(functions), limits=ROOMY,
                                         on_refused="observe")
                self.assertEqual(result["status"], "completed")
                self.assertEqual([found["name"] for found in observations(result)[0]["data"]["candidates"]],
                                 ["orders_get", "shipments_get"])  # refunds_create would hit all five words
                self.assertEqual(errors(result), ["unknown_tool", "unknown_tool"])  # the load, then the call
                # Nothing the runtime wrote names it: only the model's own calls do, and what echoes them (a call's
                # name and arguments in history and in the requests' replays).
                said = [{key: value for key, value in obs.items() if key not in ("call_id", "name", "arguments")}
                        for obs in observations(result)]
                said += [{key: value for key, value in event.items() if key != "name"} for event in result["trace"]]
                said += [request["tools"] for request in create.requests]
                self.assertNotIn("refunds", json.dumps(said, ensure_ascii=False))
                self.assertNotIn("Refund one order", json.dumps(create.requests, ensure_ascii=False))

    async def test_the_bridges_offer_the_registry_the_catalog_tools_and_what_the_run_loaded_nothing_else(self):
        catalog, grants, functions = order_catalog()
        lookup = {"lookup": ToolSpec(1, True, True, parameters=ORDER, description="Look an order up.")}
        for name, (make_model, options, reply_calls, reply_text) in BRIDGES.items():
            with self.subTest(bridge=name):
                create = Recorder(reply_calls(("r1", "search_tools", {"query": "查询 订单 状态"})),
                                  reply_calls(("r2", "load_tools", {"names": ["orders_get", "shipments_get"]})),
                                  reply_calls(("r3", "orders_get", {"order_id": "A"})), reply_text("done"))
                model = make_model(create, "was order A paid?", lookup, catalog=catalog, grants=grants, **options)
                result = await run_agent(model, registry=lookup, catalog=catalog, grants=grants, accept=any_answer,
                                         fixtures=agent_loop.FunctionTools({**functions, "lookup": dict}),
                                         limits=ROOMY)
                self.assertEqual(result["status"], "completed")
                offered = offered_names(create)
                self.assertEqual(offered, [["load_tools", "lookup", "search_tools"]] * 2 + [
                    ["load_tools", "lookup", "orders_get", "search_tools", "shipments_get"]] * 2)
                self.assertTrue(all("catalog" not in request and "grants" not in request for request in create.requests))

    async def test_a_tool_whose_grant_was_revoked_is_offered_in_no_request_a_bridge_sends_after(self):
        catalog, grants, functions = order_catalog()
        for name, (make_model, options, reply_calls, reply_text) in BRIDGES.items():
            with self.subTest(bridge=name):
                granted = set(grants)
                create = Recorder(reply_calls(("r1", "load_tools", {"names": ["orders_get"]})),
                                  reply_calls(("r2", "search_tools", {"query": "订单"})), reply_text("done"))

                def revoking(**request):  # the grant goes as the model decides its second round
                    if create.requests:
                        granted.discard("orders:read")
                    return create(**request)

                model = make_model(revoking, "t", {}, catalog=catalog, grants=lambda: granted, **options)
                result = await run_agent(model, registry={}, catalog=catalog, grants=lambda: granted,
                                         accept=any_answer, fixtures=agent_loop.FunctionTools(functions), limits=ROOMY)
                self.assertEqual(result["status"], "completed")
                self.assertEqual(observations(result)[1]["data"], {"candidates": []})  # hidden now to a search
                self.assertEqual(offered_names(create), [["load_tools", "search_tools"],
                                                         ["load_tools", "orders_get", "search_tools"],
                                                         ["load_tools", "search_tools"]])
                tools = json.dumps(create.requests[2]["tools"], ensure_ascii=False)
                self.assertNotIn("orders_get", tools)  # nor its description or its schema
                self.assertNotIn("Get one order", tools)
                self.assertNotIn("^[A-Z][0-9]{0,8}$", tools)
                request = json.dumps(create.requests[2], ensure_ascii=False)  # what it replays too: its load
                for said in ("orders_get", "Get one order", "^[A-Z][0-9]{0,8}$"):
                    self.assertNotIn(said, request)
                self.assertIn("Get one order", json.dumps(result["history"], ensure_ascii=False))  # the run's keeps it

    async def test_a_tool_whose_grant_was_revoked_is_named_nowhere_in_the_next_request_of_each_bridge(self):
        catalog, grants, functions = order_catalog()
        model = scripted(calls(call("s", "search_tools", query="查询 订单 状态")),
                         calls(call("l", "load_tools", names=["orders_get", "shipments_get"])), final("done"))
        result = await run_agent(model, registry={}, catalog=catalog, grants=grants, accept=any_answer,
                                 fixtures=agent_loop.FunctionTools(functions), limits=ROOMY)  # searched, loaded
        history, now = copy.deepcopy(result["history"]), grants - {"shipments:read"}
        self.assertIn("shipments_get", json.dumps(history))  # a candidate, a name loaded, a definition
        for name, (make_model, options, reply_calls, reply_text) in BRIDGES.items():
            with self.subTest(bridge=name):
                create = Recorder(reply_text("done"))
                model = make_model(create, "t", {}, catalog=catalog, grants=lambda: now, **options)
                await model(result["history"])
                request = json.dumps(create.requests, ensure_ascii=False)
                for said in ("shipments_get", "Get the shipment of one order: its carrier and delivery status."):
                    self.assertNotIn(said, request)
                self.assertIn("Get one order", request)  # what the grants still hold is replayed as it was
                self.assertEqual(result["history"], history)  # the run's own history unchanged

    def test_a_bridge_given_a_catalog_needs_the_runs_grants(self):
        catalog, grants, _ = order_catalog()
        for name, (make_model, options, _, _) in BRIDGES.items():
            with self.subTest(bridge=name):
                for given, message in ((dict(catalog=catalog), "grants: a bridge given a catalog needs the run's grants too"),
                                       (dict(grants=grants), "catalog must be a Catalog, given with its grants"),
                                       (dict(catalog=catalog, grants=["orders:read"]), "grants must be a set of permission names")):
                    with self.assertRaises(ValueError) as refused:
                        make_model(Recorder(), "t", {}, **given, **options)
                    self.assertEqual(str(refused.exception), message)

    async def test_a_write_paused_for_approval_meets_the_gate_again_when_it_is_approved(self):
        for change in ("revoked", "raised"):
            with self.subTest(change=change):
                catalog, grants, functions = order_catalog()
                granted, applied = grants | {"refunds:write"}, []
                functions["refunds_create"] = lambda order_id, idempotency_key: applied.append(order_id) or {}
                model = scripted(calls(call("l", "load_tools", names=["refunds_create"])),
                                 calls(call("w", "refunds_create", order_id="A")), final("done"))
                options = dict(registry={}, catalog=catalog, grants=lambda: granted, accept=any_answer, run_id="r",
                               fixtures=agent_loop.FunctionTools(functions), limits=ROOMY)
                with agent_loop.SqliteStore(":memory:") as store:
                    paused = await run_agent(model, store=store, approve=lambda write: "ask", **options)
                    self.assertEqual(paused["status"], "awaiting_approval")
                    if change == "revoked":
                        granted.discard("refunds:write")
                    else:
                        entry = catalog.entries["refunds_create"]
                        catalog.add("refunds_create", entry.spec, entry.keywords, entry.permission, 2)
                    result = await run_agent(model, store=store, approvals={"w": "approve"}, **options)
                self.assertEqual((result["status"], applied),
                                 ("denied" if change == "revoked" else "stale_definition", []))

    async def test_a_run_refused_after_parts_joined_is_a_value_error_and_lets_its_claim_go(self):
        catalog, grants, functions = order_catalog()
        read = {"read": ToolSpec(1, True, True, parameters=ORDER, retries=1)}
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "runs.db")
            for options in (dict(registry=read, fixtures=agent_loop.FunctionTools({**functions, "read": dict})),
                            dict(registry={}, fixtures=agent_loop.FunctionTools(functions), catalog=catalog,
                                 grants=grants)):
                with self.subTest(options=sorted(options)), agent_loop.SqliteStore(path) as store:
                    with self.assertRaises(ValueError) as refused:
                        await run_agent(store=store, run_id="r", approvals={"zz": "approve"}, accept=any_answer,
                                        limits=ROOMY, **options)
                    self.assertEqual(str(refused.exception), "zz: not a write awaiting approval in this run")

    async def test_a_run_resumed_with_a_catalog_built_at_a_later_version_says_stale_definition(self):
        with tempfile.TemporaryDirectory() as folder:
            path, ready = os.path.join(folder, "runs.db"), os.path.join(folder, "ready")
            run_in_a_process("catalog_run", path, ready, "decision", kill_when=ready)
            fixture, grants, functions = order_catalog()
            catalog = agent_loop.Catalog()  # a new process's: the entries as they stand now, never version 1
            for name, entry in fixture.entries.items():
                catalog.add(name, entry.spec, entry.keywords, entry.permission, 2 if name == "orders_get" else 1)
            with agent_loop.SqliteStore(path) as store:
                result = await run_agent(_catalog_model(), registry={}, catalog=catalog, grants=grants,
                                         accept=_catalog_accepted, store=store, run_id="chat",
                                         fixtures=agent_loop.FunctionTools(functions), limits=SLOW_ROOMY)
        self.assertEqual((result["status"], result["trace"][-1]["name"]), ("stale_definition", "orders_get"))

    async def test_a_batch_a_crash_cut_is_charged_at_the_cost_of_the_version_it_loaded(self):
        with tempfile.TemporaryDirectory() as folder:
            path, ready = os.path.join(folder, "runs.db"), os.path.join(folder, "ready")
            run_in_a_process("catalog_run", path, ready, "call", kill_when=ready)
            catalog, grants, functions = order_catalog()
            entry = catalog.entries["orders_get"]
            catalog.add("orders_get", dataclasses.replace(entry.spec, cost=3), entry.keywords, entry.permission, 2)
            with agent_loop.SqliteStore(path) as store:
                result = await run_agent(_catalog_model(), registry={}, catalog=catalog, grants=grants,
                                         accept=_catalog_accepted, store=store, run_id="chat",
                                         fixtures=agent_loop.FunctionTools(functions), limits=SLOW_ROOMY)
        interrupted = [event for event in result["trace"] if event["event"] == "observations"][2]
        self.assertEqual(interrupted["credits"], 12)  # 3 + 1, 3 + 1, 3 + the cut call at version 1's cost: 1, not 3
        self.assertEqual(result["status"], "stale_definition")  # and its next call, of version 1, is stale

    async def test_a_cancel_of_a_run_a_crash_cut_in_a_loaded_tool_waits_for_its_resume_to_charge_it(self):
        with tempfile.TemporaryDirectory() as folder:
            path, ready = os.path.join(folder, "runs.db"), os.path.join(folder, "ready")
            run_in_a_process("catalog_run", path, ready, "call", kill_when=ready)
            catalog, grants, functions = order_catalog()
            with agent_loop.SqliteStore(path, clock=lambda: time.time() + 60) as store:  # its lease ran out
                asked = store.cancel_run("chat", by="ops")  # the cut call's cost is the catalog's: not the store's
                result = await run_agent(_catalog_model(), registry={}, catalog=catalog, grants=grants,
                                         accept=_catalog_accepted, store=store, run_id="chat",
                                         fixtures=agent_loop.FunctionTools(functions), limits=SLOW_ROOMY)
        self.assertEqual((asked, result["status"], result["trace"][-1]["by"]), ("cancel_requested", "cancelled", "ops"))
        self.assertEqual(result["used"]["credits"], 12)  # 3 + 1, 3 + 1, 3 + the cut call at its loaded cost, 1

    async def test_a_load_a_store_edited_by_hand_forged_loads_nothing_and_raises_nothing(self):
        catalog, grants, functions = order_catalog()
        real = catalog.load(["orders_get"], grants)["tools"][0]
        forged = [{**real, "digest": []}, {**real, "name": ["orders_get"]}, {**real, "description": "Anything."},
                  {**real, "version": "1"}, "orders_get", None]
        for told in forged:
            with self.subTest(told=told), tempfile.TemporaryDirectory() as folder:
                path = os.path.join(folder, "runs.db")
                model = scripted(calls(call("s", "search_tools", query="订单")), calls(call("o", "orders_get",
                                                                                        order_id="A")))
                options = dict(registry={}, catalog=catalog, grants=grants, accept=any_answer, run_id="r",
                               fixtures=agent_loop.FunctionTools(functions), limits=ROOMY)
                with agent_loop.SqliteStore(path) as store:  # it searches, then repeats its call id: it ends
                    await run_agent(scripted(calls(call("s", "search_tools", query="订单"))), store=store, **options)
                db = sqlite3.connect(path)
                (body,) = db.execute("SELECT body FROM agent_loop_records WHERE round = 1").fetchone()
                record = json.loads(body)
                record["calls"][0]["name"] = record["observations"][0]["name"] = "load_tools"
                record["observations"][0]["data"] = {"tools": [told], "bytes": 1}
                db.execute("UPDATE agent_loop_records SET body = ?", (json.dumps(record),))
                db.execute("UPDATE agent_loop_runs SET status = NULL, answer = NULL")
                db.execute("DELETE FROM agent_loop_events WHERE seq = (SELECT MAX(seq) FROM agent_loop_events)")
                db.commit()
                db.close()
                with agent_loop.SqliteStore(path) as store:
                    result = await run_agent(model, store=store, **options)
                self.assertEqual((result["status"], result["trace"][-1].get("call_id")), ("unknown_tool", "o"))
        self.assertEqual(catalog.authorize("orders_get", ["digest"], grants), "unknown_tool")

    def test_an_entry_that_could_not_run_or_be_loaded_is_refused_when_it_is_added(self):
        catalog, nested = agent_loop.Catalog(), {"type": "object"}
        for _ in range(15):
            nested = {"type": "object", "properties": {"a": nested}, "required": ["a"], "additionalProperties": False}
        with self.assertRaises(ValueError) as refused:
            catalog.add("deep", ToolSpec(1, True, True, parameters=nested), permission="p")
        self.assertEqual(str(refused.exception), "deep: its parameters are nested too deep to be loaded")
        with self.assertRaises(ValueError) as refused:
            catalog.add("flaky", ToolSpec(1, True, True, parameters=ORDER, retries=2), permission="p")
        self.assertEqual(str(refused.exception),
                         "flaky: retries and jobs are for the registry's tools (PART 12, 15): a catalog's runs once")
        self.assertEqual(catalog.entries, {})

    async def test_the_tools_object_is_checked_against_every_entry_before_the_model_is_asked(self):
        catalog, grants, functions = order_catalog()
        without = {name: function for name, function in functions.items() if name != "archive_001_get"}
        await self.assertRefusedBeforeTheModelIsAsked(
            "archive_001_get: FunctionTools has no function for it", registry={}, catalog=catalog, grants=grants,
            accept=any_answer, fixtures=agent_loop.FunctionTools(without))
        keyless = {**functions, "refunds_create": lambda order_id: {}}
        await self.assertRefusedBeforeTheModelIsAsked(
            "refunds_create: a write function takes the keyword argument idempotency_key", registry={},
            catalog=catalog, grants=grants, accept=any_answer, fixtures=agent_loop.FunctionTools(keyless))

    async def test_a_tools_object_of_yours_with_an_inner_is_used_as_it_is(self):
        catalog, grants, functions = order_catalog()

        class Counted:
            def __init__(self):
                self.inner, self.count = agent_loop.FunctionTools(functions), 0

            async def invoke(self, call):
                self.count += 1
                return await self.inner.invoke(call)

        tools = Counted()
        result = await run_agent(_catalog_model(), registry={}, catalog=catalog, grants=grants,
                                 accept=_catalog_accepted, fixtures=tools, limits=ROOMY)
        self.assertEqual((result["status"], tools.count), ("completed", 1))  # orders_get; search and load: the catalog's

    def test_the_gate_names_nothing_the_catalog_never_gave_out(self):
        catalog = small_catalog()
        hidden = fingerprint_of(catalog, "refunds_create")
        self.assertEqual(catalog.authorize("refunds_create", hidden, ORDER_GRANTS), "unknown_tool")  # never given out
        catalog.load(["refunds_create"], {"refunds:write"})  # given out to an identity that may use it
        self.assertEqual(catalog.authorize("refunds_create", hidden, ORDER_GRANTS), "denied")

    async def test_an_entry_added_mid_run_with_no_function_is_an_unknown_tool_to_a_load_never_a_tool_exception(self):
        catalog, _, functions = order_catalog()

        async def model(history):
            if not history:  # added once the run has begun: the checks made as the catalog joined never saw it
                catalog.add("late_get", ToolSpec(5, True, True, parameters=ORDER, description="Added late."),
                            ("late",), "orders:read")
            return [calls(call("l1", "load_tools", names=["late_get"]),
                          call("l2", "load_tools", names=["orders_get", "late_get"]),
                          call("l3", "load_tools", names=["absent_get"])),
                    calls(call("o", "late_get", order_id="A")), final("done")][len(history)]

        result = await run_agent(model, registry={}, catalog=catalog, grants=ORDER_GRANTS, accept=any_answer,
                                 fixtures=agent_loop.FunctionTools(functions), limits=ROOMY, on_refused="observe")
        self.assertEqual((result["status"], errors(result)), ("completed", ["unknown_tool"] * 4))
        refusals = [{key: value for key, value in obs.items() if key not in ("call_id", "arguments")}
                    for obs in observations(result)[:3]]
        self.assertEqual(refusals, [refusals[2]] * 3)  # as a name the catalog never had, byte for byte
        self.assertEqual(result["used"]["credits"], 3 * 3 + 3)  # three loads; the call never ran

    async def test_a_search_in_a_run_never_lists_an_entry_its_load_would_answer_unknown_tool(self):
        catalog, _, functions = order_catalog()
        lookup = {"lookup": ToolSpec(1, True, True, parameters=ORDER)}

        async def model(history):
            if not history:  # added once the run has begun: one named as a registry tool, one with no function
                catalog.add("lookup", ToolSpec(1, True, True, parameters=ORDER, description="The catalog's."),
                            ("late",), "orders:read")
                catalog.add("late_get", ToolSpec(1, True, True, parameters=ORDER, description="Added late."),
                            ("late",), "orders:read")
            return [calls(call("s", "search_tools", query="late order")), final("done")][len(history)]

        result = await run_agent(model, registry=lookup, catalog=catalog, grants=ORDER_GRANTS, accept=any_answer,
                                 fixtures=agent_loop.FunctionTools({**functions, "lookup": dict}), limits=ROOMY)
        (found,) = observations(result)
        self.assertEqual([told["name"] for told in found["data"]["candidates"]], ["orders_get"])
        self.assertEqual([told["name"] for told in catalog.search("late order", ORDER_GRANTS)],  # the catalog's own
                         ["late_get", "lookup", "orders_get"])

    async def test_a_name_of_the_registry_stays_the_registrys_in_a_run_and_in_a_request(self):
        catalog, grants, functions = order_catalog()
        lookup = {"lookup": ToolSpec(1, True, True, parameters=ORDER, description="The registry's own.")}
        for name, (make_model, options, reply_calls, reply_text) in BRIDGES.items():
            with self.subTest(bridge=name):
                with self.assertRaises(ValueError) as refused:
                    make_model(Recorder(), "t", {**lookup, "load_tools": lookup["lookup"]}, catalog=catalog,
                               grants=grants, **options)
                self.assertEqual(str(refused.exception), "load_tools: a name of the catalog's own tools, in the registry")
                added = agent_loop.Catalog()
                added.add("orders_get", catalog.entries["orders_get"].spec, ("order",), "orders:read")
                create = Recorder(reply_calls(("r1", "load_tools", {"names": ["lookup"]})),
                                  reply_calls(("r2", "load_tools", {"names": ["orders_get", "lookup"]})),
                                  reply_calls(("r3", "load_tools", {"names": ["nope"]})),
                                  reply_calls(("r4", "load_tools", {"names": ["orders_get"]})),
                                  reply_calls(("r5", "lookup", {"order_id": "A"})), reply_text("done"))
                asked = []

                def grant():  # the catalog gains a tool of the registry's name once the run has begun: no join saw it
                    if asked and "lookup" not in added.entries:
                        added.add("lookup", ToolSpec(5, True, True, parameters=ORDER, description="The catalog's."),
                                  ("order",), "lookup:read")
                    asked.append(True)
                    return ORDER_GRANTS | {"lookup:read"}

                model = make_model(create, "t", lookup, catalog=added, grants=grant, **options)
                result = await run_agent(model, registry=lookup, catalog=added, grants=grant, accept=any_answer,
                                         fixtures=agent_loop.FunctionTools({**functions, "lookup": dict}),
                                         limits=ROOMY)
                self.assertEqual(result["status"], "completed")
                said = observations(result)
                refusals = [{key: value for key, value in obs.items() if key not in ("call_id", "arguments")}
                            for obs in said[:3]]
                self.assertEqual(refusals, [refusals[2]] * 3)  # as a name the catalog never had, byte for byte
                self.assertEqual([told["name"] for told in said[3]["data"]["tools"]], ["orders_get"])
                self.assertEqual((said[4]["data"], result["used"]["credits"]), ({"order_id": "A"}, 6 * 3 + 4 + 1))
                offered = offered_names(create)
                self.assertEqual(offered[-1], ["load_tools", "lookup", "orders_get", "search_tools"])
                self.assertNotIn("The catalog's.", json.dumps(create.requests, ensure_ascii=False))

    async def test_a_paused_batch_refused_at_the_gate_on_its_resume_is_observed_when_refusals_are(self):
        catalog, grants, functions = order_catalog()
        granted, placed = set(grants), []
        registry = {"save": ToolSpec(1, False, False, parameters=ORDER)}
        tools = agent_loop.FunctionTools({**functions, "save": lambda order_id, idempotency_key: placed.append(1) or {}})
        model = scripted(calls(call("l", "load_tools", names=["orders_get"])),
                         calls(call("o", "orders_get", order_id="A"), call("w", "save", order_id="A")), final("done"))
        options = dict(registry=registry, catalog=catalog, grants=lambda: granted, accept=any_answer, fixtures=tools,
                       limits=ROOMY, on_refused="observe", run_id="r")
        with agent_loop.SqliteStore(":memory:") as store:
            paused = await run_agent(model, store=store, approve=lambda write: "ask", **options)
            self.assertEqual(paused["status"], "awaiting_approval")
            granted.discard("orders:read")
            result = await run_agent(model, store=store, approvals={"w": "approve"}, **options)
        self.assertEqual((result["status"], errors(result), placed, "pending" in result),
                         ("completed", ["denied", "denied"], [], False))

    async def test_a_run_that_loaded_a_tool_the_catalog_retired_since_resumes(self):
        with tempfile.TemporaryDirectory() as folder:
            path, ready = os.path.join(folder, "runs.db"), os.path.join(folder, "ready")
            run_in_a_process("catalog_run", path, ready, "call", kill_when=ready)  # cut while orders_get runs
            fixture, grants, functions = order_catalog()
            catalog = agent_loop.Catalog()
            for name, entry in fixture.entries.items():
                if name != "orders_get":
                    catalog.add(name, entry.spec, entry.keywords, entry.permission)
            with agent_loop.SqliteStore(path) as store:
                result = await run_agent(_catalog_model(), registry={}, catalog=catalog, grants=grants,
                                         accept=_catalog_accepted, store=store, run_id="chat",
                                         fixtures=agent_loop.FunctionTools(functions), limits=SLOW_ROOMY)
        self.assertEqual((result["status"], errors(result)), ("unknown_tool", ["interrupted"]))

    async def test_a_named_run_killed_after_a_load_resumes_with_the_tool_still_loaded(self):
        for where, change in (("decision", "nothing"), ("decision", "version"), ("call", "nothing")):
            with self.subTest(where=where, change=change), tempfile.TemporaryDirectory() as folder:
                path, ready = os.path.join(folder, "runs.db"), os.path.join(folder, "ready")
                run_in_a_process("catalog_run", path, ready, where, kill_when=ready)
                catalog, grants, functions = order_catalog()
                if change == "version":
                    _raised_version(catalog, grants)
                with agent_loop.SqliteStore(path) as store:
                    result = await run_agent(_catalog_model(), registry={}, catalog=catalog, grants=grants,
                                             accept=_catalog_accepted, store=store, run_id="chat",
                                             fixtures=agent_loop.FunctionTools(functions), limits=SLOW_ROOMY)
                events = [event["event"] for event in result["trace"]]
                self.assertEqual(events[:5], ["decision", "observations", "decision", "observations",
                                              "decision" if where == "call" else "resumed"])
                self.assertEqual(result["status"], "completed" if change == "nothing" else "stale_definition")
                if where == "decision":  # the cut decision stays paid
                    self.assertEqual(result["used"]["rounds"], 5 if change == "nothing" else 4)
                else:  # the cut call is charged, interrupted; the model asks again, and the loaded tool runs
                    self.assertEqual((errors(result), result["used"]), (["interrupted"],
                                                                        {"rounds": 5, "calls": 4, "credits": 19}))
