"""PART 11, 14 and 15 on PostgreSQL: the pool's, the jobs' and the waiting runs' tests again, on a server the tests
start themselves (they skip without psycopg, or without initdb and pg_ctl).
"""

import asyncio
import concurrent.futures
import os
import signal
import threading
import time

import agent_loop
from agent_loop import run_agent
from test_agent_loop import ROOMY, SLOW_ROOMY, wait_until
from tests.support import OnPostgres
from tests import test_job_runs, test_jobs, test_pool  # as modules: their classes run once, in their own files
from examples.orders import receipt_model


class PostgresLeaseTests(OnPostgres, test_pool.LeaseTests):
    """The same tests on a PostgreSQL server of their own: its concurrency, its SQL, its driver (psycopg 3)."""

    def unfit(self):
        import psycopg

        def in_a_transaction():
            db = self.connect()
            db.execute("BEGIN")
            return db

        asynchronous = asyncio.run(psycopg.AsyncConnection.connect(self.where, autocommit=True))
        self.addCleanup(asyncio.run, asynchronous.close())
        return [(lambda: psycopg.connect(self.where), "must be in autocommit mode"),
                (in_a_transaction, "has a transaction open"), (asynchronous, "is an asyncio one")]

    def fit(self):
        import psycopg
        import psycopg.rows

        class Mine(psycopg.Connection):
            pass

        return [lambda: Mine.connect(self.where, autocommit=True),
                lambda: psycopg.connect(self.where, autocommit=True, row_factory=psycopg.rows.dict_row)]

    async def test_a_takeover_by_name_of_a_holder_frozen_mid_save_goes_on_and_the_holder_is_fenced(self):
        for freeze in ("between", "pipeline"):
            with self.subTest(freeze=freeze):
                worker, log = self.frozen(f"job-{freeze}", freeze)
                ticks = []

                async def tick():
                    while True:
                        await asyncio.sleep(0.01)
                        ticks.append(None)

                ticker = asyncio.create_task(tick())
                result = await run_agent(store=self.store(), run_id=f"job-{freeze}", limits=SLOW_ROOMY)
                ticker.cancel()
                self.assertEqual(worker.poll(), None)  # it is still there, stopped: it held the run till its lease ran out
                self.assertEqual(result["status"], "completed")
                self.assertGreater(len(ticks), 20)  # the loop went on while the claim waited
                os.kill(worker.pid, signal.SIGCONT)
                self.assertEqual(worker.wait(timeout=60), 0)
                log.seek(0)
                self.assertIn(log.read().splitlines()[-1], ('"store_failed"', '"superseded"'))  # fenced as it woke

    async def test_a_worker_frozen_as_it_claims_the_next_run_is_ended_and_the_run_handed_out(self):
        store = self.store()
        store.add("job")
        worker, log = self.frozen("job", "claim_next")  # the run's row locked, no lease saved: its lease is none
        claimed = []
        await wait_until(lambda: claimed.append(store.claim_next()) or claimed[-1] == "job", 30)
        result = await run_agent(store=store, run_id="job", limits=SLOW_ROOMY)
        self.assertEqual((result["status"], store.load("job")["generation"]), ("completed", 1))
        os.kill(worker.pid, signal.SIGCONT)
        self.assertEqual(worker.wait(timeout=60), 0)
        log.seek(0)
        self.assertEqual(log.read().splitlines()[-1], '"AdminShutdown"')  # the store ended its session: no claim

    async def test_a_takeover_that_waits_for_a_frozen_holder_leaves_the_stores_thread_to_its_other_calls(self):
        worker, _ = self.frozen("job", lease=4.0)
        store, other = self.store(), self.store()
        met, unstall = threading.Event(), store._unstall

        def watched(run_id=None):  # the takeover's claim met the holder's lock, and waits for its lease to run out
            met.set()
            return unstall(run_id)

        store._unstall = watched
        takeover = asyncio.create_task(run_agent(store=store, run_id="job", limits=SLOW_ROOMY))
        self.assertTrue(await asyncio.to_thread(met.wait, 30))
        store.add("another")  # a call of another run, on the same store's thread
        self.assertEqual(other.load("job")["generation"], 1)  # answered while the takeover still waited
        result = await takeover
        self.assertEqual((result["status"], other.load("job")["generation"]), ("completed", 2))
        os.kill(worker.pid, signal.SIGCONT)

    def test_a_connection_whose_client_encoding_cannot_carry_the_stores_text_is_refused_naming_it(self):
        import psycopg
        with self.assertRaises(ValueError) as raised:
            agent_loop.SqlStore(lambda: psycopg.connect(self.where, autocommit=True,
                                                        options="-c client_encoding=LATIN1"))
        self.assertEqual(str(raised.exception), "the connection sends text in LATIN1, which cannot carry all of the "
                                                "store's text: it needs client_encoding UTF8")

    async def test_claim_next_hands_out_a_run_whose_holder_froze_mid_save_once_its_lease_ran_out(self):
        worker, _ = self.frozen("job")
        store, claimed = self.store(), []
        await wait_until(lambda: claimed.append(store.claim_next()) or claimed[-1] == "job", 30)
        self.assertEqual(worker.poll(), None)  # still stopped
        result = await run_agent(store=store, run_id="job", limits=SLOW_ROOMY)
        self.assertEqual((result["status"], store.load("job")["generation"]), ("completed", 2))

    def test_a_database_in_sql_ascii_holds_the_store_and_one_in_latin1_is_refused_naming_its_encoding(self):
        import psycopg
        with psycopg.connect(self.server.conninfo, autocommit=True) as admin:
            for name, encoding in (("in_ascii", "SQL_ASCII"), ("in_latin1", "LATIN1")):
                admin.execute(f"CREATE DATABASE {name} ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' "
                              "TEMPLATE template0")
        where = {name: self.server.conninfo.replace("dbname=postgres", f"dbname={name}") for name in ("in_ascii",
                                                                                                  "in_latin1")}
        with agent_loop.SqlStore(lambda: psycopg.connect(where["in_ascii"], autocommit=True)) as store:
            result = asyncio.run(run_agent(store=store, run_id="库存-1", limits=ROOMY))
            self.assertEqual((result["status"], store.unfinished(), store.load("库存-1")["status"]),
                             ("completed", [], "completed"))
        with self.assertRaises(ValueError) as raised:
            agent_loop.SqlStore(lambda: psycopg.connect(where["in_latin1"], autocommit=True))
        self.assertEqual(str(raised.exception), "the connection is to a database in LATIN1, which cannot hold all of "
                                                "the store's text: it needs UTF8")

    def test_a_read_only_or_busy_postgresql_store_says_so(self):
        import psycopg
        self.store().close()

        def read_only():
            db = psycopg.connect(self.where, autocommit=True)
            db.execute("SET default_transaction_read_only = on")
            return db

        with self.assertRaises(ValueError) as refused:
            agent_loop.SqlStore(read_only)
        self.assertEqual(str(refused.exception), "the database: read-only: a store must write")
        holder = self.connect()
        self.addCleanup(holder.close)
        holder.execute("BEGIN")
        holder.execute("LOCK TABLE agent_loop_meta IN ACCESS EXCLUSIVE MODE")
        with self.assertRaises(ValueError) as busy:
            agent_loop.SqlStore(self.connect)
        self.assertEqual(str(busy.exception), "the database: busy: another connection holds its lock")

    def test_claims_in_sessions_that_default_to_serializable_never_fail(self):
        import psycopg

        def connect():
            db = psycopg.connect(self.where, autocommit=True)
            db.execute("SET default_transaction_isolation = serializable")  # as an application's database may
            return db

        stores = [agent_loop.SqlStore(connect) for _ in range(4)]
        for store in stores:
            self.addCleanup(store.close)
        self.assertClaimedApart(stores)


