"""PART 16: what a run costs its model: the tokens each reply used, counted apart from the budgets, and a limit on
them that fails safe, kept with a named run.
"""

import asyncio
import contextlib
import dataclasses
import io
import json
import os
import shutil
import sqlite3
import tempfile
import time
import unittest
import unittest.mock

import agent_loop
from agent_loop import call, fake_model, Fixtures, Limits, run_agent, scripted
from test_agent_loop import ALL_ROWS, calls, final, HERE, PLAN, ROOMY, RuntimeTestCase
from tests.support import (
    anthropic_reply, BRIDGES, chat_reply, fc, JOB_RUN_OPTIONS, message, output_text, Recorder, responses_reply,
    run_in_a_process, StoreTestCase, text_block,
)
from examples.orders import order_accepted, order_model, ORDER_TOOLS, OrderDesk


def used(input_tokens, output_tokens, **more):
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, **more}


def reporting(*replies):
    """A scripted model whose reply n carries replies[n][1] as its usage (None: it reports nothing)."""
    def with_usage(decision, usage):
        return decision if usage is None else {**decision, "usage": usage}
    return scripted(*(with_usage(decision, usage) for decision, usage in replies))


READS = calls(call("r1-north", partition="north"), call("r1-south", partition="south"))
PLANNED = calls(call("r2-plan", "compute_plan", rows=ALL_ROWS))
THREE = ((READS, used(100, 20)), (PLANNED, used(80, 10)), (final(PLAN), used(50, 5)))


def totals(requests, input_tokens, output_tokens, unreported=0, cached=0, reasoning=0):
    return {"requests": requests, "input_tokens": input_tokens, "output_tokens": output_tokens,
            "cached_input_tokens": cached, "reasoning_tokens": reasoning, "unreported": unreported}


