"""PART 17: what a tool returns, checked before it enters history: its size against a limit, then its schema.
"""

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import unittest

import agent_loop
from agent_loop import call, FunctionTools, Limits, run_agent, scripted, TemporaryError, TOOLS, ToolSpec
from test_agent_loop import any_answer, calls, errors, final, observations, ROOMY, RuntimeTestCase, SLOW_ROOMY
from tests.support import (
    child_command, fc, installed, JOB_RUN_OPTIONS, message, output_text, Recorder, responses_reply, StoreTestCase,
)
from tests.test_mcp import Dumped, FakeSession, protocol_tool, text_result
from examples.orders import order_accepted, order_model, ORDER_TOOLS, OrderDesk

ANY = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
ROWS = {"type": "object", "properties": {"rows": {"type": "array", "items": {
    "type": "object", "properties": {"sku": {"type": "string"}, "stock": {"type": "integer", "minimum": 0}},
    "required": ["sku", "stock"]}}}, "required": ["rows"]}
SECRET = "a secret only the tool knows"


def text_of(length):
    """Data whose compact UTF-8 JSON is 2 + 2 * length bytes: "é" is two bytes, never the six of \\u00e9."""
    return "é" * length


def run_with(functions, registry, model, **options):
    return run_agent(model, fixtures=FunctionTools(functions), registry=registry, accept=any_answer,
                     **{"limits": ROOMY, **options})


def read(**fields):
    return ToolSpec(1, True, True, parameters=ANY, **fields)


class ResultSizeTests(RuntimeTestCase):
    """PART 17: a result larger than its limit is result_too_large, retryable, none of its data kept."""

    async def test_a_result_one_byte_over_its_limit_is_too_large_and_one_at_it_passes(self):
        async def echo(n):
            return text_of(n)

        for limit, ok in ((2 + 2 * 50, True), (1 + 2 * 50, False)):
            with self.subTest(limit=limit):
                result = await run_with({"echo": echo}, {"echo": read()}, scripted(calls(call("a", "echo", n=50)),
                                                                                   final("done")),
                                        limits=dataclasses.replace(ROOMY, result_bytes=limit))
                (obs,) = observations(result)
                self.assertEqual((result["status"], obs["ok"], result["used"]["calls"]), ("completed", ok, 1))
                if not ok:  # charged as made; its size and the limit, none of its data
                    self.assertEqual({key: obs[key] for key in ("error", "retryable", "bytes", "limit")},
                                     {"error": "result_too_large", "retryable": True, "bytes": 102, "limit": 101})
                    self.assertNotIn("data", obs)
                    self.assertNotIn("é", json.dumps(result, ensure_ascii=False))

    async def test_a_tools_own_limit_wins_over_the_runs(self):
        async def echo(n):
            return text_of(n)

        model = scripted(calls(call("a", "echo", n=10), call("b", "wide", n=10)), final("done"))
        result = await run_with({"echo": echo, "wide": echo}, {"echo": read(result_bytes=10),
                                                               "wide": read(result_bytes=1000)}, model,
                                limits=dataclasses.replace(ROOMY, result_bytes=15))
        self.assertEqual(errors(result), ["result_too_large"])  # echo's own 10; wide's own 1000, not the run's 15
        self.assertEqual(observations(result)[0]["limit"], 10)
        unbounded = await run_with({"echo": echo}, {"echo": read()}, scripted(calls(call("a", "echo", n=10 ** 6)),
                                                                              final("done")),
                                   limits=dataclasses.replace(ROOMY, result_bytes=None))
        self.assertEqual(errors(unbounded), [])  # None: no limit (2 MB kept)

    async def test_the_articles_results_pass_untouched_under_the_default_limit(self):
        result = await run_agent(limits=ROOMY)
        self.assertEqual((result["status"], errors(result), Limits().result_bytes), ("completed", [], 1_048_576))
        self.assertIn("result_too_large", agent_loop.every_error())
        self.assertLessEqual({"invalid_result", "result_too_large"}, set(agent_loop.every_status()))

    async def test_a_retried_read_whose_last_attempt_is_too_large_is_observed_once_and_not_tried_again(self):
        attempts = []

        async def flaky(n):
            attempts.append(n)
            if len(attempts) == 1:
                raise TemporaryError("busy")
            return text_of(100)

        result = await run_with({"flaky": flaky}, {"flaky": read(retries=3, backoff=(0.001, 0.001),
                                                                 result_bytes=50)},
                                scripted(calls(call("a", "flaky", n=1)), final("done")))
        (obs,) = observations(result)
        self.assertEqual((obs["error"], obs["attempts"], len(attempts), result["used"]["calls"]),
                         ("result_too_large", 2, 2, 2))

    async def test_a_limit_that_is_not_an_int_of_one_or_more_is_refused_naming_it(self):
        for bad in (0, -1, True, 1.5, "1000"):
            with self.subTest(bad=bad):
                await self.assertRefusedBeforeTheModelIsAsked("result_bytes must be None or an int >= 1",
                                                              limits=dataclasses.replace(ROOMY, result_bytes=bad))
                await self.assertRefusedBeforeTheModelIsAsked(
                    "read_partition: result_bytes must be None or an int >= 1",
                    registry={**TOOLS, "read_partition": dataclasses.replace(TOOLS["read_partition"],
                                                                              result_bytes=bad)})

    async def test_a_bridge_replays_a_result_too_large_with_its_size_and_limit_never_its_data(self):
        async def echo(n):
            return text_of(n)

        create = Recorder(responses_reply(fc("a", "echo", {"n": 30})),
                          responses_reply(message(output_text("done"))))
        model = agent_loop.responses_model(create, "Echo.", registry={"echo": read()})
        result = await run_with({"echo": echo}, {"echo": read()}, model,
                                limits=dataclasses.replace(ROOMY, result_bytes=20))
        self.assertEqual(errors(result), ["result_too_large"])
        (output,) = [item for item in create.requests[1]["input"] if item.get("type") == "function_call_output"]
        self.assertEqual(json.loads(output["output"]), {"ok": False, "error": "result_too_large", "retryable": True,
                                                        "bytes": 62, "limit": 20})