class PostgresJobTests(OnPostgres, test_jobs.JobTests):
    """The job tests on a PostgreSQL server of their own."""

    def test_a_runs_end_waits_for_no_job_another_connection_holds_and_asks_the_others_to_cancel(self):
        store = self.store()
        generation = store.claim("r", "{}", 0.0)
        for key in ("k1", "k2"):
            store.submit("r", key, "export", {}, run_id="r")
        self.assertEqual(self.store().claim_job()["id"], 1)
        holder = self.connect()  # job 1's worker, in the middle of a save (or frozen there)
        self.addCleanup(holder.close)
        holder.execute("BEGIN")
        holder.execute("SELECT 1 FROM agent_loop_jobs WHERE id = 1 FOR UPDATE")
        store.save("r", generation, dict(agent_loop._NOTHING_SAVED), [], [], end=("completed", None))
        holder.execute("ROLLBACK")
        self.assertEqual([store.status("r", job_id)["state"] for job_id in (1, 2)], ["running", "cancelled"])

    def test_a_session_busy_in_a_long_statement_beside_a_queued_job_it_holds_is_never_ended(self):
        store = self.store()
        store.submit("ana", "k", "export", {})
        holder, watcher = self.connect(), self.connect()
        self.addCleanup(holder.close)
        self.addCleanup(watcher.close)
        holder.execute("BEGIN")
        holder.execute("SELECT 1 FROM agent_loop_jobs WHERE id = 1 FOR UPDATE")  # a status, say, on a slow server
        working = concurrent.futures.ThreadPoolExecutor(1)
        self.addCleanup(working.shutdown)
        slow = working.submit(lambda: holder.execute("SELECT pg_sleep(4)").fetchall())  # working, not frozen
        end = time.monotonic() + 30
        while not watcher.execute("SELECT 1 FROM pg_stat_activity WHERE state = 'active' AND query LIKE "
                                  "'%pg_sleep(4)%' AND xact_start < clock_timestamp() - interval '1.5 s' AND pid <> "
                                  "pg_backend_pid()").fetchall():
            self.assertLess(time.monotonic(), end, "the slow statement never showed")
            time.sleep(0.05)
        self.assertIsNone(self.store().claim_job())  # it looks for stalled sessions: this one is working
        self.assertEqual(slow.result(30), [("",)])  # and it went on
        holder.execute("COMMIT")

    def test_a_claim_that_ends_a_backlog_of_expired_jobs_is_never_taken_for_a_stalled_one(self):
        now, ended_four = [0.0], threading.Event()

        class Slow(agent_loop.SqlStore):  # each job it ends takes a while, as on a loaded server
            ended = 0

            def _job_ends(self, *args, **said):
                super()._job_ends(*args, **said)
                Slow.ended += 1
                if Slow.ended == 4:  # three of these sleeps behind it: over a second
                    ended_four.set()
                time.sleep(0.4)

        submitter = self.store(clock=lambda: now[0])
        for number in range(8):
            submitter.submit("ana", f"k{number}", "export", {}, deadline_seconds=1)
        now[0] = 10.0  # every deadline has passed: a backlog left while no worker ran
        slow = Slow(self.connect, clock=lambda: now[0])
        self.addCleanup(slow.close)
        claiming = concurrent.futures.ThreadPoolExecutor(1)
        self.addCleanup(claiming.shutdown)
        claimed = claiming.submit(slow.claim_job)
        self.assertTrue(ended_four.wait(30))  # it has worked for over a second, each job in its own transaction
        self.assertIsNone(self.store(clock=lambda: now[0]).claim_job())  # which looks for stalled sessions
        self.assertIsNone(claimed.result(30))  # not ended: it went on to the end of the backlog
        self.assertEqual({submitter.status("ana", n)["error"] for n in range(1, 9)}, {"deadline_exceeded"})