class UsageTests(RuntimeTestCase):
    """PART 16: a reply's usage, read, checked and summed apart from the budgets; Limits.tokens."""

    async def test_three_replies_sum_exactly_and_the_budgets_and_events_stay_the_articles(self):
        result = await run_agent(reporting(*THREE), limits=ROOMY)
        plain = await run_agent(scripted(READS, PLANNED, final(PLAN)), limits=ROOMY)
        self.assertEqual((result["status"], result["usage"]), ("completed", totals(3, 230, 35)))
        self.assertEqual((result["used"], result["history"]), (plain["used"], plain["history"]))
        decisions = [event for event in result["trace"] if event["event"] == "decision"]
        self.assertEqual([event["usage"] for event in decisions], [usage for _, usage in THREE])
        self.assertEqual([{key: value for key, value in event.items() if key != "usage"} for event in result["trace"]],
                         plain["trace"])
        self.assertEqual(result["trace"][-1]["usage"], totals(3, 230, 35))
        self.assertNotIn("usage", plain)  # nothing reported, no limit: the article's five keys
        self.assertEqual(list(plain), ["status", "answer", "used", "history", "trace"])

    async def test_a_reply_that_takes_the_run_past_its_token_limit_ends_it_and_none_of_its_calls_starts(self):
        third = calls(call("r3-north", partition="north"))
        for tokens, status in ((264, "token_limit"), (265, "completed")):  # 120 + 90 + 55 = 265: past it, or at it
            with self.subTest(tokens=tokens):
                fixtures = Fixtures()
                model = reporting(THREE[0], THREE[1], (third, used(50, 5)), (final(PLAN), used(0, 0)))
                result = await run_agent(model, fixtures=fixtures, accept=lambda answer, history: True,
                                         limits=dataclasses.replace(ROOMY, tokens=tokens))
                self.assertEqual(result["status"], status)
                if status == "token_limit":
                    self.assertEqual((fixtures.started, result["used"]["rounds"]),
                                     (["r1-north", "r1-south", "r2-plan"], 3))
                    self.assertEqual(result["usage"], totals(3, 230, 35))  # the third stays counted
                    self.assertEqual(result["trace"][-1]["reason"], f"the replies used 265 tokens, more than "
                                                                    f"tokens={tokens}")

    async def test_an_answer_past_the_limit_is_not_checked(self):
        checked = []
        model = reporting((final(PLAN), used(900, 200)))
        result = await run_agent(model, accept=lambda answer, history: checked.append(answer) or True,
                                 limits=Limits(tokens=1000))
        self.assertEqual((result["status"], result["answer"], checked), ("token_limit", None, []))

    async def test_a_reply_without_usage_ends_a_limited_run_and_counts_unreported_in_another(self):
        model = reporting(THREE[0], (PLANNED, None), THREE[2])
        limited = await run_agent(model, limits=dataclasses.replace(ROOMY, tokens=10_000))
        self.assertEqual((limited["status"], limited["trace"][-1]["reason"], limited["usage"]),
                         ("token_limit", "the model reported no usage: a token limit cannot be checked",
                          totals(2, 100, 20, unreported=1)))
        self.assertEqual(limited["used"]["calls"], 2)  # its batch never started
        free = await run_agent(model, limits=ROOMY)
        self.assertEqual((free["status"], free["usage"]), ("completed", totals(3, 150, 25, unreported=1)))
        silent = await run_agent(fake_model, limits=dataclasses.replace(ROOMY, tokens=10_000))
        self.assertEqual((silent["status"], silent["usage"]), ("token_limit", totals(1, 0, 0, unreported=1)))

    async def test_a_usage_that_is_not_counts_of_tokens_is_invalid_decision_naming_the_key(self):
        for usage, reason in (
                (used(-1, 5), "usage: input_tokens must be an int, 0 <= n < 2**31"),
                (used(10, 2.0), "usage: output_tokens must be an int, 0 <= n < 2**31"),
                (used(True, 5), "usage: input_tokens must be an int, 0 <= n < 2**31"),
                (used("10", 5), "usage: input_tokens must be an int, 0 <= n < 2**31"),
                (used(10, 5, cached_input_tokens=None), "usage: cached_input_tokens must be an int, 0 <= n < 2**31"),
                (used(10, 5, total_tokens=15), "usage: total_tokens is not a count of tokens"),
                ({"input_tokens": 10}, "usage: output_tokens must be an int, 0 <= n < 2**31"),
                ([10, 5], "usage must be a dict of token counts"),
                (None, "usage must be a dict of token counts"),
                (used(2**31, 5), "usage: input_tokens must be an int, 0 <= n < 2**31"),
                (used(10, 5, **{"\ud800": 1}), "usage: a key is not a count of tokens"),  # named only if a name
                (used(10, 5, **{"x" * 81: 1}), "usage: a key is not a count of tokens"),
                ({**used(10, 5), (1, 2): 1}, "usage: a key is not a count of tokens")):
            with self.subTest(usage=usage):
                fixtures = Fixtures()
                result = await run_agent(scripted({**READS, "usage": usage}), fixtures=fixtures, limits=ROOMY)
                self.assertEqual((result["status"], result["trace"][-1]["reason"], fixtures.started),
                                 ("invalid_decision", reason, []))
                self.assertEqual(result["history"], [])

    async def test_cached_and_reasoning_tokens_are_summed_when_a_reply_has_them(self):
        model = reporting((READS, used(100, 20, cached_input_tokens=64)), (PLANNED, used(80, 10, reasoning_tokens=7)),
                          (final(PLAN), used(50, 5, cached_input_tokens=32, reasoning_tokens=1)))
        result = await run_agent(model, limits=ROOMY)
        self.assertEqual(result["usage"], totals(3, 230, 35, cached=96, reasoning=8))

    async def test_a_token_limit_that_is_not_an_int_of_one_or_more_is_refused_before_the_model_is_asked(self):
        for tokens in (0, -1, True, 1.5, "1000", float("inf")):
            with self.subTest(tokens=tokens):
                await self.assertRefusedBeforeTheModelIsAsked("tokens must be None or an int >= 1",
                                                              limits=Limits(tokens=tokens))


class UsageAtTheEdgesTests(RuntimeTestCase):
    """PART 16: a reply the run's stop overtook is never read (a set cancel wins, a late reply is late): it counts
    unreported, and the run ends as it would have."""

    async def test_a_reply_that_arrives_with_a_cancel_or_past_the_deadline_counts_unreported(self):
        cancel = asyncio.Event()

        async def cancelling(history):
            cancel.set()
            return {**final(PLAN), "usage": used(500, 50)}

        self.allowBlockingSteps()

        async def late(history):  # a plain client's call on the loop, late: the run's deadline passes while it blocks
            time.sleep(0.3)
            return {**final(PLAN), "usage": used(500, 50)}

        limits = Limits(total_seconds=0.1, model_seconds=5, tokens=100)
        stopped = await run_agent(cancelling, cancel=cancel, limits=dataclasses.replace(ROOMY, tokens=100))
        overtaken = await run_agent(late, limits=limits)
        self.assertEqual((stopped["status"], stopped["usage"]), ("cancelled", totals(1, 0, 0, unreported=1)))
        self.assertEqual((overtaken["status"], overtaken["usage"]), ("deadline", totals(1, 0, 0, unreported=1)))


