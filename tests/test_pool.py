"""PART 11: many workers, one database: a pool of real processes on SQLite (PostgreSQL's in test_postgres.py).
"""

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import sqlite3
import threading
import time

import agent_loop
from agent_loop import call, Fixtures, Limits, run_agent, scripted, ToolSpec
from test_agent_loop import calls, CONVERSION_TOOLS, final, never_accept, ROOMY, SLOW_ROOMY, wait_until
from tests.support import JOB_RUN_OPTIONS, LeaseCase
from examples.orders import order_accepted, order_model, ORDER_TOOLS, OrderDesk


class LeaseTests(LeaseCase):
    """PART 11: runs leased to workers: the lease, the queue, fencing, and a pool of processes, here on SQLite."""

    def test_the_chapters_lease_example_with_a_clock_of_the_tests_own(self):
        now = [1.0]
        a, b = (self.store(lease_seconds=2, clock=lambda: now[0]) for _ in "ab")
        a.add("job")
        self.assertEqual(a.claim_next(), "job")  # at 1, leased to A until 3
        self.assertEqual(a.claim("job", "{}", 1.0), 1)  # the run starts under that lease: its generation stays
        now[0] = 3.0
        with self.assertRaises(agent_loop.Superseded) as expired:
            a.save("job", 1, self.free("job"), [], [])
        self.assertEqual(expired.exception.reason, "lease_expired")  # though nobody has taken the run
        self.assertEqual(b.claim_next(), "job")  # at 3, B gets the second generation
        self.assertEqual(b.claim("job", "{}", 1.0), 2)
        now[0] = 4.0
        with self.assertRaises(agent_loop.Superseded) as stale:
            a.save("job", 1, self.free("job"), [], [])
        self.assertEqual(stale.exception.reason, "stale")
        b.save("job", 2, self.free("job"), [], [])  # accepted: its lease runs until 6 now
        self.assertEqual(a.claim_next(), None)

    async def test_a_named_run_is_claimed_and_runs_while_asyncios_thread_pool_is_full(self):
        release = threading.Event()
        self.addCleanup(release.set)
        loop = asyncio.get_running_loop()
        blocked = [loop.run_in_executor(None, release.wait, 60) for _ in range(40)]  # tools' work, say
        result = await asyncio.wait_for(run_agent(store=self.store(), run_id="job", limits=ROOMY), 30)
        release.set()
        await asyncio.gather(*blocked)
        self.assertEqual(result["status"], "completed")

    def test_the_queue_gives_each_free_run_once_oldest_first_and_an_id_added_twice_once(self):
        now = [100.0]
        a, b = (self.store(lease_seconds=10, clock=lambda: now[0]) for _ in "ab")
        for run_id in ("first", "second", "first"):
            a.add(run_id)
            now[0] += 1
        self.assertEqual(a.unfinished(), ["first", "second"])
        self.assertEqual((a.claim_next(), b.claim_next(), a.claim_next()), ("first", "second", None))
        now[0] += 10  # both leases ran out: a crash, say
        self.assertEqual((b.claim_next(), b.claim_next(), a.claim_next()), ("first", "second", None))
        with self.assertRaises(ValueError):
            a.add("")

    async def test_a_claimed_run_runs_under_its_lease_and_a_run_by_name_takes_it_over(self):
        a, b = self.store(), self.store()
        a.add("job")
        self.assertEqual(a.claim_next(), "job")
        result = await run_agent(store=a, run_id="job", limits=ROOMY)
        self.assertEqual((result["status"], a.load("job")["generation"]), ("completed", 1))
        self.assertEqual((a.unfinished(), b.claim_next()), ([], None))  # ended: nobody's to claim
        b.add("other")
        self.assertEqual(b.claim_next(), "other")
        taken = await run_agent(store=a, run_id="other", limits=ROOMY)  # by name: taken over at once, B fenced
        self.assertEqual((taken["status"], a.load("other")["generation"]), ("completed", 2))

    async def test_a_worker_whose_lease_ran_out_is_fenced_says_which_and_starts_nothing_more(self):
        now = [1.0]

        class Late(Fixtures):  # the reads take longer than the lease, on the store's clock
            def __init__(self, then):
                super().__init__(delays={})
                self.then = then

            async def invoke(self, call):
                if self.started == ["r1-north"]:  # both have started: the second one's
                    now[0] += 5
                    self.then()
                return await super().invoke(call)

        cases = {"its lease ran out": lambda b: lambda: None,  # and nobody has taken the run
                 "another process claimed the run": lambda b: lambda: b.claim("another process claimed the run",
                                                                              "{}", 0.0)}
        for reason, then in cases.items():
            with self.subTest(reason=reason):
                a, b = (self.store(lease_seconds=2, clock=lambda: now[0]) for _ in "ab")
                late = Late(then(b))  # A claims the run by name: it holds a lease too
                result = await run_agent(store=a, run_id=reason, fixtures=late, limits=ROOMY)
                self.assertEqual((result["status"], result["trace"][-1]["reason"], result["answer"]),
                                 ("superseded", reason, None))
                self.assertEqual(late.started, ["r1-north", "r1-south"])  # the plan never started

    async def test_a_run_that_waits_longer_than_its_lease_keeps_it_by_renewing_in_the_background(self):
        a, b = self.store(lease_seconds=0.6), self.store(lease_seconds=0.6)
        a.add("job")
        a.claim_next()
        waiting, looked = asyncio.Event(), []

        class Slow(Fixtures):
            async def invoke(self, call):
                if call["name"] == "compute_plan":
                    waiting.set()
                    await asyncio.sleep(1.8)  # three leases long
                return await super().invoke(call)

        async def other_worker():
            await waiting.wait()
            for _ in range(6):
                await asyncio.sleep(0.25)
                looked.append(b.claim_next())

        result, _ = await asyncio.gather(run_agent(store=a, run_id="job", fixtures=Slow(delays={}),
                                                   limits=SLOW_ROOMY), other_worker())
        self.assertEqual((result["status"], looked), ("completed", [None] * 6))

    async def test_a_renewal_that_fails_stops_its_worker_and_is_not_tried_again(self):
        renewals = []

        class Failing(agent_loop.SqlStore):
            def renew(self, run_id, generation):
                renewals.append(run_id)
                raise agent_loop.Superseded(run_id, "lease_expired")

        store = Failing(self.connect, lease_seconds=0.3)
        self.addCleanup(store.close)
        fixtures = Fixtures(delays={"north": 1.0, "south": 1.0})  # ten renewals long
        result = await run_agent(store=store, run_id="job", fixtures=fixtures, limits=SLOW_ROOMY)
        self.assertEqual((result["status"], result["trace"][-1]["reason"], renewals),
                         ("superseded", "its lease ran out", ["job"]))
        self.assertEqual((fixtures.started, result["used"]["rounds"]), (["r1-north", "r1-south"], 1))  # not asked again

    async def test_a_paused_run_holds_no_lease_and_a_run_cut_lets_its_lease_go(self):
        a, b = self.store(), self.store()
        paused = await run_agent(order_model, registry=ORDER_TOOLS, accept=order_accepted,
                                 fixtures=OrderDesk(delays={}), store=a, run_id="order",
                                 approve=lambda write: "ask", limits=ROOMY)
        self.assertEqual(paused["status"], "awaiting_approval")
        row = a._sql("SELECT holder, lease_until, waits FROM agent_loop_runs WHERE run_id = 'order'").fetchone()
        self.assertEqual((tuple(row), b.claim_next(), b.unfinished()), ((None, None, "approval"), None, ["order"]))
        done = await run_agent(order_model, registry=ORDER_TOOLS, accept=order_accepted,
                               fixtures=OrderDesk(delays={}), store=b, run_id="order",
                               approvals={"r3-order": "approve"}, limits=ROOMY)
        self.assertEqual(done["status"], "completed")
        fixtures = Fixtures(delays={"north": 30})
        cut = asyncio.create_task(run_agent(store=a, run_id="cut", fixtures=fixtures, limits=SLOW_ROOMY))
        await wait_until(lambda: fixtures.started)
        self.assertEqual(b.claim_next(), None)  # held, its lease 30 seconds long
        cut.cancel()
        await asyncio.gather(cut, return_exceptions=True)
        self.assertEqual(b.claim_next(), "cut")  # let go: free at once

    def assertClaimedApart(self, stores):
        """Ten times, 3 runs added and one claim_next per store, all at one instant: each run to one store."""
        for trial in range(10):
            for n in range(3):
                stores[0].add(f"t{trial}-{n}")
            start = threading.Barrier(len(stores))

            def claim(store):
                start.wait(timeout=30)
                return store.claim_next()

            with concurrent.futures.ThreadPoolExecutor(len(stores)) as pool:
                got = list(pool.map(claim, stores))  # a driver's error (a SerializationFailure, say) comes out here
            self.assertEqual(sorted(filter(None, got)), [f"t{trial}-{n}" for n in range(3)])
            self.assertEqual(got.count(None), len(stores) - 3)

    async def test_a_save_that_waits_on_the_database_leaves_the_loop_running(self):
        saving, ticks = threading.Event(), []

        class Slow(agent_loop.SqlStore):
            def save(self, *args, **kwargs):
                saving.set()
                time.sleep(0.1)  # a slow or locked statement: on the store's thread
                saving.clear()
                return super().save(*args, **kwargs)

        async def tick():
            while True:
                await asyncio.sleep(0.005)
                ticks.append(saving.is_set())

        store = Slow(self.connect)
        self.addCleanup(store.close)
        ticker = asyncio.create_task(tick())
        result = await run_agent(store=store, run_id="job", limits=SLOW_ROOMY)
        ticker.cancel()
        self.assertEqual(result["status"], "completed")
        self.assertGreater(ticks.count(True), 0)  # the loop ticked while saves ran

    def test_a_lease_runs_from_the_moment_its_claim_took_hold(self):
        now = [1.0]
        store = self.store(lease_seconds=2, clock=lambda: now[0])
        store.add("job")
        blocker = self.connect()
        self.addCleanup(blocker.close)
        lock = ("BEGIN IMMEDIATE", None) if self.kind() == "sqlite" else \
            ("BEGIN", "SELECT * FROM agent_loop_runs WHERE run_id = 'job' FOR UPDATE")
        for statement in filter(None, lock):
            blocker.cursor().execute(statement)  # another transaction holds the lock the claim needs
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            claiming = pool.submit(store.claim, "job", "{}", 1.0)
            time.sleep(0.3)
            self.assertFalse(claiming.done())  # waiting for the lock
            now[0] = 4.0  # 3 seconds later: a lease from the clock read before the lock would have run out
            blocker.cursor().execute("COMMIT")
            self.assertEqual(claiming.result(timeout=60), 1)
        (until,) = store._sql("SELECT lease_until FROM agent_loop_runs WHERE run_id = 'job'").fetchone()
        self.assertEqual(until, 6.0)
        now[0] = 5.0
        store.save("job", 1, self.free("job"), [], [])  # not born expired: its first save holds

    async def test_a_run_that_run_agent_refuses_after_claim_next_is_given_back_at_once(self):
        functions = agent_loop.FunctionTools({"get_rate": lambda base, quote: {}})
        cases = {"bad limits": {"limits": Limits(rounds=-1)},
                 "an approval for a call that waits for none": {"approvals": {"nope": "approve"}},
                 "tools without a function the registry names": {"fixtures": functions, "registry": CONVERSION_TOOLS,
                                                                  "accept": never_accept}}
        a, b = self.store(), self.store()
        for why, options in cases.items():
            with self.subTest(why=why):
                a.add(why)
                self.assertEqual(a.claim_next(), why)
                with self.assertRaises(ValueError):
                    await run_agent(store=a, run_id=why, **options)
                self.assertEqual(b.claim_next(), why)  # free at once, not after lease_seconds (b holds it now)

    async def test_a_hand_edited_store_is_refused_with_a_value_error_only_and_set_aside(self):
        store = self.store()
        held = Fixtures(delays={"north": 30, "south": 30})
        task = asyncio.create_task(run_agent(store=store, run_id="job", fixtures=held, limits=SLOW_ROOMY))
        await wait_until(lambda: len(held.started) == 2)
        task.cancel()  # a batch the crash cut
        await asyncio.gather(task, return_exceptions=True)
        (body,) = store._sql("SELECT body FROM agent_loop_records WHERE run_id = 'job'").fetchone()
        record = json.loads(body)
        observed = {**record["calls"][0], "name": "no_such_tool", "ok": True, "data": {}}  # beside the call cut
        record["calls"][0]["name"], record["observations"] = "no_such_tool", [observed]
        store._sql("UPDATE agent_loop_records SET body = ? WHERE run_id = 'job'", (json.dumps(record),))
        self.assertEqual(store.claim_next(), "job")
        with self.assertRaises(ValueError) as raised:
            await run_agent(store=store, run_id="job", limits=SLOW_ROOMY)
        self.assertEqual(str(raised.exception), "job: what the store holds for it is not a run this version saved")
        (waits,) = store._sql("SELECT waits FROM agent_loop_runs WHERE run_id = 'job'").fetchone()
        self.assertEqual((waits, store.claim_next()), ("aside", None))

    def test_workers_that_claim_at_the_same_instant_on_their_connections_never_get_the_same_run(self):
        self.assertClaimedApart([self.store() for _ in range(4)])

    def test_a_pool_of_three_workers_one_killed_mid_write_ends_every_run_once_and_writes_each_once(self):
        setup = self.connect()
        setup.cursor().execute("CREATE TABLE effects (key TEXT, worker TEXT)")
        queue = self.store()
        runs = [f"run-{n:02}" for n in range(30)]
        for run_id in runs:
            queue.add(run_id)
        go = os.path.join(self.folder, "go")  # the others start once the victim hangs with its write applied
        workers, lines = self.workers("pool_worker", ("victim", "after_second_write"), ("one", "no", go),
                                      ("two", "no", go))

        end = time.monotonic() + 60
        while not any("applied" in line for line in lines("victim")):
            self.assertLess(time.monotonic(), end, lines("victim"))
            time.sleep(0.01)
        open(go, "w").close()
        held = [line["claimed"] for line in lines("victim") if "claimed" in line][-1]
        (lease_until,) = queue._sql("SELECT lease_until FROM agent_loop_runs WHERE run_id = ?", (held,)).fetchone()
        workers["victim"].kill()  # SIGKILL, with the write applied and its observation not saved
        killed = time.time()
        for name in ("one", "two"):
            self.assertEqual(workers[name].wait(timeout=120), 0, lines(name))
        self.assertLess(killed, lease_until)  # the victim held a live lease when it died
        ended = [line for name in workers for line in lines(name) if "ended" in line]
        self.assertEqual(sorted(line["ended"] for line in ended if line["status"] == "completed"), runs)
        self.assertEqual([line for line in ended if line["status"] != "completed"], [])
        taken = [line for name in ("one", "two") for line in lines(name) if line.get("claimed") == held]
        self.assertEqual(len(taken), 1)
        self.assertGreaterEqual(taken[0]["at"], lease_until)  # only once the victim's lease ran out
        keys = collections.Counter(key for key, in setup.cursor().execute("SELECT key FROM effects").fetchall())
        self.assertEqual(sorted(keys), sorted(agent_loop.idempotency_key(run_id, "r3-order", queue.store_id)
                                              for run_id in runs))
        self.assertEqual(set(keys.values()), {1})  # no write applied twice
        for run_id in runs:
            saved = queue.load(run_id)
            ids = [obs["call_id"] for record in saved["history"] for obs in record["observations"]]
            self.assertEqual((saved["status"], len(ids), [e["event"] for e in saved["trace"]].count("stop")),
                             ("completed", len(set(ids)), 1))
        events = [event["event"] for event in queue.load(held)["trace"]]
        self.assertIn("reconciled", events)  # the write it applied, found applied, not sent again
        setup.close()

    def one_write(self, place, reconcile):
        """A model that places one order, and again under a new call id if told it did not apply; its options."""
        async def model(history):
            placed = [obs for record in history for obs in record["observations"] if obs["ok"]]
            return final("placed") if placed else calls(call(f"w{len(history) + 1}", "place", items=[1]))

        registry = {"place": ToolSpec(1, False, False, parameters=agent_loop._closed(items={"type": "array"}))}
        tools = agent_loop.FunctionTools({"place": place}, reconcile=reconcile)
        return model, dict(registry=registry, fixtures=tools, accept=lambda answer, history: True, run_id="job",
                           approve=lambda write: "approve", limits=SLOW_ROOMY)

    async def test_a_write_still_running_when_its_run_is_taken_over_is_not_reconciled_as_not_applied(self):
        release, effects, asked = threading.Event(), [], []

        def place(items, idempotency_key):
            release.wait(30)  # slow: the run is taken over by name while this request is on its way
            effects.append(idempotency_key)
            return {"order": "PO-1"}

        def reconcile(call):
            asked.append(call["call_id"])
            return {"applied": True, "data": {"order": "PO-1"}} if effects else {"applied": False}

        model, options = self.one_write(place, reconcile)
        a, b = self.store(), self.store()
        first = asyncio.create_task(run_agent(model, store=a, **options))
        await wait_until(lambda: a.load("job") and any(e["event"] == "write" for e in a.load("job")["trace"]))
        taken = await run_agent(model, store=b, **options)  # the same tools, in this process
        self.assertEqual((taken["status"], asked), ("unknown_outcome", []))  # its thread runs: nothing is known
        release.set()
        self.assertEqual((await first)["status"], "superseded")
        done = await run_agent(model, store=b, **options)
        self.assertEqual((done["status"], asked, len(effects)), ("completed", ["w1"], 1))  # found applied, once

    async def test_a_run_whose_task_is_cancelled_while_a_write_runs_keeps_its_lease_till_it_runs_out(self):
        now, release = [1.0], threading.Event()
        model, options = self.one_write(lambda items, idempotency_key: release.wait(30), lambda call: None)
        a, b = (self.store(lease_seconds=30, clock=lambda: now[0]) for _ in "ab")
        a.add("job")
        a.claim_next()
        task = asyncio.create_task(run_agent(model, store=a, **options))
        await wait_until(lambda: any(e["event"] == "write" for e in (a.load("job") or {"trace": []})["trace"]))
        task.cancel()  # a worker stopped gracefully, its write's thread still running
        await asyncio.gather(task, return_exceptions=True)
        self.assertEqual(b.claim_next(), None)  # not let go: another worker's reconcile could not know yet
        now[0] += 30
        self.assertEqual(b.claim_next(), "job")
        release.set()

    async def test_a_renewal_the_database_failed_stops_its_worker_too(self):
        renewals = []

        class Locked(agent_loop.SqlStore):
            def renew(self, run_id, generation):
                renewals.append(run_id)
                raise self.error("database is locked")  # another program held the database too long

        store = Locked(self.connect, lease_seconds=0.3)
        self.addCleanup(store.close)
        fixtures = Fixtures(delays={"north": 1.0, "south": 1.0})  # three leases long
        result = await run_agent(store=store, run_id="job", fixtures=fixtures, limits=SLOW_ROOMY)
        self.assertEqual((result["status"], result["trace"][-1]["error_type"], renewals),
                         ("store_failed", store.error.__name__, ["job"]))
        self.assertEqual(result["used"]["rounds"], 1)  # the model is not asked again

    def test_a_run_is_read_whole_while_its_holder_saves(self):
        a = self.store()
        generation = a.claim("job", "{}", 1.0)
        record = lambda n: {"round": n, "calls": [], "observations": []}  # noqa: E731
        state = lambda n: {**self.free("job"), "used": {"rounds": n, "calls": 0, "credits": 0}}  # noqa: E731
        a.save("job", generation, state(1), [record(1)], [{"event": "decision", "round": 1}])
        meanwhile = [lambda: a.save("job", generation, state(2), [record(2)], [{"event": "decision", "round": 2}])]

        class Reader(agent_loop.SqlStore):  # the holder saves between its reads of the run's row and its records
            def _sql(self, statement, parameters=()):
                cursor = super()._sql(statement, parameters)
                if statement.startswith("SELECT config") and meanwhile:
                    meanwhile.pop()()
                return cursor

        reader = Reader(self.connect)
        self.addCleanup(reader.close)
        before = reader.load("job")
        self.assertEqual((before["state"]["used"]["rounds"], len(before["history"]), len(before["trace"])), (1, 1, 1))
        after = reader.load("job")
        self.assertEqual((after["state"]["used"]["rounds"], len(after["history"]), len(after["trace"])), (2, 2, 2))

    async def test_runnable_lists_the_runs_a_pool_may_yet_run_and_none_that_waits_for_you(self):
        class Unsure(OrderDesk):  # the order timed out after it applied, and reconcile cannot tell
            async def reconcile(self, call):
                return {"applied": "perhaps"}

        a, b = self.store(), self.store()
        for run_id in ("held", "free", "asked", "unsure", "job", "done"):
            a.add(run_id)
        self.assertEqual(b.claim_next(), "held")  # its holder may crash: its lease would run out
        order = dict(model=order_model, registry=ORDER_TOOLS, accept=order_accepted, limits=SLOW_ROOMY)
        results = [await run_agent(**order, fixtures=OrderDesk(delays={}), store=a, run_id="asked",
                                   approve=lambda write: "ask"),
                   await run_agent(**{**order, "limits": dataclasses.replace(SLOW_ROOMY, tool_seconds=0.2)},
                                   fixtures=Unsure(delays={}, failures={"place_order": ["timeout_after_apply"]}),
                                   store=a, run_id="unsure", approve=lambda write: "approve"),
                   await run_agent(scripted(calls(call("a", "ja", x=1))), **JOB_RUN_OPTIONS, store=a, run_id="job"),
                   await run_agent(store=a, run_id="done", limits=SLOW_ROOMY)]
        self.assertEqual([result["status"] for result in results],
                         ["awaiting_approval", "unknown_outcome", "awaiting_job", "completed"])
        self.assertEqual((a.runnable(), a.unfinished()), (["held", "free", "job"],
                                                          ["held", "free", "asked", "unsure", "job"]))

    async def test_a_run_the_pool_cannot_resume_is_given_back_and_one_saved_otherwise_is_set_aside(self):
        a, b = self.store(), self.store()
        fixtures = Fixtures(delays={"north": 30})
        cut = asyncio.create_task(run_agent(store=a, run_id="old", fixtures=fixtures, limits=SLOW_ROOMY))
        await wait_until(lambda: fixtures.started)
        cut.cancel()  # saved, not ended
        await asyncio.gather(cut, return_exceptions=True)
        a.add("new")
        waits = lambda: a._sql("SELECT waits, holder FROM agent_loop_runs WHERE run_id = 'old'").fetchone()  # noqa
        self.assertEqual(b.claim_next(), "old")
        with self.assertRaises(ValueError):  # your mistake, for every run: given back, free at once
            await run_agent(store=b, run_id="old", limits=SLOW_ROOMY, approvals={"nope": "approve"})
        self.assertEqual(tuple(waits()), (None, None))
        self.assertEqual(b.claim_next(), "old")
        with self.assertRaises(ValueError):  # a redeploy with other limits: this run waits for you
            await run_agent(store=b, run_id="old", limits=ROOMY)
        self.assertEqual((tuple(waits()), b.claim_next(), b.unfinished()), (("aside", None), "new", ["old", "new"]))
        resumed = await run_agent(store=a, run_id="old", limits=SLOW_ROOMY)  # by name, with its own limits
        self.assertEqual(resumed["status"], "completed")

    def unfit(self):
        """Connections the store cannot work on, each with what it says."""
        def connect(**options):
            return lambda: sqlite3.connect(self.where, **{"isolation_level": None, **options})

        def in_a_transaction():
            db = sqlite3.connect(self.where, isolation_level=None)
            db.execute("BEGIN")
            return db

        def text_as_bytes():
            db = sqlite3.connect(self.where, isolation_level=None)
            db.text_factory = bytes
            return db

        return [(connect(isolation_level=""), "must be in autocommit mode"),
                (in_a_transaction, "has a transaction open"), (text_as_bytes, "must give text as str")]

    def fit(self):
        """Connections the store works on whatever their rows look like, and a subclass's."""
        class Mine(sqlite3.Connection):
            pass

        def rows(factory):
            db = sqlite3.connect(self.where, isolation_level=None)
            db.row_factory = factory
            return db

        return [lambda: sqlite3.connect(self.where, isolation_level=None, factory=Mine),
                lambda: rows(sqlite3.Row), lambda: rows(lambda cursor, row: dict(zip("abcdefghijk", row)))]

    def test_what_a_store_cannot_work_with_is_refused_saying_why(self):
        for lease in (0, 0.05, -1, math.nan, math.inf, True, "30", None, 86_401):
            with self.subTest(lease=lease), self.assertRaisesRegex(ValueError, "^lease_seconds must be"):
                agent_loop.SqlStore(self.connect, lease_seconds=lease)
        for clock in (None, lambda: "now", lambda: math.nan, lambda: 1 / 0):
            with self.subTest(clock=clock), self.assertRaisesRegex(ValueError, "^clock must be"):
                agent_loop.SqlStore(self.connect, clock=clock)
        for connection, says in self.unfit():
            with self.subTest(says=says), self.assertRaisesRegex(ValueError, f"^the connection {says}"):
                agent_loop.SqlStore(connection)
        self.assertRaisesRegex(ValueError, "^connection must be", agent_loop.SqlStore, object())
        self.assertRaisesRegex(ValueError, "function failed: ZeroDivisionError", agent_loop.SqlStore, lambda: 1 / 0)
        self.store().add("job")
        for connection in self.fit():
            with self.subTest(connection=connection), agent_loop.SqlStore(connection) as store:
                self.assertEqual((store.claim_next(), store.unfinished()), ("job", ["job"]))
                self.assertIsNone(store.load("job"))  # added, not started
                store.give_back("job")

    def test_a_table_of_yours_with_a_stores_name_leaves_none_of_the_stores_behind(self):
        with contextlib.closing(self.connect()) as yours:
            yours.cursor().execute("CREATE TABLE agent_loop_runs (yours TEXT)")
            with self.assertRaisesRegex(ValueError, "not a store"):
                agent_loop.SqlStore(self.connect)
            tables = {name for name, in yours.cursor().execute(
                agent_loop._DIALECTS["sqlite3" if isinstance(yours, sqlite3.Connection) else "psycopg"]["tables"]).fetchall()}
            self.assertEqual(tables, {"agent_loop_runs"})
