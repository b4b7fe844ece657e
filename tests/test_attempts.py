"""PART 12: a call's attempts: reads tried again unseen by the model, a tool's own time limit, a cap on calls in
flight.
"""

import asyncio
import dataclasses
import math
import os
import tempfile
import threading
import time
import unittest
import unittest.mock

import agent_loop
from agent_loop import call, fake_model, Limits, run_agent, scripted, TemporaryError, TOOLS, ToolSpec
from test_agent_loop import (
    any_answer, calls, errors, final, never_accept, observations, PlainTools, read_file, ROOMY, RuntimeTestCase,
    wait_until,
)
from tests.support import run_in_a_process
from tests.children import retried_run


# PART 12: a call's attempts: reads tried again unseen by the model, a tool's own time limit, a cap on calls in
# flight

class AttemptTests(RuntimeTestCase):
    """PART 12: a call's attempts: a tool's own time limit, retries of a read the model never sees (full jitter, inside
    the budgets and the deadline), a cap on calls in flight, and the calls a batch may hold."""

    READ = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}

    def flaky(self, failures, raised=TemporaryError):
        """A read of n that fails `failures` times first, and the times it started."""
        started = []

        async def read(n):
            started.append(n)
            await asyncio.sleep(0)
            if len(started) <= failures:
                raise raised("private: busy")
            return {"n": n}

        return read, started

    async def run_one(self, read, limits=ROOMY, **spec):
        spec.setdefault("backoff", (0.001, 0.002))
        registry = {"read": ToolSpec(1, True, True, parameters=self.READ, **spec)}
        return await run_agent(scripted(calls(call("a", "read", n=1))), registry=registry, accept=never_accept,
                               fixtures=PlainTools({"read": read}), limits=dataclasses.replace(limits, rounds=1))

    async def test_a_read_that_fails_twice_with_two_retries_is_one_ok_observation_of_three_attempts(self):
        read, started = self.flaky(2)
        result = await self.run_one(read, retries=2)
        (obs,) = observations(result)
        self.assertEqual((obs["ok"], obs["data"], obs["attempts"], started), (True, {"n": 1}, 3, [1, 1, 1]))
        self.assertEqual(result["used"], {"rounds": 1, "calls": 3, "credits": 6})  # each attempt is a call
        retries = [event for event in result["trace"] if event["event"] == "retry"]
        self.assertEqual([(event["call_id"], event["attempt"], event["after"]) for event in retries],
                         [("a", 2, "temporary"), ("a", 3, "temporary")])

    async def test_with_one_retry_the_last_failure_is_the_observation(self):
        read, started = self.flaky(2)
        result = await self.run_one(read, retries=1)
        (obs,) = observations(result)
        self.assertEqual((obs["error"], obs["retryable"], obs["attempts"], len(started)), ("temporary", True, 2, 2))
        self.assertEqual(result["used"]["calls"], 2)
        self.assertNoPrivateText(result)

    async def test_without_retries_a_transient_failure_is_the_articles_observation(self):
        read, started = self.flaky(1)
        result = await self.run_one(read)
        (obs,) = observations(result)
        self.assertEqual((obs["error"], "attempts" in obs, len(started)), ("temporary", False, 1))

    async def test_a_read_that_lost_its_connection_is_temporary_and_tried_again(self):
        read, started = self.flaky(1, ConnectionError)
        result = await self.run_one(read, retries=1)
        self.assertEqual((observations(result)[0]["ok"], len(started)), (True, 2))
        read, _ = self.flaky(1, ConnectionError)
        result = await self.run_one(read)
        self.assertEqual((errors(result), result["status"]), (["temporary"], "round_limit"))  # not tool_exception

    async def test_a_tool_that_timed_out_is_tried_again_within_its_own_time_limit(self):
        started = []

        async def read(n):
            started.append(n)
            if len(started) == 1:
                await asyncio.sleep(30)  # its own limit ends it; tool_seconds, 20, would not have yet
            return {"n": n}

        result = await self.run_one(read, Limits(tool_seconds=20, total_seconds=10), retries=1, seconds=0.05)
        self.assertEqual((observations(result)[0]["ok"], observations(result)[0]["attempts"]), (True, 2))

    async def test_a_read_is_tried_again_after_a_transient_failure_and_never_after_any_other(self):
        # Each way a read's first attempt can end but in success (TOOL_ERRORS, a read's lost connection, a result that
        # is not data, the run's cancel), with retries=3: the code it is observed with, or None where it is transient
        # and the second attempt succeeds.
        cancel = asyncio.Event()

        def raising(error):
            async def attempt():
                raise error
            return attempt

        async def not_data():
            return {"n": object()}

        async def overrun():
            await asyncio.sleep(30)  # its own limit, 0.5 s, ends it long before

        async def cancelled():
            cancel.set()  # the run's cancel, while the attempt runs
            await asyncio.sleep(30)

        cases = [
            ("ToolError", raising(agent_loop.ToolError("no such n")), "tool_error"),
            ("PermissionError", raising(PermissionError("private")), "permission_denied"),
            ("RuntimeError", raising(RuntimeError("private")), "tool_exception"),
            ("Exception", raising(Exception("private")), "tool_exception"),
            ("ResultError", raising(agent_loop.ResultError("private")), "tool_exception"),
            ("a Stop it raised", raising(agent_loop.Stop("cancelled")), "tool_exception"),
            ("a CancelledError it raised", raising(asyncio.CancelledError()), "tool_exception"),
            ("a result that is not data", not_data, "tool_exception"),
            ("the run's cancel", cancelled, "cancelled"),
            ("TemporaryError", raising(TemporaryError("private")), None),
            ("TimeoutError", raising(TimeoutError("private")), None),
            ("its own time limit", overrun, None, 0.5),
            ("ConnectionError", raising(ConnectionError("private")), None),
            ("ConnectionResetError", raising(ConnectionResetError("private")), None),
            ("BrokenPipeError", raising(BrokenPipeError("private")), None),
        ]
        for name, first, code, *seconds in cases:
            with self.subTest(first_attempt=name):
                cancel.clear()
                started = []

                async def read(n):
                    started.append(n)
                    return await first() if len(started) == 1 else {"n": n}

                registry = {"read": ToolSpec(1, True, True, parameters=self.READ, retries=3, backoff=(0.001, 0.002),
                                             seconds=seconds[0] if seconds else None)}
                result = await run_agent(scripted(calls(call("a", "read", n=1))), registry=registry, cancel=cancel,
                                         fixtures=PlainTools({"read": read}), accept=never_accept,
                                         limits=dataclasses.replace(ROOMY, rounds=1))
                (obs,) = observations(result)
                self.assertEqual((obs.get("error"), obs.get("attempts", 1), len(started), result["used"]["calls"]),
                                 (code, 1, 1, 1) if code else (None, 2, 2, 2))
                self.assertNoPrivateText(result)

    async def test_a_retry_the_budgets_cannot_pay_for_is_not_made(self):
        read, started = self.flaky(5)
        result = await self.run_one(read, dataclasses.replace(ROOMY, calls=2), retries=5)
        self.assertEqual((observations(result)[0]["attempts"], result["used"]["calls"], len(started)), (2, 2, 2))
        # Beside a call not started yet, which keeps its share: no retry takes it.
        read, started = self.flaky(5)
        registry = {"read": ToolSpec(1, True, True, parameters=self.READ, backoff=(0.001, 0.002), retries=5)}
        model = scripted(calls(call("a", "read", n=1), call("b", "read", n=2)))
        result = await run_agent(model, registry=registry, fixtures=PlainTools({"read": read}), accept=never_accept,
                                 limits=dataclasses.replace(ROOMY, rounds=1, calls=3, concurrency=1))
        self.assertEqual((result["used"]["calls"], [obs.get("attempts", 1) for obs in observations(result)]),
                         (3, [2, 1]))

    async def test_a_retry_whose_wait_would_end_past_the_deadline_is_not_made(self):
        read, started = self.flaky(5)
        with unittest.mock.patch.object(agent_loop.random, "uniform", lambda low, high: high):  # the longest wait
            registry = {"read": ToolSpec(1, True, True, parameters=self.READ, retries=5, backoff=(30, 60))}
            result = await run_agent(scripted(calls(call("a", "read", n=1)), final("done")), registry=registry,
                                     fixtures=PlainTools({"read": read}), accept=any_answer,
                                     limits=Limits(tool_seconds=5, model_seconds=5, total_seconds=5))
        # The model is asked again at once: had the run waited out the backoff, it would have run out of time.
        self.assertEqual((result["status"], errors(result), len(started)), ("completed", ["temporary"], 1))

    async def test_a_cancel_during_a_backoff_ends_the_wait_at_once(self):
        read, started = self.flaky(5)
        cancel = asyncio.Event()
        registry = {"read": ToolSpec(1, True, True, parameters=self.READ, backoff=(30, 30), retries=5)}
        waits = []  # asked for as the backoff begins
        with unittest.mock.patch.object(agent_loop.random, "uniform", lambda low, high: waits.append(high) or high):
            task = asyncio.create_task(run_agent(scripted(calls(call("a", "read", n=1))), registry=registry,
                                                 fixtures=PlainTools({"read": read}), accept=never_accept,
                                                 cancel=cancel, limits=Limits(tool_seconds=5, total_seconds=120)))
            await wait_until(lambda: waits)
            cancel.set()
            result = await task  # long before the 30 s of its backoff: a status now, not then
        self.assertEqual((result["status"], errors(result), len(started)), ("cancelled", ["temporary"], 1))

    async def test_the_backoff_is_full_jitter_up_to_its_cap(self):
        asked = []

        def uniform(low, high):
            asked.append((low, high))
            return 0.0

        read, _ = self.flaky(4)
        with unittest.mock.patch.object(agent_loop.random, "uniform", uniform):
            await self.run_one(read, retries=4, backoff=(0.01, 0.03))
        self.assertEqual(asked, [(0, 0.01), (0, 0.02), (0, 0.03), (0, 0.03)])

    async def test_at_most_concurrency_calls_are_in_flight_and_a_call_in_backoff_holds_no_slot(self):
        flight, peak, order = [0], [0], []

        async def read(n):
            order.append(n)
            flight[0] += 1
            peak[0] = max(peak[0], flight[0])
            try:
                await asyncio.sleep(0.01)
                if n == 0 and order.count(0) == 1:
                    raise TemporaryError("busy")
                return {"n": n}
            finally:
                flight[0] -= 1

        for concurrency, backoff in ((2, (0.001, 0.001)), (1, (0.2, 0.2))):
            with self.subTest(concurrency=concurrency):
                flight[0] = peak[0] = 0
                order.clear()
                registry = {"read": ToolSpec(1, True, True, parameters=self.READ, backoff=backoff, retries=1)}
                model = scripted(calls(*(call(f"c{n}", "read", n=n) for n in range(4))))
                with unittest.mock.patch.object(agent_loop.random, "uniform", lambda low, high: high):
                    result = await run_agent(model, registry=registry, fixtures=PlainTools({"read": read}),
                                             accept=never_accept, limits=Limits(rounds=1, calls=5, concurrency=concurrency,
                                                                                tool_seconds=5, total_seconds=30))
                self.assertEqual(peak[0], concurrency)
                self.assertEqual([obs["call_id"] for obs in observations(result)], ["c0", "c1", "c2", "c3"])
                if concurrency == 1:  # c0 waits out its backoff: the others run in the meantime
                    self.assertEqual(order, [0, 1, 2, 3, 0])

    def backing_off(self, **script):
        """A run of reads with one slot, run(model, cancel), and the names of the attempts that started: the reads
        are "slow", whose retry waits 30 s, "quick", whose retry waits 1 ms, and "plain", never tried again; the
        call of n=0 is named a, n=1 b, n=2 c, and its attempts do what script[name] says, one word each ("fail",
        temporary; "hang", until the run ends), and succeed after."""
        started = []

        async def read(n):
            name = "abc"[n]
            started.append(name)
            does = script.get(name, [])[started.count(name) - 1:][:1]
            if does == ["fail"]:
                raise TemporaryError("busy")
            if does == ["hang"]:
                await asyncio.sleep(30)
            return {"n": n}

        registry = {"slow": ToolSpec(1, True, True, parameters=self.READ, retries=1, backoff=(30, 30)),
                    "quick": ToolSpec(1, True, True, parameters=self.READ, retries=1, backoff=(0.001, 0.001)),
                    "plain": ToolSpec(1, True, True, parameters=self.READ)}

        def run(model, cancel):
            return asyncio.create_task(run_agent(
                model, registry=registry, cancel=cancel, accept=never_accept, fixtures=PlainTools(dict.fromkeys(
                    registry, read)), limits=Limits(rounds=1, calls=10, concurrency=1, tool_seconds=60,
                                                    total_seconds=120)))

        return started, run

    async def test_a_call_waiting_out_its_backoff_holds_no_slot_and_the_calls_queued_behind_it_run_meanwhile(self):
        started, run = self.backing_off(a=["fail"], c=["hang"])
        cancel = asyncio.Event()
        with unittest.mock.patch.object(agent_loop.random, "uniform", lambda low, high: high):  # a waits 30 s
            task = run(scripted(calls(call("a", "slow", n=0), call("b", "plain", n=1), call("c", "plain", n=2))),
                       cancel)
            try:  # c starts once b has ended, in the one slot: had a kept the slot through its wait, neither would
                await wait_until(lambda: started == ["a", "b", "c"])
            finally:
                cancel.set()  # ends a's wait, and c: a's retry never starts
                result = await task
        self.assertEqual((result["status"], started, result["used"]["calls"]), ("cancelled", ["a", "b", "c"], 3))
        self.assertEqual([(obs["call_id"], obs.get("error")) for obs in observations(result)],
                         [("a", "temporary"), ("b", None), ("c", "cancelled")])

    async def test_a_retry_that_comes_due_during_another_calls_backoff_is_not_held_up_by_it(self):
        started, run = self.backing_off(a=["fail"], b=["fail", "hang"])
        cancel = asyncio.Event()
        with unittest.mock.patch.object(agent_loop.random, "uniform", lambda low, high: high):  # a 30 s, b 1 ms
            task = run(scripted(calls(call("a", "slow", n=0), call("b", "quick", n=1))), cancel)
            try:  # b fails, waits out its own backoff and starts again, all while a waits out its
                await wait_until(lambda: started == ["a", "b", "b"])
            finally:
                cancel.set()
                result = await task
        self.assertEqual((result["status"], started, result["used"]["calls"]), ("cancelled", ["a", "b", "b"], 3))
        self.assertEqual([(obs["call_id"], obs.get("error"), obs.get("attempts", 1)) for obs in observations(result)],
                         [("a", "temporary", 1), ("b", "cancelled", 2)])
        retries = [(event["call_id"], event["attempt"]) for event in result["trace"] if event["event"] == "retry"]
        self.assertEqual(retries, [("b", 2)])

    async def test_a_batch_holds_at_most_limits_batch_calls(self):
        registry = {"read": ToolSpec(1, True, True, parameters=self.READ)}
        for batch, size, status in ((4, 5, "invalid_batch"), (5, 5, "round_limit")):
            with self.subTest(batch=batch, size=size):
                model = scripted(calls(*(call(f"c{n}", "read", n=n) for n in range(size))))
                result = await run_agent(model, registry=registry, fixtures=PlainTools({"read": lambda n: {"n": n}}),
                                         accept=never_accept, limits=Limits(rounds=1, calls=5, batch=batch))
                self.assertEqual(result["status"], status)
        self.assertEqual(result["trace"][1]["ids"], ["c0", "c1", "c2", "c3", "c4"])

    async def test_a_retry_is_no_attempt_of_the_repeat_limit(self):
        read, started = self.flaky(1)
        registry = {"read": ToolSpec(1, True, True, parameters=self.READ, backoff=(0.001, 0.001), retries=1)}
        model = scripted(calls(call("a", "read", n=1)), calls(call("b", "read", n=1)), calls(call("c", "read", n=1)))
        result = await run_agent(model, registry=registry, fixtures=PlainTools({"read": read}), accept=never_accept,
                                 limits=dataclasses.replace(ROOMY, rounds=3, attempts=2))
        self.assertEqual((result["status"], result["used"]["calls"]), ("repeat_limit", 3))  # a's 2, b's 1

    async def test_a_retry_never_takes_what_a_call_in_flight_is_about_to_be_charged(self):
        # a fails at once; its retry's event waits on a slow watcher while b is being started, then fails, and both
        # would retry: three calls allowed, so only one retry fits beside a's and b's first attempts.
        starts = []

        async def read(n):
            starts.append(n)
            await asyncio.sleep(0 if n == 1 else 0.02)
            if starts.count(n) == 1:
                raise TemporaryError("busy")
            return {"n": n}

        async def slow(event):
            if event["event"] == "retry":
                await asyncio.sleep(0.05)

        registry = {"read": ToolSpec(1, True, True, parameters=self.READ, retries=1, backoff=(0.001, 0.001))}
        result = await run_agent(scripted(calls(call("a", "read", n=1), call("b", "read", n=2))), registry=registry,
                                 fixtures=PlainTools({"read": read}), accept=never_accept, on_event=slow,
                                 limits=dataclasses.replace(ROOMY, rounds=1, calls=3, tool_seconds=5))
        self.assertEqual((result["used"]["calls"], len(starts)), (3, 3))
        self.assertEqual([obs.get("attempts", 1) for obs in observations(result)], [2, 1])

    async def test_a_thousand_retries_and_more_end_with_a_status(self):
        async def read(n):
            raise TemporaryError("busy")

        with unittest.mock.patch.object(agent_loop.random, "uniform", lambda low, high: 0.0):  # no wait: the cap
            result = await self.run_one(read, dataclasses.replace(ROOMY, calls=1100, credits=2000, total_seconds=60),
                                        retries=1100, backoff=(0.001, 0.001))
        self.assertEqual((result["status"], observations(result)[0]["attempts"]), ("round_limit", 1100))

    async def test_a_tool_that_breaks_the_runs_cancel_wait_during_a_backoff_is_at_fault(self):
        def cancel_the_wait():
            for task in asyncio.all_tasks():
                if task.get_coro().__qualname__ == "Event.wait":
                    task.cancel()

        async def read(n):
            asyncio.get_running_loop().call_later(0.002, cancel_the_wait)  # while the call waits out its backoff
            raise TemporaryError("busy")

        for batch in ([call("a", "read", n=1)], [call("a", "read", n=1), call("b", "read", n=2)]):
            with self.subTest(calls=len(batch)):
                registry = {"read": ToolSpec(1, True, True, parameters=self.READ, retries=1, backoff=(0.05, 0.05))}
                with unittest.mock.patch.object(agent_loop.random, "uniform", lambda low, high: high):
                    result = await run_agent(scripted(calls(*batch)), registry=registry, accept=never_accept,
                                             fixtures=PlainTools({"read": read}), limits=ROOMY)
                self.assertEqual((result["status"], result["trace"][-1]["error_type"]),
                                 ("tool_exception", "cancel event"))
                self.assertNoTaskLeft()

    async def test_a_retry_a_stop_overtook_before_it_started_is_no_attempt(self):
        read, started = self.flaky(5)
        cancel = asyncio.Event()

        def watcher(event):
            if event["event"] == "retry":
                cancel.set()  # between the retry's decision and its start

        registry = {"read": ToolSpec(1, True, True, parameters=self.READ, retries=5, backoff=(0.001, 0.001))}
        result = await run_agent(scripted(calls(call("a", "read", n=1))), registry=registry, cancel=cancel,
                                 fixtures=PlainTools({"read": read}), accept=never_accept, on_event=watcher, limits=ROOMY)
        (obs,) = observations(result)
        self.assertEqual((result["status"], obs["error"], "attempts" in obs, result["used"]["calls"], len(started)),
                         ("cancelled", "temporary", False, 1, 1))

    async def test_the_retries_a_crash_cut_are_charged_on_resume_and_no_tool_starts_past_limits_calls(self):
        with tempfile.TemporaryDirectory() as folder:
            path, log = os.path.join(folder, "runs.db"), os.path.join(folder, "started")
            run_in_a_process("retrying_run", path, log, kill_when=log + ".ready")  # in its flaky read's 4th attempt
            self.assertEqual(sorted(read_file(log).split()), ["flaky"] * 4 + ["plain"])
            with agent_loop.SqliteStore(path) as store:
                result = await run_agent(store=store, **retried_run(log))
            started = read_file(log).split()
        self.assertEqual((result["status"], len(started), started[5:]), ("call_limit", 6, ["plain"]))
        self.assertEqual(result["used"]["calls"], len(started))  # each attempt that started, charged once
        self.assertEqual(result["used"], {"rounds": 3, "calls": 6, "credits": 3 * 3 + 6})  # a credit each
        retries = [event["attempt"] for event in result["trace"] if event["event"] == "retry"]
        self.assertEqual((retries, errors(result)[:2]), ([2, 3, 4], ["interrupted", "interrupted"]))

    async def test_a_cancel_of_a_run_a_crash_cut_in_its_retries_charges_them_as_its_resume_would(self):
        with tempfile.TemporaryDirectory() as folder:
            path, log = os.path.join(folder, "runs.db"), os.path.join(folder, "started")
            run_in_a_process("retrying_run", path, log, kill_when=log + ".ready")  # in its flaky read's 4th attempt
            with agent_loop.SqliteStore(path, clock=lambda: time.time() + 60) as store:  # the crashed lease ran out
                self.assertEqual(store.cancel_run("retried", by="ops"), "cancelled")
                result = await run_agent(store=store, **retried_run(log))
            started = read_file(log).split()
        self.assertEqual((result["status"], result["used"]["calls"], len(started)), ("cancelled", 5, 5))
        self.assertEqual(result["used"]["credits"], result["used"]["rounds"] * 3 + 5)  # a credit a call, as resumed

    async def test_a_retry_is_saved_by_its_own_save_alone_and_a_refused_one_is_in_neither_trace(self):
        # Three reads fail at once. The first retry's save waits until the other two wait to retry; a cancel is asked
        # for once two retries are stored, so that the third retry's save is refused.
        released, saves, failed = threading.Event(), [], []

        class Store(agent_loop.SqliteStore):
            def save(self, run_id, generation, state, records, events, end=None):
                retries = [event["call_id"] for event in events if event["event"] == "retry"]
                if retries and not any(saves):
                    released.wait(60)  # the test sets it (a wide margin: a broken test fails, never hangs)
                saved = super().save(run_id, generation, state, records, events, end)
                saves.append(retries)
                if sum(map(len, saves)) >= 2 and len(saves[-1]):
                    self.cancel_run(run_id, by="ops")
                return saved

        async def read(n):
            if n not in failed:
                failed.append(n)
                raise TemporaryError("busy")
            return {"n": n}

        registry = {"read": ToolSpec(1, True, True, parameters=self.READ, retries=1, backoff=(0.001, 0.002))}
        with tempfile.TemporaryDirectory() as folder, Store(os.path.join(folder, "runs.db")) as store, \
                unittest.mock.patch.object(agent_loop.random, "uniform", return_value=0.0):  # backoffs of 0 s
            run = asyncio.create_task(run_agent(
                scripted(calls(*(call(f"c{n}", "read", n=n) for n in range(3)))), registry=registry, store=store,
                run_id="race", accept=never_accept, fixtures=PlainTools({"read": read}),
                limits=dataclasses.replace(ROOMY, calls=6)))  # room for each call and a retry of each
            await wait_until(lambda: len(failed) == 3)
            for _ in range(200):  # the loop runs on until the other two retries wait for the first one's save
                await asyncio.sleep(0)
            released.set()
            result = await run
            stored = store.trace("race")
        names = lambda trace: [(event["event"], event.get("call_id")) for event in trace]
        self.assertEqual(result["status"], "cancelled")
        self.assertEqual(names(stored), names(result["trace"]))  # the refused retry: in neither
        self.assertEqual([len(retries) for retries in saves if retries], [1, 1])  # each retry saved by its own save
        self.assertEqual([event["event"] for event in stored], ["decision", "retry", "retry", "observations", "stop"])

    async def test_a_bad_retries_or_backoff_is_refused_before_a_named_run_is_claimed(self):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "runs.db")
            with agent_loop.SqliteStore(path) as first, agent_loop.SqliteStore(path) as second:
                asked = asyncio.Event()

                async def model(history):
                    asked.set()
                    await asyncio.sleep(0.2)
                    return await fake_model(history)

                live = asyncio.create_task(run_agent(model, store=first, run_id="job", limits=ROOMY))
                await asked.wait()
                for spec in (dict(backoff=(2, 1)), dict(retries=3, read_only=False)):
                    registry = {**TOOLS, "read_partition": dataclasses.replace(TOOLS["read_partition"], **spec)}
                    with self.subTest(spec=spec), self.assertRaises(ValueError):
                        await run_agent(store=second, run_id="job", registry=registry, limits=ROOMY)
                self.assertEqual((await live)["status"], "completed")  # not superseded: nobody claimed it meanwhile

    async def test_what_a_tool_declares_of_its_attempts_must_be_what_they_can_be(self):
        cases = [(dict(seconds=0), "read: seconds must be a finite number > 0, or None"),
                 (dict(seconds=math.inf), "read: seconds must be a finite number > 0, or None"),
                 (dict(retries=-1), "read: retries must be an int >= 0, and 0 but for a read: a write is never tried again"),
                 (dict(retries=True), "read: retries must be an int >= 0, and 0 but for a read: a write is never tried again"),
                 (dict(retries=1, read_only=False), "read: retries must be an int >= 0, and 0 but for a read: a write is "
                                                    "never tried again"),
                 (dict(backoff=(0.2, 0.1)), "read: backoff must be (base, cap): seconds, 0 < base <= cap"),
                 (dict(backoff=[0.1, 0.2]), "read: backoff must be (base, cap): seconds, 0 < base <= cap")]
        for spec, message in cases:
            with self.subTest(spec=spec):
                registry = {"read": dataclasses.replace(ToolSpec(1, True, True, parameters=self.READ), **spec)}
                await self.assertRefusedBeforeTheModelIsAsked(message, registry=registry, accept=never_accept,
                                                              fixtures=PlainTools({"read": dict}))
