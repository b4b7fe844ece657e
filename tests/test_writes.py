"""PART 10: tools that write: approved before they start, keyed so that none applies twice, unknown outcomes
reconciled.
"""

import asyncio
import contextlib
import dataclasses
import datetime
import decimal
import functools
import json
import math
import os
import shutil
import sqlite3
import tempfile
import threading
import time
import types
import unittest
import unittest.mock

import agent_loop
from agent_loop import call, Limits, run_agent, scripted, ToolSpec
from test_agent_loop import (
    calls, code_blocks, final, never_accept, observations, PLAN, readme_section, ROOMY, SLOW_ROOMY, wait_until,
)
from tests.support import dict_store, order_errors, run_in_a_process, StoreTestCase
from examples.orders import order_accepted, order_model, ORDER_TOOLS, OrderDesk


class WriteTests(StoreTestCase):
    """PART 10: writes: an approval before any call of the batch starts, an idempotency key, unknown outcomes settled."""

    async def order(self, store, desk=None, model=None, **options):
        """The inventory task with its order, in the store, as run "order"."""
        return await run_agent(model or order_model, fixtures=desk or OrderDesk(delays={}),
                               store=store, run_id="order", **{"limits": ROOMY, "accept": order_accepted,
                                                               "registry": ORDER_TOOLS, **options})

    async def test_the_order_asked_about_pauses_then_a_decision_places_it_once(self):
        store, desk = self.store(), OrderDesk(delays={})
        paused = await self.order(store, desk, approve=lambda write: "ask")
        (pending,) = paused["pending"]
        self.assertEqual((paused["status"], desk.started, store.unfinished()),
                         ("awaiting_approval", ["r1-north", "r1-south", "r2-plan"], ["order"]))
        self.assertEqual(pending["idempotency_key"], agent_loop.idempotency_key("order", "r3-order", store.store_id))
        self.assertEqual(pending["arguments"], {"items": PLAN["items"]})
        later = OrderDesk(delays={})
        done = await self.order(store, later, approvals={"r3-order": "approve"})
        self.assertEqual((done["status"], done["answer"], later.started, later.effects),
                         ("completed", PLAN, ["r3-order"], [pending["idempotency_key"]]))
        again = await self.order(store, OrderDesk(delays={}), approvals={"r3-order": "approve"})
        self.assertEqual(again, done)  # ended: the stored result, and nothing runs twice

    async def test_a_writes_verdict_and_start_are_its_own_saved_state_not_the_traces(self):
        store, seen = self.store(), []

        class Looking(OrderDesk):  # what the store holds as the order's tool gets it
            async def invoke(self, call):
                if call["name"] == "place_order":
                    seen.append(store.load("order")["state"]["writes"])
                return await super().invoke(call)

        paused = await self.order(store, approve=lambda write: "ask")
        self.assertEqual(store.load("order")["state"]["writes"],
                         {"r3-order": {"verdict": "ask", "by": "policy", "started": False}})
        store.db.execute("DELETE FROM agent_loop_events WHERE body LIKE '%\"approval\"%'")  # the trace says nothing
        desk = Looking(delays={})
        done = await self.order(store, desk, approvals={"r3-order": "approve"})
        self.assertEqual((paused["status"], done["status"], desk.effects), ("awaiting_approval", "completed",
                                                                              [paused["pending"][0]["idempotency_key"]]))
        self.assertEqual(seen, [{"r3-order": {"verdict": "approve", "by": "approvals", "started": True}}])

    async def test_the_old_name_for_approvals_is_refused_saying_so(self):
        await self.assertRefusedBeforeTheModelIsAsked("decisions: run_agent takes no such option", store=self.store(),
                                                      run_id="job", decisions={"a": "approve"})

    async def test_a_paused_runs_tools_see_no_call_until_the_decision_and_a_decision_is_used_once(self):
        store, desk = self.store(), OrderDesk(delays={})
        await self.order(store, desk, approve=lambda write: "ask")
        for _ in range(3):  # called again without approvals: it pauses again, and no tool is called
            idle = OrderDesk(delays={})
            result = await self.order(store, idle)
            self.assertEqual((result["status"], idle.started), ("awaiting_approval", []))
        with self.assertRaises(ValueError) as raised:
            await self.order(store, approvals={"r2-plan": "approve"})
        self.assertEqual(str(raised.exception), "r2-plan: not a write awaiting approval in this run")

    async def test_a_policy_that_raises_or_says_anything_else_asks_and_no_write_starts(self):
        def raises(write):
            raise RuntimeError("private detail of a policy")

        for policy in (raises, lambda write: "yes", lambda write: None, lambda write: ["approve"]):
            with self.subTest(policy=policy):
                desk = OrderDesk(delays={})
                result = await self.order(self.store(), desk, approve=policy)
                self.assertEqual((result["status"], "r3-order" in desk.started), ("awaiting_approval", False))
                self.assertNoPrivateText(result)

    async def test_a_rejected_write_aborts_its_whole_batch_and_the_model_decides_again(self):
        batch = calls(call("read", partition="north"), call("order", "place_order", items=PLAN["items"]))
        desk = OrderDesk(delays={})
        result = await self.order(self.store(), desk, model=scripted(batch, final(PLAN)), approve=lambda write: "reject")
        self.assertEqual((result["status"], desk.started), ("invalid_final", []))  # the read never started either
        read, order = result["history"][0]["observations"]
        self.assertEqual([(obs["error"], obs["retryable"]) for obs in (read, order)], [("rejected", True)] * 2)
        self.assertEqual((order["reason"], read["reason"]),
                         ("the write was rejected", "another call of the batch was rejected: order"))

    async def test_a_decision_after_approval_seconds_starts_nothing(self):
        store, limits = self.store(), dataclasses.replace(ROOMY, approval_seconds=0.05)
        await self.order(store, approve=lambda write: "ask", limits=limits)
        await asyncio.sleep(0.2)
        desk = OrderDesk(delays={})
        result = await self.order(store, desk, approvals={"r3-order": "approve"}, limits=limits)
        self.assertEqual((result["status"], desk.started, store.unfinished()), ("approval_expired", [], []))

    async def test_the_time_paused_is_no_time_of_the_runs(self):
        store, limits = self.store(), dataclasses.replace(ROOMY, total_seconds=0.5)
        await self.order(store, approve=lambda write: "ask", limits=limits)
        await asyncio.sleep(0.7)  # longer than the run's whole time: paused, it is not counted
        result = await self.order(store, approvals={"r3-order": "approve"}, limits=limits)
        self.assertEqual(result["status"], "completed")

    async def test_approvals_for_some_writes_are_kept_until_every_write_has_one(self):
        two = calls(call("a", "place_order", items=PLAN["items"][:1]), call("b", "place_order", items=PLAN["items"][1:]))
        model, store = scripted(two, final("done")), self.store()
        accept = lambda answer, history: answer == "done"  # noqa: E731
        side_by_side = {**ORDER_TOOLS, "place_order": dataclasses.replace(  # it says it may: writes do not
            ORDER_TOOLS["place_order"], parallel_safe=True)}
        self.order = functools.partial(self.order, registry=side_by_side)
        first = await self.order(store, model=model, approve=lambda write: "ask", accept=accept)
        self.assertEqual([write["call_id"] for write in first["pending"]], ["a", "b"])
        second = await self.order(store, model=model, approvals={"a": "approve"}, accept=accept)
        self.assertEqual((second["status"], [write["call_id"] for write in second["pending"]]), ("awaiting_approval", ["b"]))
        desk = OrderDesk(delays={})
        done = await self.order(store, desk, model=model, approvals={"b": "approve"}, accept=accept)
        self.assertEqual((done["status"], desk.started), ("completed", ["a", "b"]))  # one after the other
        self.assertIs(done["trace"][-3]["parallel"], False)
        at_once = await self.order(self.store(), model=model, approve=lambda write: "approve", accept=accept)
        (observed,) = [event for event in at_once["trace"] if event["event"] == "observations"]
        self.assertIs(observed["parallel"], False)  # approved at once: still one after the other

    async def test_a_write_functions_key_is_stable_and_one_without_it_is_refused(self):
        keys = []

        def place(items, idempotency_key):
            keys.append(idempotency_key)
            return {"order": "PO-1"}

        registry = {"place": ToolSpec(1, False, False, parameters=agent_loop._closed(items={"type": "array"}))}
        model = scripted(calls(call("w1", "place", items=[1])), final("placed"))
        store, other = self.store(), self.store()
        result = await run_agent(model, registry=registry, fixtures=agent_loop.FunctionTools({"place": place}),
                                 accept=lambda answer, history: True, store=store, run_id="job",
                                 approve=lambda write: "approve", limits=ROOMY)
        key = agent_loop.idempotency_key("job", "w1", store.store_id)
        self.assertEqual((result["status"], keys), ("completed", [key]))
        self.assertEqual(key, agent_loop.idempotency_key("job", "w1", store.store_id))
        self.assertNotEqual(agent_loop.idempotency_key("job:w", "1"), agent_loop.idempotency_key("job", "w:1"))
        self.assertNotEqual(key, agent_loop.idempotency_key("job", "w1", other.store_id))  # a run of another store
        await self.assertRefusedBeforeTheModelIsAsked(
            "place: a write function takes the keyword argument idempotency_key", registry=registry,
            fixtures=agent_loop.FunctionTools({"place": lambda items: None}), accept=never_accept,
            store=self.store(), run_id="job", approve=lambda write: "approve")

    async def test_writes_are_opt_in_and_what_they_need_is_checked_before_the_model_is_asked(self):
        desk = OrderDesk(delays={})
        plain = await run_agent(order_model, registry=ORDER_TOOLS, accept=order_accepted,
                                fixtures=desk, limits=ROOMY)  # no approve: a write is refused, as in the article
        self.assertEqual((plain["status"], "r3-order" in desk.started), ("permission_denied", False))
        desk = OrderDesk(delays={})
        stored = await self.order(self.store(), desk)  # a store, but no approve: still refused
        self.assertEqual((stored["status"], "r3-order" in desk.started), ("permission_denied", False))
        store = self.store()
        cases = [({"approve": lambda write: "approve"}, "approve needs a store, so that a write's fate survives a "
                                                         "crash: give the store too"),
                 ({"approvals": {"a": "approve"}}, "approvals are for a run in a store: give the store too"),
                 ({"store": store, "run_id": "x", "approve": "approve"}, "approve must be a plain function of a write's call"),
                 ({"store": store, "run_id": "x", "approvals": {"a": "yes"}},
                  "approvals must be a dict of call ids to 'approve' or 'reject'"),
                 ({"store": store, "run_id": "x", "approvals": {"a": "approve"}},
                  "a: not a write awaiting approval in this run")]
        for options, message in cases:
            with self.subTest(message=message):
                await self.assertRefusedBeforeTheModelIsAsked(message, registry=ORDER_TOOLS,
                                                              fixtures=OrderDesk(), accept=never_accept,
                                                              **options)
        self.assertEqual(store.unfinished(), [])

    async def test_an_order_that_timed_out_after_it_applied_is_reconciled_not_placed_twice(self):
        desk = OrderDesk(delays={}, failures={"place_order": ["timeout_after_apply"]})
        result = await self.order(self.store(), desk, approve=lambda write: "approve",
                                  limits=dataclasses.replace(ROOMY, tool_seconds=0.2))
        order = result["history"][2]["observations"][0]
        self.assertEqual((result["status"], order["ok"], order["reconciled"], len(desk.effects)),
                         ("completed", True, True, 1))
        (shown,) = code_blocks(readme_section("Tools that write"), "json")
        self.assertEqual(json.loads(shown), order)

    async def test_an_unknown_outcome_pauses_the_run_and_a_later_call_asks_reconcile_again(self):
        class Unsure(OrderDesk):  # it cannot tell the first time, and can the second
            answers = [{"applied": "perhaps"}]
            asked = []

            async def reconcile(self, call):
                self.asked.append(call["idempotency_key"])
                return self.answers.pop(0) if self.answers else await super().reconcile(call)

        store = self.store()
        desk = Unsure(delays={}, failures={"place_order": ["timeout_after_apply"]})
        limits = dataclasses.replace(ROOMY, tool_seconds=0.2)
        paused = await self.order(store, desk, approve=lambda write: "approve", limits=limits)
        self.assertEqual((paused["status"], [write["call_id"] for write in paused["unknown"]]),
                         ("unknown_outcome", ["r3-order"]))
        self.assertFalse(order_accepted(PLAN, paused["history"]))  # an unknown write is no evidence
        resumed = await self.order(store, desk, limits=limits)
        key = agent_loop.idempotency_key("order", "r3-order", store.store_id)
        self.assertEqual(desk.asked, [key, key])  # asked again, with the same key
        self.assertEqual(resumed["history"][2]["observations"][0]["reconciled"], True)
        self.assertEqual((resumed["status"], len(desk.effects)), ("completed", 1))  # it applied once, and only once
        self.assertIn({"event": "reconciled", "round": 3, "call_id": "r3-order", "outcome": "applied",
                       "rounds": 3, "calls": 4, "credits": 20}, resumed["trace"])

    async def test_a_write_that_did_not_apply_says_so_and_only_an_unknown_one_is_reconciled(self):
        asked = []

        class Desk(OrderDesk):
            async def reconcile(self, call):
                asked.append(call["call_id"])
                return await super().reconcile(call)

        for fault, error in (("temporary", "temporary"), ("timeout", "not_applied")):
            with self.subTest(fault=fault):
                asked.clear()
                desk = Desk(delays={}, failures={"place_order": [fault]})
                result = await self.order(self.store(), desk, approve=lambda write: "approve",
                                          limits=dataclasses.replace(ROOMY, tool_seconds=0.2))
                order = result["history"][2]["observations"][0]
                self.assertEqual((order["error"], order["retryable"]), (error, True))
                self.assertEqual(asked, [] if fault == "temporary" else ["r3-order"])
                self.assertEqual((result["status"], len(desk.effects)), ("completed", 1))  # placed later, once

    async def test_a_write_that_lost_its_connection_is_reconciled_never_tried_again(self):
        class Dropped(OrderDesk):  # it places the order, then the connection drops before the answer
            async def invoke(self, call):
                placed = await super().invoke(call)
                if call["name"] == "place_order" and len(self.effects) == 1 and len(self.started) == 4:
                    raise ConnectionError("private: reset by peer")
                return placed

        desk = Dropped(delays={})
        result = await self.order(self.store(), desk, approve=lambda write: "approve")
        order = result["history"][2]["observations"][0]
        self.assertEqual((result["status"], order["ok"], order.get("reconciled")), ("completed", True, True))
        self.assertEqual((desk.started.count("r3-order"), len(desk.effects)), (1, 1))  # not a read: never temporary
        self.assertNoPrivateText(result)

    async def test_a_write_whose_thread_outlives_its_time_is_not_reconciled_until_the_thread_ends(self):
        release, effects, asked = threading.Event(), [], []

        def place(items, idempotency_key):
            release.wait(30)  # the request is still on its way when the runtime stops waiting
            effects.append(idempotency_key)
            return {"order": "PO-1"}

        def reconcile(call):
            asked.append(call["call_id"])
            return {"applied": True, "data": {"order": "PO-1"}} if effects else {"applied": False}

        registry = {"place": ToolSpec(1, False, False, parameters=agent_loop._closed(items={"type": "array"}))}
        tools, store = agent_loop.FunctionTools({"place": place}, reconcile=reconcile), self.store()

        async def model(history):  # it would place the order again under a new call id, if told it did not apply
            placed = [obs for record in history for obs in record["observations"] if obs["ok"]]
            return final("placed") if placed else calls(call(f"w{len(history) + 1}", "place", items=[1]))

        options = dict(registry=registry, fixtures=tools, accept=lambda answer, history: True, store=store,
                       run_id="job", limits=dataclasses.replace(ROOMY, tool_seconds=0.1))
        paused = await run_agent(model, approve=lambda write: "approve", **options)
        self.assertEqual((paused["status"], asked), ("unknown_outcome", []))  # nothing known while the thread runs
        release.set()
        self.assertTrue(await tools.wait_abandoned(30))
        done = await run_agent(model, **options)
        self.assertEqual((done["status"], asked, len(effects)), ("completed", ["w1"], 1))

    async def test_an_order_reconciled_as_not_placed_is_never_placed_later(self):
        desk = OrderDesk(delays={})
        order = {"call_id": "late", "name": "place_order", "arguments": {"items": PLAN["items"]},
                 "idempotency_key": "k1"}
        self.assertEqual(await desk.reconcile(order), {"applied": False})
        with self.assertRaises(agent_loop.ToolError):
            await desk.invoke(order)  # the request that was still on its way, arriving after the no
        self.assertEqual((desk.effects, await desk.reconcile(order)), ([], {"applied": False}))

    async def test_approvals_are_checked_again_against_the_run_as_claimed(self):
        path = os.path.join(tempfile.mkdtemp(prefix="agent_loop_write_"), "runs.db")
        self.addCleanup(shutil.rmtree, os.path.dirname(path), True)
        store = self.store(path)
        await self.order(store, approve=lambda write: "ask")

        class Late(agent_loop.SqliteStore):  # between its check and its claim, another process started the write
            def claim(self, run_id, config, started):
                with contextlib.closing(sqlite3.connect(path)) as other:
                    write = json.dumps({"verdict": "approve", "by": "approvals", "started": True})
                    other.execute("UPDATE agent_loop_runs SET state = json_set(state, '$.waits', NULL, "
                                  "'$.writes.r3-order', json(?))", (write,))
                    other.commit()
                return super().claim(run_id, config, started)

        late = Late(path)
        self.addCleanup(late.close)
        with self.assertRaises(ValueError) as raised:
            await self.order(late, approvals={"r3-order": "reject"})
        self.assertEqual(str(raised.exception), "r3-order: not a write awaiting approval in this run")
        row = store._sql("SELECT holder, lease_until FROM agent_loop_runs WHERE run_id = 'order'").fetchone()
        self.assertEqual(tuple(row), (None, None))  # the claim it made is let go

    async def test_a_store_that_fails_to_save_a_write_as_started_stops_the_run_before_the_tool_has_it(self):
        class Flaky(agent_loop.SqliteStore):  # it fails once, at the save of the write-ahead record
            failed = False

            def save(self, run_id, generation, state, records, events, end=None):
                if not self.failed and any(event["event"] == "write" for event in events):
                    self.failed = True
                    raise sqlite3.OperationalError("database is locked")
                return super().save(run_id, generation, state, records, events, end)

        store, desk = Flaky(":memory:"), OrderDesk(delays={})
        self.addCleanup(store.close)
        result = await self.order(store, desk, approve=lambda write: "approve")
        self.assertEqual((result["status"], result["trace"][-1]["error_type"]), ("store_failed", "OperationalError"))
        self.assertEqual((desk.started, desk.effects), (["r1-north", "r1-south", "r2-plan"], []))

    async def test_a_write_cut_by_a_cancel_or_the_deadline_pauses_and_a_later_call_settles_it(self):
        class Desk(OrderDesk):
            asked = []

            async def reconcile(self, call):
                self.asked.append(call["call_id"])
                return await super().reconcile(call)

        for how in ("cancel", "deadline"):
            with self.subTest(how=how):
                store, cancel = self.store(), asyncio.Event()
                desk = Desk(delays={}, failures={"place_order": ["timeout_after_apply"]})
                desk.asked = []
                limits = Limits(tool_seconds=5, model_seconds=5, total_seconds=30 if how == "cancel" else 0.3)

                async def cut():
                    await wait_until(lambda: desk.effects)
                    if how == "cancel":
                        cancel.set()

                result, _ = await asyncio.gather(self.order(store, desk, approve=lambda write: "approve",
                                                            limits=limits, cancel=cancel), cut())
                self.assertEqual((result["status"], [write["call_id"] for write in result["unknown"]]),
                                 ("cancelled" if how == "cancel" else "deadline", ["r3-order"]))
                self.assertEqual((store.unfinished(), desk.asked), (["order"], []))  # paused, not ended
                again = await self.order(store, desk, limits=limits)
                self.assertEqual(desk.asked, ["r3-order"])  # settled, even past the deadline
                self.assertEqual((again["status"], len(desk.effects)), ("completed" if how == "cancel" else "deadline", 1))
                self.assertEqual(store.unfinished(), [])

    async def test_a_write_whose_watcher_outlasts_the_deadline_never_reaches_its_tool(self):
        async def watcher(event):
            if event["event"] == "write":
                await asyncio.sleep(1)  # the run's whole time, and more

        desk = OrderDesk(delays={})
        result = await self.order(self.store(), desk, approve=lambda write: "approve", on_event=watcher,
                                  limits=Limits(tool_seconds=5, model_seconds=5, total_seconds=0.3))
        self.assertEqual((result["status"], desk.effects), ("deadline", []))
        self.assertNotIn("r3-order", desk.started)

    async def test_an_unknown_write_holds_back_the_rest_of_its_batch_until_it_is_settled(self):
        class Unsure(OrderDesk):  # it cannot tell the first time, and can the second
            answers = [{"applied": "perhaps"}]

            async def reconcile(self, call):
                return self.answers.pop(0) if self.answers else await super().reconcile(call)

        batch = calls(call("w", "place_order", items=PLAN["items"]), call("r", partition="north"))
        model, store = scripted(batch, final("done")), self.store()
        desk = Unsure(delays={}, failures={"place_order": ["timeout_after_apply"]})
        options = dict(model=model, accept=lambda answer, history: answer == "done",
                       limits=dataclasses.replace(ROOMY, tool_seconds=0.2))
        paused = await self.order(store, desk, approve=lambda write: "approve", **options)
        self.assertEqual((paused["status"], desk.started), ("unknown_outcome", ["w"]))  # the read never started
        self.assertEqual(order_errors(paused), ["unknown_outcome", "batch_aborted"])
        done = await self.order(store, desk, **options)
        self.assertEqual((done["status"], desk.started, order_errors(done)), ("completed", ["w", "r"], []))
        self.assertEqual((done["used"]["calls"], len(desk.effects)), (2, 1))  # each call charged once

    async def test_in_a_batch_with_a_write_nothing_starts_after_a_call_that_did_not_succeed(self):
        """The notice is sent, then the cancel fails: the calls after it wait for the model, uncharged."""
        write = functools.partial(call, name="place_order", items=PLAN["items"])
        accept = lambda answer, history: answer == "done"  # noqa: E731
        for failures, batch, failed in (
                ({"place_order": ["temporary"]}, [write("w"), call("r", partition="north"), write("w2")], "w"),
                ({"place_order": ["timeout"]}, [write("w"), call("r", partition="north")], "w"),  # not_applied
                ({"north": ["temporary"]}, [call("r", partition="north"), write("w")], "r")):
            with self.subTest(failed=failed, batch=[item["call_id"] for item in batch]):
                desk = OrderDesk(delays={}, failures=failures)
                result = await self.order(self.store(), desk, model=scripted(calls(*batch), final("done")),
                                          approve=lambda write: "approve", accept=accept,
                                          limits=dataclasses.replace(ROOMY, tool_seconds=0.2))
                first, *rest = result["history"][0]["observations"]
                self.assertEqual((result["status"], first["ok"], first["retryable"]), ("completed", False, True))
                self.assertEqual([(obs["error"], obs["retryable"], obs["reason"]) for obs in rest],
                                 [("batch_aborted", True, f"{failed} did not succeed: nothing after it started")]
                                 * len(rest))
                self.assertEqual((desk.started, result["used"]["calls"]), ([failed], 1))
        desk, reads = OrderDesk(delays={}, failures={"north": ["temporary"]}), scripted(
            calls(call("r", partition="north"), call("s", partition="south")), final("done"))
        at_once = await self.order(self.store(), desk, model=reads, accept=accept)
        self.assertEqual((order_errors(at_once), desk.started), (["temporary"], ["r", "s"]))  # reads alone: as ever

    async def test_a_write_settled_as_not_applied_on_resume_keeps_the_rest_of_its_batch_from_starting(self):
        class Unsure(OrderDesk):  # it cannot tell the first time; then it says the order was never placed
            answers = [{"applied": "perhaps"}]

            async def reconcile(self, call):
                return self.answers.pop(0) if self.answers else await super().reconcile(call)

        batch = calls(call("w", "place_order", items=PLAN["items"]), call("r", partition="north"))
        options = dict(model=scripted(batch, final("done")), accept=lambda answer, history: answer == "done",
                       limits=dataclasses.replace(ROOMY, tool_seconds=0.2))
        store, desk = self.store(), Unsure(delays={}, failures={"place_order": ["timeout"]})
        paused = await self.order(store, desk, approve=lambda write: "approve", **options)
        done = await self.order(store, desk, **options)
        self.assertEqual((paused["status"], done["status"], desk.started), ("unknown_outcome", "completed", ["w"]))
        self.assertEqual([(obs["error"], obs["retryable"]) for obs in done["history"][0]["observations"]],
                         [("not_applied", True), ("batch_aborted", True)])
        self.assertEqual((done["used"]["calls"], desk.effects), (1, []))

    async def test_a_crash_just_after_a_paused_run_resumed_keeps_it_paused(self):
        store = self.store()
        await self.order(store, approve=lambda write: "ask")

        resumed = []

        async def crash_at(event):
            if event["event"] == "resumed":
                resumed.append(event)
                await asyncio.sleep(60)  # resumed, before anything else is saved; then the process dies

        task = asyncio.create_task(self.order(store, approvals={"r3-order": "approve"}, on_event=crash_at))
        await wait_until(lambda: resumed)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        desk = OrderDesk(delays={})
        done = await self.order(store, desk, approvals={"r3-order": "approve"})
        self.assertEqual((done["status"], desk.started, order_errors(done)), ("completed", ["r3-order"], []))
        self.assertEqual(done["used"], {"rounds": 4, "calls": 4, "credits": 23})  # the order charged once

    async def test_a_batch_a_crash_cut_once_its_writes_were_decided_is_charged_for_what_may_have_started(self):
        started, hang = [], threading.Event()
        self.addCleanup(hang.set)

        def read(item):
            started.append("read")
            hang.wait(30 if len(started) == 1 else 0)  # the first read hangs: the process dies meanwhile
            return {"item": item}

        def place(items, idempotency_key):
            started.append("place")
            return {"order": "PO-1"}

        async def model(history):
            return final("done") if history else calls(call("r1", "read", item="a"), call("w1", "place", items=[1]))

        registry = {"read": ToolSpec(1, True, False, parameters=agent_loop._closed(item={"type": "string"})),
                    "place": ToolSpec(1, False, False, parameters=agent_loop._closed(items={"type": "array"}))}
        options = dict(registry=registry, fixtures=agent_loop.FunctionTools({"read": read, "place": place}),
                       accept=lambda answer, history: answer == "done", store=self.store(), run_id="job",
                       limits=SLOW_ROOMY)
        paused = await run_agent(model, approve=lambda write: "ask", **options)
        self.assertEqual(paused["status"], "awaiting_approval")
        task = asyncio.create_task(run_agent(model, approvals={"w1": "approve"}, **options))
        await wait_until(lambda: started)
        task.cancel()  # the crash, while the read of the decided batch runs
        await asyncio.gather(task, return_exceptions=True)
        done = await run_agent(model, **options)
        self.assertEqual((done["status"], started), ("completed", ["read"]))  # nothing of the batch ran again
        read, place = done["history"][0]["observations"]
        self.assertEqual([(obs["error"], obs["retryable"]) for obs in (read, place)],
                         [("interrupted", True), ("batch_aborted", True)])  # the read may have started; the write not
        self.assertEqual((place["reason"], done["used"]["calls"]), ("r1 did not succeed: nothing after it started", 1))

    async def test_a_serial_batch_a_crash_cut_after_a_failure_was_saved_resumes_with_nothing_after_it_started(self):
        """Each observation of a serial batch is saved before the next call starts: what a crash cut after a saved
        failure never started, and its resume and cancel_run charge none of it."""
        started, saved, hold = [], threading.Event(), threading.Event()
        self.addCleanup(hold.set)

        def read(x):
            started.append(x)
            if x == "a":
                raise agent_loop.ToolError("no such row")
            return {"x": x}

        def write(x, idempotency_key):
            started.append(x)
            return {"x": x}

        class Dying(agent_loop.SqliteStore):  # it saves a's failure, then the process dies (it hangs: we cut it)
            def save(self, run_id, generation, state, records, events, end=None):
                super().save(run_id, generation, state, records, events, end)
                if any(not obs["ok"] for record in records for obs in record["observations"]):
                    saved.set()
                    hold.wait(30)

        registry = {"r": ToolSpec(1, True, False, parameters=agent_loop._closed(x={"type": "string"})),
                    "w": ToolSpec(3, False, False, parameters=agent_loop._closed(x={"type": "string"}))}
        batch = calls(call("a", "r", x="a"), call("b", "w", x="b"), call("d", "r", x="d"))
        options = dict(registry=registry, fixtures=agent_loop.FunctionTools({"r": read, "w": write}),
                       accept=lambda answer, history: answer == "done", run_id="x", approve=lambda write: "approve",
                       limits=SLOW_ROOMY)
        folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, folder)
        path = os.path.join(folder, "runs.db")
        dying = Dying(path)
        self.addCleanup(dying.close)
        cut = asyncio.create_task(run_agent(scripted(batch, final("done")), store=dying, **options))
        await asyncio.to_thread(saved.wait, 30)
        cut.cancel()  # the crash: a's failure saved, nothing after it
        hold.set()
        await asyncio.gather(cut, return_exceptions=True)
        with agent_loop.SqliteStore(path) as other:
            cancelled_copy = os.path.join(folder, "copy.db")
            with contextlib.closing(sqlite3.connect(cancelled_copy)) as copy:
                other.db.backup(copy)
            done = await run_agent(scripted(batch, final("done")), store=other, **options)
        self.assertEqual((done["status"], started), ("completed", ["a"]))
        self.assertEqual([(obs["error"], obs["retryable"], obs.get("reason")) for obs in observations(done)],
                         [("tool_error", True, None)] + [("batch_aborted", True, "a did not succeed: nothing after it "
                                                          "started")] * 2)
        self.assertEqual(done["used"], {"rounds": 2, "calls": 1, "credits": 7})  # a alone, and two decisions
        with agent_loop.SqliteStore(cancelled_copy) as copy:  # the same saved state, cancelled instead
            self.assertEqual(copy.cancel_run("x"), "cancelled")
            ended = copy.load("x")
        self.assertEqual((ended["state"]["used"], [obs["error"] for obs in ended["history"][0]["observations"]]),
                         ({"rounds": 1, "calls": 1, "credits": 4}, ["tool_error", "cancelled", "cancelled"]))

    async def test_a_write_asked_about_after_a_rejected_one_has_a_clock_of_its_own(self):
        async def model(history):  # an order, and another under a new call id if it was rejected
            placed = [obs for record in history for obs in record["observations"] if obs["ok"]]
            return final("placed") if placed else calls(call(f"w{len(history) + 1}", "place", items=[1]))

        registry = {"place": ToolSpec(1, False, False, parameters=agent_loop._closed(items={"type": "array"}))}
        options = dict(registry=registry, fixtures=agent_loop.FunctionTools({"place": lambda items, idempotency_key: 1}),
                       accept=lambda answer, history: True, store=self.store(), run_id="job", limits=ROOMY)
        first = await run_agent(model, approve=lambda write: "ask", **options)
        asked = lambda: options["store"].load("job")["state"]["asked_at"]  # noqa: E731
        first_asked = asked()
        second = await run_agent(model, approvals={"w1": "reject"}, **options)
        self.assertEqual(([w["call_id"] for w in first["pending"]], [w["call_id"] for w in second["pending"]]),
                         (["w1"], ["w2"]))
        self.assertGreater(asked(), first_asked)  # w2's clock runs from when w2 was asked about

    async def test_a_batch_after_a_rejected_write_that_a_crash_cut_is_charged_and_interrupted(self):
        started, hang = [], threading.Event()
        self.addCleanup(hang.set)

        def read(item):
            started.append(item)
            hang.wait(30 if len(started) == 1 else 0)
            return {"item": item}

        async def model(history):  # a write, rejected; then a read, that the crash cuts; then the answer
            if not history:
                return calls(call("w1", "place", items=[1]))
            return final("done") if len(history) > 2 else calls(call(f"r{len(history)}", "read", item="a"))

        registry = {"read": ToolSpec(1, True, True, parameters=agent_loop._closed(item={"type": "string"})),
                    "place": ToolSpec(1, False, False, parameters=agent_loop._closed(items={"type": "array"}))}
        tools = agent_loop.FunctionTools({"read": read, "place": lambda items, idempotency_key: 1})
        options = dict(registry=registry, fixtures=tools, accept=lambda answer, history: answer == "done",
                       store=self.store(), run_id="job", limits=SLOW_ROOMY)
        await run_agent(model, approve=lambda write: "ask", **options)
        task = asyncio.create_task(run_agent(model, approvals={"w1": "reject"}, **options))
        await wait_until(lambda: started)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        done = await run_agent(model, **options)
        self.assertEqual((done["status"], [obs.get("error") for obs in done["history"][1]["observations"]]),
                         ("completed", ["interrupted"]))  # not taken for the batch that waited for approvals
        self.assertEqual(started, ["a", "a"])  # round 3's read, asked for by the model: not round 2's run again

    async def test_a_batch_with_a_write_that_a_crash_cut_before_its_gate_is_cut_whatever_paused_before(self):
        async def model(history):  # an order, and another under a new call id until one is placed
            placed = [obs for record in history for obs in record["observations"] if obs["ok"]]
            number = len(history) + 1
            return final("placed") if placed else calls(call(f"w{number}", "place", items=[number]))

        registry = {"place": ToolSpec(1, False, False, parameters=agent_loop._closed(items={"type": "array"}))}
        options = dict(registry=registry, fixtures=agent_loop.FunctionTools({"place": lambda items, idempotency_key: 1}),
                       accept=lambda answer, history: True, store=self.store(), run_id="job", limits=ROOMY)
        await run_agent(model, approve=lambda write: "ask", **options)  # round 1's w1 waits for a decision
        await run_agent(model, approvals={"w1": "reject"}, **options)  # rejected; round 2's w2 waits too
        db = options["store"].db  # what a crash just after round 2 was admitted leaves: its gate never asked
        (last,) = db.execute("SELECT MAX(seq) FROM agent_loop_events WHERE body LIKE '%\"decision\", \"round\": 2%'"
                             ).fetchone()
        db.execute("DELETE FROM agent_loop_events WHERE seq > ?", (last,))
        db.execute("UPDATE agent_loop_runs SET state = json_remove(json_set(state, '$.waits', NULL, '$.paused_at', "
                   "NULL, '$.asked_at', NULL), '$.writes.w2')")
        done = await run_agent(model, approve=lambda write: "approve", **options)
        self.assertEqual((done["status"], done["history"][1]["observations"][0]["error"]), ("completed", "interrupted"))

    async def test_a_reconcile_that_raises_anything_on_resume_leaves_the_write_unknown(self):
        class Boom(BaseException):
            pass

        async def run(raised):
            class Raising(OrderDesk):
                calls = 0

                async def reconcile(self, call):
                    self.calls += 1
                    if self.calls > 1:  # on resume
                        raise raised
                    return None

            store, limits = self.store(), dataclasses.replace(ROOMY, tool_seconds=0.2)
            desk = Raising(delays={}, failures={"place_order": ["timeout_after_apply"]})
            paused = await self.order(store, desk, approve=lambda write: "approve", limits=limits)
            return paused["status"], (await self.order(store, desk, limits=limits))["status"], desk.calls

        raising = (asyncio.CancelledError, GeneratorExit, Boom, agent_loop.Stop("deadline"))  # (not ^C: it leaves)
        for raised, outcome in zip(raising, await asyncio.gather(*map(run, raising))):
            with self.subTest(raised=raised):
                self.assertEqual(outcome, ("unknown_outcome", "unknown_outcome", 2))

    async def test_approvals_given_to_an_ended_run_must_be_the_verdicts_it_had(self):
        store = self.store()
        await self.order(store, approve=lambda write: "ask")
        done = await self.order(store, approvals={"r3-order": "approve"})
        self.assertEqual(done["status"], "completed")
        self.assertEqual(await self.order(store, approvals={"r3-order": "approve"}), done)
        for approvals in ({"r3-order": "reject"}, {"nope": "approve"}):
            with self.subTest(approvals=approvals), self.assertRaises(ValueError) as refused:
                await self.order(store, approvals=approvals)
            self.assertEqual(str(refused.exception),
                             f"{list(approvals)[0]}: the run has ended, completed: no write of it awaits approval")

    async def test_tools_whose_reconcile_is_not_async_are_refused_before_the_model_is_asked(self):
        class Plain(OrderDesk):
            def reconcile(self, call):
                return {"applied": False}

        await self.assertRefusedBeforeTheModelIsAsked(
            "reconcile: the tools' reconcile must be async (FunctionTools takes a plain function)",
            registry=ORDER_TOOLS, fixtures=Plain(delays={}), accept=never_accept, store=self.store(),
            run_id="job", approve=lambda write: "approve")

    async def test_a_store_of_your_own_serves_a_run_with_the_five_methods_and_writes_with_a_store_id(self):
        first = dict_store()
        result = await run_agent(store=first, run_id="job", limits=ROOMY)
        self.assertEqual((result["status"], first.unfinished(), await run_agent(store=first, run_id="job", limits=ROOMY)),
                         ("completed", [], result))
        with self.assertRaisesRegex(ValueError, "^a store that runs writes needs a store_id"):
            await self.order(dict_store(), approve=lambda write: "approve")
        keys = []
        for store_id in ("one", "two"):
            store, desk = dict_store(store_id), OrderDesk(delays={})
            done = await self.order(store, desk, approve=lambda write: "approve")
            keys += desk.effects
            self.assertEqual(done["status"], "completed")
        self.assertEqual(keys, [agent_loop.idempotency_key("order", "r3-order", store_id) for store_id in ("one", "two")])

    async def test_a_plain_reconcile_function_runs_in_a_thread_bounded_by_tool_seconds(self):
        release = threading.Event()
        self.addCleanup(release.set)

        def place(items, idempotency_key):
            raise TimeoutError  # said nothing of its fate: unknown

        def reconcile(call):
            release.wait(30)  # it blocks: the loop goes on without it
            return {"applied": False}

        registry = {"place": ToolSpec(1, False, False, parameters=agent_loop._closed(items={"type": "array"}))}
        result = await run_agent(scripted(calls(call("w", "place", items=[1]))), registry=registry,
                                 fixtures=agent_loop.FunctionTools({"place": place}, reconcile=reconcile),
                                 accept=lambda answer, history: True, store=self.store(), run_id="job",
                                 approve=lambda write: "approve", limits=dataclasses.replace(ROOMY, tool_seconds=0.2))
        self.assertEqual((result["status"], release.is_set()), ("unknown_outcome", False))

    async def test_the_time_to_decide_counts_from_the_first_ask_whatever_calls_came_between(self):
        now = [1_000.0]
        clock = types.SimpleNamespace(time=lambda: now[0], perf_counter=time.perf_counter, monotonic=time.monotonic)
        store, limits = self.store(), dataclasses.replace(ROOMY, approval_seconds=10)
        with unittest.mock.patch.object(agent_loop, "time", clock):
            await self.order(store, approve=lambda write: "ask", limits=limits)
            now[0] += 6
            again = await self.order(store, approve=lambda write: "ask", limits=limits)
            self.assertEqual(again["status"], "awaiting_approval")
            now[0] += 6  # 12 seconds after the ask, 6 after the last call
            late = await self.order(store, approvals={"r3-order": "approve"}, limits=limits)
        self.assertEqual(late["status"], "approval_expired")

    async def test_what_reconcile_says_counts_only_as_plain_data(self):
        odd = [{"applied": True, "data": data}
               for data in (datetime.datetime(2026, 1, 1), decimal.Decimal("1.5"), object(), (1, 2), math.nan)]
        answers = (*odd, {"applied": 0}, {"applied": 0.0}, {"applied": False, "data": 1}, {"applied": 1})

        async def run(said):
            class Odd(OrderDesk):
                async def reconcile(self, call):
                    return said

            desk = Odd(delays={}, failures={"place_order": ["timeout_after_apply"]})
            return await self.order(self.store(), desk, approve=lambda write: "approve",
                                    limits=dataclasses.replace(ROOMY, tool_seconds=0.2))

        for said, result in zip(answers, await asyncio.gather(*map(run, answers))):  # side by side: their waits overlap
            with self.subTest(said=repr(said)):
                self.assertEqual((result["status"], order_errors(result)), ("unknown_outcome", ["unknown_outcome"]))

    async def test_empty_approvals_turn_no_write_on(self):
        desk = OrderDesk(delays={})
        result = await self.order(self.store(), desk, approvals={})
        self.assertEqual((result["status"], desk.effects), ("permission_denied", []))

    async def test_the_policy_is_asked_once_per_write_even_across_calls_and_edits_only_its_copy(self):
        asked = []

        def policy(write):
            asked.append(write["call_id"])
            write["arguments"]["items"] = []  # its own copy: neither history nor the tool sees this
            write.pop("call_id")
            return "ask"

        store = self.store()
        first = await self.order(store, approve=policy)
        again = await self.order(store, approve=policy)
        self.assertEqual((first["status"], again["status"], asked), ("awaiting_approval", "awaiting_approval",
                                                                    ["r3-order"]))
        self.assertEqual(again["pending"][0]["arguments"], {"items": PLAN["items"]})
        desk = OrderDesk(delays={})
        done = await self.order(store, desk, approvals={"r3-order": "approve"})
        self.assertEqual((done["status"], list(desk.orders.values())[0]["items"]), ("completed", PLAN["items"]))

    def test_a_cancel_of_a_run_a_crash_cut_in_a_write_waits_for_the_write_and_names_who_asked_first(self):
        folder = tempfile.mkdtemp(prefix="agent_loop_write_")
        self.addCleanup(shutil.rmtree, folder, True)
        store, service, ready = (os.path.join(folder, name) for name in ("runs.db", "service.db", "ready"))
        run_in_a_process("writing_run", store, service, ready, "after_apply", kill_when=ready)
        with agent_loop.SqliteStore(store, clock=lambda: time.time() + 3600) as later:  # its lease has run out
            asked = (later.cancel_run("order", by="ops"), later.cancel_run("order", by="ops2"))
            self.assertEqual((asked, later.overview()["runs"][0]["cancel"]), (("cancel_requested",) * 2, "ops"))
        result = run_in_a_process("writing_run", store, service, ready, "none")  # its write settled, then its end
        order = result["history"][2]["observations"][0]
        self.assertEqual((result["status"], result["trace"][-1]["by"], order["reconciled"]), ("cancelled", "ops", True))

    def test_a_write_killed_after_it_applied_applies_once_after_the_resume(self):
        folder = tempfile.mkdtemp(prefix="agent_loop_write_")
        self.addCleanup(shutil.rmtree, folder, True)
        store, service, ready = (os.path.join(folder, name) for name in ("runs.db", "service.db", "ready"))
        run_in_a_process("writing_run", store, service, ready, "after_apply", kill_when=ready)
        result = run_in_a_process("writing_run", store, service, ready, "none")
        with agent_loop.SqliteStore(store) as saved:
            key = agent_loop.idempotency_key("order", "r3-order", saved.store_id)
        with contextlib.closing(sqlite3.connect(service)) as db:
            effects = db.execute("SELECT key FROM effects").fetchall()
            asked = db.execute("SELECT key FROM asked").fetchall()
        self.assertEqual((result["status"], effects, asked), ("completed", [(key,)], [(key,)]))
        order = result["history"][2]["observations"][0]
        self.assertEqual((order["ok"], order["reconciled"]), (True, True))
        self.assertEqual([event["event"] for event in result["trace"]].count("write"), 1)