class BridgeUsageTests(RuntimeTestCase):
    """PART 8 and 16: each bridge reads every reply's usage, in one meaning whatever the provider."""

    async def ask(self, bridge, reply, **options):
        make, extra, _, _ = BRIDGES[bridge]
        return await make(Recorder(reply), "Plan the restock.", **extra)([])

    async def test_each_providers_spelling_is_read_as_one_meaning(self):
        replies = {
            "responses": {**responses_reply(message(output_text("done"))), "usage": {
                "input_tokens": 300, "input_tokens_details": {"cached_tokens": 200},
                "output_tokens": 40, "output_tokens_details": {"reasoning_tokens": 12}, "total_tokens": 340}},
            "chat": {**chat_reply("done"), "usage": {
                "prompt_tokens": 300, "prompt_tokens_details": {"cached_tokens": 200, "audio_tokens": 0},
                "completion_tokens": 40, "completion_tokens_details": {"reasoning_tokens": 12}, "total_tokens": 340}},
            "messages": {**anthropic_reply(text_block("done")), "usage": {
                "input_tokens": 60, "cache_read_input_tokens": 200, "cache_creation_input_tokens": 40,
                "output_tokens": 40}},
        }
        for bridge, reply in replies.items():
            with self.subTest(bridge=bridge):
                decision = await self.ask(bridge, reply)
                reasoning = {} if bridge == "messages" else {"reasoning_tokens": 12}
                self.assertEqual(decision["usage"], used(300, 40, cached_input_tokens=200, **reasoning))

    async def test_a_count_left_out_or_null_is_zero_and_a_reply_without_usage_reports_none(self):
        replies = {
            "responses": {"input_tokens": 9, "output_tokens": 3, "input_tokens_details": None},
            "chat": {"prompt_tokens": 9, "completion_tokens": 3, "prompt_tokens_details": None},
            "messages": {"input_tokens": 9, "output_tokens": 3, "cache_read_input_tokens": None},
        }
        for bridge, usage in replies.items():
            with self.subTest(bridge=bridge):
                text = BRIDGES[bridge][3]("done")
                said = await self.ask(bridge, {**text, "usage": usage})
                self.assertEqual(said["usage"], {"input_tokens": 9, "output_tokens": 3, "cached_input_tokens": 0,
                                                 **({} if bridge == "messages" else {"reasoning_tokens": 0})})
                bare = {key: value for key, value in text.items() if key != "usage"}
                self.assertNotIn("usage", await self.ask(bridge, bare))
                self.assertNotIn("usage", await self.ask(bridge, {**bare, "usage": None}))

    async def test_a_count_a_provider_sends_wrong_ends_the_run_invalid_decision(self):
        reply = {**responses_reply(message(output_text("done"))), "usage": {"input_tokens": 9, "output_tokens": -3}}
        model = agent_loop.responses_model(Recorder(reply), "Plan the restock.")
        result = await run_agent(model, limits=ROOMY)
        self.assertEqual((result["status"], result["trace"][-1]["reason"]),
                         ("invalid_decision", "usage: output_tokens must be an int, 0 <= n < 2**31"))

    async def test_a_reply_cut_off_at_its_own_max_tokens_counts(self):
        cut = {**responses_reply(message(output_text('{"snap')), status="incomplete", reason="max_output_tokens"),
               "usage": {"input_tokens": 500, "output_tokens": 64}}
        result = await run_agent(agent_loop.responses_model(Recorder(cut), "Plan the restock."), limits=ROOMY)
        self.assertEqual((result["status"], result["trace"][0]["kind"], result["usage"]),
                         ("invalid_decision", "truncated", totals(1, 500, 64)))

    async def test_a_run_through_a_bridge_sums_every_reply(self):
        replies = [
            {**responses_reply(fc("c1", "read_partition", {"partition": "north"}),
                               fc("c2", "read_partition", {"partition": "south"})),
             "usage": {"input_tokens": 100, "output_tokens": 20}},
            {**responses_reply(fc("c3", "compute_plan", {"rows": ALL_ROWS})),
             "usage": {"input_tokens": 80, "output_tokens": 10, "input_tokens_details": {"cached_tokens": 50}}},
            {**responses_reply(message(output_text(json.dumps(PLAN)))),
             "usage": {"input_tokens": 50, "output_tokens": 5}},
        ]
        result = await run_agent(agent_loop.responses_model(Recorder(*replies), "Plan the restock."), limits=ROOMY)
        self.assertEqual((result["status"], result["usage"]), ("completed", totals(3, 230, 35, cached=50)))