class ResultSchemaTests(RuntimeTestCase):
    """PART 17: a result off its tool's result_schema stops the run invalid_result, its data kept nowhere."""

    async def test_a_result_off_its_schema_stops_the_run_saying_where_and_keeps_none_of_it(self):
        async def rows(n):
            return {"rows": [{"sku": SECRET, "stock": 3}, {"sku": "B", "stock": -1}]}

        result = await run_with({"rows": rows}, {"rows": read(result_schema=ROWS)},
                                scripted(calls(call("a", "rows", n=1)), final("done")))
        self.assertEqual(result["status"], "invalid_result")
        self.assertEqual({key: result["trace"][-1][key] for key in ("call_id", "name", "reason")},
                         {"call_id": "a", "name": "rows", "reason": "result.rows[1].stock: at least 0"})
        self.assertNotIn(SECRET, json.dumps(result))

    async def test_in_a_parallel_batch_the_others_are_kept_and_in_a_serial_one_the_rest_never_starts(self):
        started = []

        async def good(n):
            started.append(n)
            return {"rows": []}

        async def bad(n):
            started.append(n)
            return {"rows": "none"}

        for parallel in (True, False):
            with self.subTest(parallel=parallel):
                started.clear()
                spec = ToolSpec(1, True, parallel, parameters=ANY, result_schema=ROWS)
                model = scripted(calls(call("a", "bad", n=1), call("b", "good", n=2)), final("done"))
                result = await run_with({"bad": bad, "good": good}, {"bad": spec, "good": spec}, model)
                self.assertEqual(result["status"], "invalid_result")
                self.assertEqual([(obs["ok"], obs.get("error")) for obs in observations(result)],
                                 [(False, "invalid_result"), (True, None)] if parallel else
                                 [(False, "invalid_result"), (False, "batch_aborted")])
                self.assertEqual(sorted(started), [1, 2] if parallel else [1])

    async def test_any_root_type_is_checked_and_a_schema_it_cannot_honour_is_refused_naming_the_tool(self):
        async def listing(n):
            return ["a", n]

        strings = read(result_schema={"type": "array", "items": {"type": "string"}})
        result = await run_with({"l": listing}, {"l": strings}, scripted(calls(call("a", "l", n=1)), final("x")))
        self.assertEqual((result["status"], result["trace"][-1]["reason"]), ("invalid_result", "result[1]: expected "
                                                                                              "string"))
        for schema, why in (({"$ref": "#/$defs/x"}, "result_schema: unsupported keyword $ref"),
                            ("an object", "result_schema must be a JSON Schema in plain JSON data within the limits")):
            with self.subTest(schema=schema):
                await self.assertRefusedBeforeTheModelIsAsked(f"l: {why}", registry={"l": read(result_schema=schema)},
                                                              fixtures=FunctionTools({"l": listing}),
                                                              accept=any_answer)
        with self.assertRaises(ValueError):  # a tool the catalog or mcp_registry would register: the same check
            agent_loop.Catalog().add("l", read(result_schema={"$ref": "#"}))

    async def test_the_size_is_checked_before_the_schema(self):
        async def big(n):
            return {"rows": "x" * 100}

        result = await run_with({"big": big}, {"big": read(result_schema=ROWS, result_bytes=50)},
                                scripted(calls(call("a", "big", n=1)), final("done")))
        self.assertEqual((result["status"], errors(result)), ("completed", ["result_too_large"]))