class PostgresJobRunTests(OnPostgres, test_job_runs.JobRunTests):
    """The tests of runs that wait for jobs, cancelled and followed, on a PostgreSQL server of their own."""

    async def test_a_cancel_racing_a_jobs_finish_never_turns_the_finished_job_back(self):
        import psycopg
        store, worker = self.store(), self.store()
        await run_agent(receipt_model, approve=lambda write: "approve", **self.run_options(store))
        job = worker.claim_job()
        pids = [one._thread.submit(lambda one=one: one.db.info.backend_pid).result() for one in (worker, store)]
        other = psycopg.connect(self.where, autocommit=True)
        self.addCleanup(other.close)

        async def waits(pid):  # the connection waits for a lock another transaction holds
            await wait_until(lambda: other.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                                                   (pid,)).fetchone()[0] == "Lock", 60)

        other.execute("BEGIN")  # the job's next event held: the finish waits there, its job row locked and written
        other.execute("INSERT INTO agent_loop_job_events SELECT job_id, MAX(seq) + 1, '{}' FROM agent_loop_job_events "
                      "WHERE job_id = %s GROUP BY job_id", (job["id"],))
        finishing = asyncio.ensure_future(asyncio.to_thread(worker.finish, job["id"], job["attempt"], {"rows": 3}))
        await waits(pids[0])
        cancelling = asyncio.ensure_future(asyncio.to_thread(store.cancel_run, "order", "ops"))
        await waits(pids[1])  # the cancel waits for the job's row, the finish's transaction still open
        other.execute("ROLLBACK")
        self.assertEqual((await finishing, await cancelling), (True, "cancelled"))
        self.assertEqual((store.status("order", job["id"])["state"], (store.result("order", job["id"]) or {}).get("result")),
                         ("succeeded", {"rows": 3}))
        self.assertEqual([event["event"] for event in store.events("order", job["id"])],
                         ["submitted", "claimed", "succeeded"])