class NamedRunUsageTests(StoreTestCase):
    """PART 16 with PART 10: a named run keeps its usage through a crash, a pause and an end."""

    def child(self, crash):
        """The counted run in a store of its own, killed as crash says; the store's path."""
        folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, folder)
        path, ready = os.path.join(folder, "runs.db"), os.path.join(folder, "ready")
        run_in_a_process("counted_run", path, ready, crash, kill_when=ready)
        return path

    async def test_a_run_killed_after_its_second_reply_resumes_with_both_counted(self):
        path = self.child("plan")  # killed while its plan, the second reply's call, runs
        store = self.store(path)
        saved = [event.get("usage") for event in store.load("counted")["trace"] if event["event"] == "decision"]
        self.assertEqual(saved, [used(100, 20), used(80, 10)])
        result = await run_agent(counted_model, store=store, run_id="counted", limits=COUNTED_LIMITS)
        self.assertEqual(result["status"], "completed")
        # Resumed: the plan the crash cut is interrupted and asked again (reply 3), then the answer (reply 4).
        self.assertEqual(result["usage"], totals(4, 100 + 80 + 50 + 40, 20 + 10 + 5 + 4))

    async def test_a_request_a_crash_cut_before_its_reply_counts_unreported_and_buys_no_tokens(self):
        path = self.child("model")  # killed while the model makes its second decision
        result = await run_agent(counted_model, store=self.store(path), run_id="counted", limits=COUNTED_LIMITS)
        # The second request never answered; asked anew with the same history, the model reports 80 + 10 and on.
        self.assertEqual((result["status"], result["usage"]), ("completed", totals(4, 230, 35, unreported=1)))

    async def test_an_ended_run_returns_its_usage_as_saved_and_a_paused_one_keeps_counting(self):
        store, desk = self.store(), OrderDesk(delays={})
        model = counting(order_model)
        options = dict(fixtures=desk, store=store, run_id="order", registry=ORDER_TOOLS, accept=order_accepted,
                       limits=dataclasses.replace(ROOMY, tokens=10_000))
        paused = await run_agent(model, approve=lambda write: "ask", **options)
        self.assertEqual((paused["status"], paused["usage"]), ("awaiting_approval", totals(3, 30, 3)))
        done = await run_agent(model, approvals={"r3-order": "approve"}, **options)
        self.assertEqual((done["status"], done["usage"]), ("completed", totals(4, 40, 4)))
        again = await run_agent(model, **options)
        self.assertEqual((again["status"], again["usage"]), ("completed", totals(4, 40, 4)))

    async def test_a_run_waiting_on_its_job_keeps_its_count_across_the_wait(self):
        store = self.store()
        model = counting(scripted(calls(call("a", "ja", x=1)), final("done")))
        options = {**JOB_RUN_OPTIONS, "store": store, "run_id": "job", "limits": dataclasses.replace(
            JOB_RUN_OPTIONS["limits"], tokens=10_000)}
        paused = await run_agent(model, **options)
        self.assertEqual((paused["status"], paused["usage"]), ("awaiting_job", totals(1, 10, 1)))
        self.assertEqual(await agent_loop.work_jobs(store, {"ja": lambda x: {"x": x}}), 1)
        done = await run_agent(model, **options)
        self.assertEqual((done["status"], done["usage"]), ("completed", totals(2, 20, 2)))

    async def test_a_run_stopped_at_its_token_limit_keeps_the_reply_that_passed_it(self):
        store = self.store()
        options = dict(store=store, run_id="spent", limits=dataclasses.replace(ROOMY, tokens=250))
        ended = await run_agent(reporting(*THREE[:2], (calls(call("r3", partition="north")), used(50, 5))), **options)
        again = await run_agent(fake_model, **options)
        self.assertEqual((ended["status"], again["usage"]), ("token_limit", totals(3, 230, 35)))
        self.assertEqual(again["usage"], ended["usage"])

    async def test_a_run_cancelled_from_the_store_is_returned_again_with_its_usage(self):
        store = self.store()
        options = dict(fixtures=OrderDesk(delays={}), store=store, run_id="order", registry=ORDER_TOOLS,
                       accept=order_accepted, limits=dataclasses.replace(ROOMY, tokens=10_000))
        paused = await run_agent(counting(order_model), approve=lambda write: "ask", **options)
        self.assertEqual(store.cancel_run("order"), "cancelled")
        again = await run_agent(counting(order_model), **options)
        self.assertEqual((again["status"], again["usage"], paused["usage"]), ("cancelled", totals(3, 30, 3),
                                                                             totals(3, 30, 3)))
        store.add("never")
        store.cancel_run("never")
        never = await run_agent(counting(order_model), **{**options, "run_id": "never"})
        self.assertEqual((never["status"], never["usage"]), ("cancelled", totals(0, 0, 0)))

    async def test_a_token_limit_is_part_of_what_a_run_is_resumed_with(self):
        store = self.store()
        options = dict(fixtures=OrderDesk(delays={}), store=store, run_id="order", registry=ORDER_TOOLS,
                       accept=order_accepted)
        await run_agent(counting(order_model), approve=lambda write: "ask", limits=ROOMY, **options)
        with self.assertRaises(ValueError) as raised:
            await run_agent(fake_model, approvals={"r3-order": "approve"},
                            limits=dataclasses.replace(ROOMY, tokens=10_000), **options)
        self.assertEqual(str(raised.exception), "order: saved with another registry or other limits")

    def test_a_run_saved_before_token_counts_resumes_as_it_would_have(self):
        """A store written by the module before PART 16 (a paused order, its config without tokens): resumed."""
        with open(os.path.join(HERE, "tests", "data", "saved_before_usage.sql"), encoding="utf-8") as dump:
            script = dump.read()
        folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, folder)
        path = os.path.join(folder, "old.db")
        db = sqlite3.connect(path)
        db.executescript(script)
        db.close()
        desk = OrderDesk(delays={})

        async def resume():
            with agent_loop.SqliteStore(path) as store:
                return await run_agent(counting(order_model), fixtures=desk, store=store, run_id="order",
                                       registry=ORDER_TOOLS, accept=order_accepted, limits=ROOMY,
                                       approvals={"r3-order": "approve"})

        result = asyncio.run(resume())
        self.assertEqual((result["status"], desk.started), ("completed", ["r3-order"]))
        self.assertEqual(result["usage"], totals(4, 10, 1, unreported=3))  # its replies before: none reported