STOCK = {"type": "object", "properties": {"sku": {"type": "string"}, "stock": {"type": "integer"}},
         "required": ["sku", "stock"], "additionalProperties": False}


class McpResultTests(RuntimeTestCase):
    """PART 17 with PART 9: a tool's outputSchema is its result_schema, and its data is its structuredContent."""

    LISTED = {"tools": [{**protocol_tool("stock", {"sku": {"type": "string"}}), "outputSchema": STOCK},
                        protocol_tool("plain", {"sku": {"type": "string"}})]}

    async def run_one(self, name, answer, shape=dict):
        session = FakeSession({name: answer})
        registry = agent_loop.mcp_registry(shape(self.LISTED), read_only=("stock", "plain"))
        result = await run_agent(scripted(calls(call("a", name, sku="A-1")), final("done")), registry=registry,
                                 fixtures=agent_loop.McpTools(session), accept=any_answer, limits=ROOMY)
        return result, registry

    async def test_an_output_schema_is_the_result_schema_and_a_result_that_meets_it_is_its_structured_content(self):
        async def well(sku):
            return text_result("twelve", structured={"sku": sku, "stock": 12})

        for shape in (dict, Dumped):  # the protocol's dicts, and the SDK's objects
            with self.subTest(shape=shape.__name__):
                result, registry = await self.run_one("stock", well, shape)
                self.assertEqual((registry["stock"].result_schema, registry["plain"].result_schema), (STOCK, None))
                self.assertEqual((result["status"], observations(result)[0]["data"]),
                                 ("completed", {"sku": "A-1", "stock": 12}))

    async def test_structured_content_off_the_schema_or_missing_is_invalid_result_and_an_error_stays_tool_error(self):
        async def off(sku):
            return text_result(SECRET, structured={"sku": sku, "stock": SECRET})

        async def missing(sku):  # its text holds what the schema wants: still no structuredContent
            return text_result(json.dumps({"sku": sku, "stock": 12}))

        async def failed(sku):
            return text_result("no such sku", error=True)

        for answer, status, why in ((off, "invalid_result", "result.stock: expected integer"),
                                    (missing, "invalid_result", "result: expected object"),
                                    (failed, "completed", None)):
            with self.subTest(answer=answer.__name__):
                result, _ = await self.run_one("stock", answer)
                self.assertEqual((result["status"], result["trace"][-1].get("reason")), (status, why))
                self.assertNotIn(SECRET, json.dumps(result))
        self.assertEqual(errors(result), ["tool_error"])

    async def test_a_tool_without_an_output_schema_is_read_as_before(self):
        async def plain(sku):
            return text_result(json.dumps({"sku": sku, "stock": "many"}))

        result, _ = await self.run_one("plain", plain)
        self.assertEqual(observations(result)[0]["data"], {"sku": "A-1", "stock": "many"})


class McpServerResultTests(RuntimeTestCase):
    """PART 17 with PART 9, in the SDK lane: a low-level server's tools, each declaring an outputSchema, through the
    official ClientSession, which checks structuredContent itself and raises (its message holding the data)."""

    async def test_a_result_off_its_schema_or_without_structured_content_never_reaches_history(self):
        if not installed("mcp"):
            self.skipTest("the official mcp package is not installed (.ci/run installs it in its SDK lane)")
        import mcp
        from mcp.client.stdio import stdio_client
        self.allowBlockingSteps()
        server = mcp.StdioServerParameters(command=sys.executable, args=child_command("mcp_lowlevel_server")[1:])
        with open(os.devnull, "w") as quiet:
            async with stdio_client(server, quiet) as (read, write), mcp.ClientSession(read, write) as session:
                await session.initialize()
                registry = agent_loop.mcp_registry(await session.list_tools(),
                                                   read_only=("well", "off_schema", "unstructured"))
                self.assertEqual(registry["well"].result_schema, STOCK)
                for name, status in (("well", "completed"), ("off_schema", "tool_exception"),
                                     ("unstructured", "tool_exception")):
                    with self.subTest(name=name):
                        result = await run_agent(scripted(calls(call("a", name, sku="A-1")), final("done")),
                                                 registry=registry, fixtures=agent_loop.McpTools(session),
                                                 accept=any_answer, limits=SLOW_ROOMY)
                        self.assertEqual(result["status"], status)
                        self.assertNotIn("private", json.dumps(result))
                        if status == "completed":
                            self.assertEqual(observations(result)[0]["data"], {"sku": "A-1", "stock": 12})
                        else:
                            self.assertEqual(result["trace"][-1]["error_type"], "RuntimeError")


class NamedResultTests(StoreTestCase):
    """PART 17 with PART 10 and 15: a store never holds data off its schema; jobs' results and writes' are checked."""

    async def test_data_off_its_schema_never_reaches_the_store(self):
        folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, folder)
        path = os.path.join(folder, "runs.db")

        async def rows(n):
            return {"rows": [{"sku": SECRET, "stock": -1}]}

        with agent_loop.SqliteStore(path) as store:
            result = await run_with({"rows": rows}, {"rows": read(result_schema=ROWS)},
                                    scripted(calls(call("a", "rows", n=1)), final("done")), store=store, run_id="r")
            self.assertEqual((result["status"], store.load("r")["status"]), ("invalid_result", "invalid_result"))
        for name in os.listdir(folder):  # the file, its log: no byte of the data
            with open(os.path.join(folder, name), "rb") as file:
                self.assertNotIn(SECRET.encode(), file.read(), name)

    async def test_a_jobs_result_is_checked_as_any_calls_and_a_named_run_keeps_the_observation(self):
        store = self.store()
        registry = {**JOB_RUN_OPTIONS["registry"], "ja": dataclasses.replace(JOB_RUN_OPTIONS["registry"]["ja"],
                                                                             result_bytes=30)}
        options = {**JOB_RUN_OPTIONS, "registry": registry, "store": store, "run_id": "job"}
        model = scripted(calls(call("a", "ja", x=1)), final("done"))
        self.assertEqual((await run_agent(model, **options))["status"], "awaiting_job")
        self.assertEqual(await agent_loop.work_jobs(store, {"ja": lambda x, progress: {"text": "y" * 100}}), 1)
        done = await run_agent(model, **options)
        (obs,) = observations(done)
        self.assertEqual((done["status"], obs["error"], obs["bytes"], obs["limit"]),
                         ("completed", "result_too_large", 111, 30))
        self.assertEqual(store.load("job")["history"][0]["observations"][0]["error"], "result_too_large")

    async def test_a_writes_result_too_large_stops_the_run_never_reconciled_nor_placed_again(self):
        class Desk(OrderDesk):
            asked = []

            async def reconcile(self, call):
                self.asked.append(call["call_id"])
                return await super().reconcile(call)

        desk = Desk(delays={})
        registry = {**ORDER_TOOLS, "place_order": dataclasses.replace(ORDER_TOOLS["place_order"], result_bytes=10)}
        result = await run_agent(order_model, fixtures=desk, store=self.store(), run_id="order", registry=registry,
                                 accept=order_accepted, approve=lambda write: "approve")
        self.assertEqual((result["status"], errors(result), result["trace"][-1]["call_id"]),
                         ("result_too_large", ["result_too_large"], "r3-order"))
        self.assertEqual((Desk.asked, len(desk.effects)), ([], 1))  # applied once: the model is not asked again

if __name__ == "__main__":
    unittest.main()