class StoreViewUsageTests(StoreTestCase):
    """PART 17: the store's view shows what each run's replies used."""

    async def test_each_runs_line_shows_its_tokens_once_a_reply_reported(self):
        folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, folder)
        path = os.path.join(folder, "runs.db")
        with agent_loop.SqliteStore(path) as store:
            await run_agent(reporting(*THREE), store=store, run_id="counted", limits=ROOMY)
            await run_agent(reporting(THREE[0], THREE[1], (calls(call("r3", partition="north")), used(50, 5))),
                            store=store, run_id="limited", limits=dataclasses.replace(ROOMY, tokens=250))
            await run_agent(fake_model, store=store, run_id="silent", limits=ROOMY)
        out = io.StringIO()
        with unittest.mock.patch("sys.stdout", out):
            await agent_loop.see_store(path)
        lines = {line.split()[1]: line for line in out.getvalue().splitlines()}
        self.assertIn("17 credits, 265 tokens", lines["counted"])
        self.assertIn("17 credits, 265 tokens", lines["limited"])  # the reply that passed the limit included
        self.assertNotIn("tokens", lines["silent"])
        with contextlib.closing(sqlite3.connect(path)) as db:  # an event damaged by hand: its run's tokens unknown
            db.execute("UPDATE agent_loop_events SET body = body || 'x' WHERE run_id = 'limited'")
            db.commit()
        out = io.StringIO()
        with unittest.mock.patch("sys.stdout", out):
            await agent_loop.see_store(path)
        lines = {line.split()[1]: line for line in out.getvalue().splitlines()}
        self.assertEqual((sorted(lines), "265 tokens" in lines["counted"], "tokens" in lines["limited"]),
                         (["counted", "limited", "silent"], True, False))


COUNTED_LIMITS = Limits(tool_seconds=600, model_seconds=600, total_seconds=600, calls=8, credits=40)
COUNTS = {1: used(100, 20), 2: used(80, 10), 3: used(50, 5), 4: used(40, 4)}


async def counted_model(history):
    """fake_model, its reply to a history of n - 1 rounds reporting COUNTS[n]."""
    return {**await fake_model(history), "usage": COUNTS[len(history) + 1]}


def counting(model):
    """model, each of its replies reporting 10 input and 1 output tokens."""
    async def counted(history):
        return {**await model(history), "usage": used(10, 1)}
    return counted


if __name__ == "__main__":
    unittest.main()
