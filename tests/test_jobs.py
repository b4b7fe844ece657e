"""PART 11 and 14: durable jobs, and work_jobs, the worker for them.
"""

import asyncio
import hashlib
import json
import math
import os
import signal
import sqlite3
import subprocess
import threading
import time

import agent_loop
from test_agent_loop import wait_until
from tests.support import child_command, JOB_LEASE, LeaseCase, utf8_json


class JobTests(LeaseCase):
    """PART 11 and 14: durable jobs: a receipt after the commit, six states, the owner's calls, the worker's fenced
    calls, work_jobs, and real crashes; here on SQLite (PostgresJobTests: the same on PostgreSQL)."""

    def clocked(self, **options):
        now = [0.0]
        return self.store(lease_seconds=2, clock=lambda: now[0], **options), now

    def events(self, store, job_id, owner="ana"):
        return [event["event"] for event in store.events(owner, job_id)]

    def test_a_receipt_comes_once_the_job_is_saved_and_the_same_key_is_the_same_job(self):
        store, now = self.clocked()
        receipt = store.submit("ana", "k", "export", {"month": "2026-08"})
        self.assertEqual(receipt, {"id": 1, "state": "queued", "attempt": 0, "done": 0, "total": 0, "error": None})
        self.assertEqual(self.store().status("ana", 1), receipt)  # another connection sees it: it was committed
        now[0] = 1
        store.claim_job()
        again = store.submit("ana", "k", "export", {"month": "2026-08"}, deadline_seconds=1, max_attempts=9)
        self.assertEqual(again, {**receipt, "state": "running", "attempt": 1})  # the receipt as it stands now
        with self.assertRaises(agent_loop.JobError) as refused:
            store.submit("ana", "k", "export", {"month": "2026-09"})
        self.assertEqual(refused.exception.code, "key_conflict")
        with self.assertRaises(agent_loop.JobError):
            store.submit("ana", "k", "other", {"month": "2026-08"})
        self.assertEqual(self.events(store, 1), ["submitted", "claimed"])  # nothing changed
        self.assertEqual(store.submit("bob", "k", "export", {"month": "2026-08"})["id"], 2)  # another owner's job

    def test_the_first_submits_deadline_and_attempts_hold(self):
        store, now = self.clocked()
        store.submit("ana", "k", "export", {}, deadline_seconds=10, max_attempts=1)
        store.submit("ana", "k", "export", {}, deadline_seconds=1, max_attempts=5)
        now[0] = 1
        job = store.claim_job()
        self.assertEqual(store.fail(1, job["attempt"], "busy", retry_after=1), "failed")  # one attempt: none left
        store.submit("ana", "k2", "export", {}, deadline_seconds=10)
        store.submit("ana", "k2", "export", {}, deadline_seconds=1)
        now[0] = 5
        job = store.claim_job()
        self.assertEqual((job["id"], store.finish(2, job["attempt"], {"ok": True})), (2, True))  # 10 s, not 1

    def test_a_full_queue_refuses_a_new_job_and_still_answers_a_repeated_submit(self):
        store, now = self.clocked(max_jobs=2)
        store.submit("ana", "a", "export", {})
        store.submit("ana", "b", "export", {})
        with self.assertRaises(agent_loop.JobError) as refused:
            store.submit("ana", "c", "export", {})
        self.assertEqual(refused.exception.code, "queue_full")
        self.assertEqual(store.submit("ana", "a", "export", {})["id"], 1)
        store.cancel("ana", 1)  # a final job leaves the queue
        self.assertEqual(store.submit("ana", "c", "export", {})["id"], 3)

    def test_a_job_past_its_deadline_leaves_the_queue_whatever_its_state_before_any_call_says_so(self):
        store, now = self.clocked(max_jobs=1)
        for state in ("queued", "running", "cancel_requested"):
            with self.subTest(state=state):
                now[0] += 10
                first = store.submit("ana", f"{state}-1", "export", {}, deadline_seconds=3)["id"]
                now[0] += 1
                if state != "queued":
                    self.assertEqual(store.claim_job()["id"], first)
                if state == "cancel_requested":
                    store.cancel("ana", first)
                now[0] += 2  # past its deadline: it has ended, though no call has said so yet
                second = store.submit("ana", f"{state}-2", "export", {}, deadline_seconds=3)
                self.assertEqual((second["id"], second["state"], store.status("ana", first)["error"]),
                                 (first + 1, "queued", "deadline_exceeded"))

    def test_another_owners_job_and_an_absent_one_answer_alike(self):
        store, now = self.clocked()
        store.submit("ana", "k", "export", {})
        for owner, job_id in (("bob", 1), ("ana", 2), ("ana", "1"), ("ana", True)):
            with self.subTest(owner=owner, job_id=job_id):
                self.assertEqual((store.status(owner, job_id), store.events(owner, job_id),
                                  store.cancel(owner, job_id), store.result(owner, job_id)), (None, None, None, None))
        self.assertEqual(store.status("ana", 1)["state"], "queued")  # bob's cancel changed nothing

    def test_the_owner_follows_the_events_after_a_cursor_and_fetches_the_result_once_it_succeeded(self):
        store, now = self.clocked()
        store.submit("ana", "k", "export", {"month": "2026-08"})
        now[0] = 1
        job = store.claim_job()
        self.assertIsNone(store.result("ana", 1))
        for done in (1, 2, 3):
            now[0] = 1 + done
            self.assertEqual(store.progress(1, job["attempt"], done, 3), "running")
        now[0] = 5
        self.assertTrue(store.finish(1, job["attempt"], {"rows": 3, "total_cents": 6000}))
        events = store.events("ana", 1)
        self.assertEqual([(event["seq"], event["event"], event["attempt"]) for event in events],
                         [(1, "submitted", 0), (2, "claimed", 1), (3, "progress", 1), (4, "progress", 1),
                          (5, "progress", 1), (6, "succeeded", 1)])
        self.assertEqual((events[2]["done"], events[2]["total"]), (1, 3))
        self.assertEqual(store.events("ana", 1, after=5), events[5:])
        got = store.result("ana", 1)
        self.assertEqual(got, {"result": {"rows": 3, "total_cents": 6000}, "fingerprint": hashlib.sha256(
            utf8_json({"rows": 3, "total_cents": 6000})).hexdigest()})
        self.assertEqual(events[5]["fingerprint"], got["fingerprint"])

    def test_a_cancel_ends_a_queued_job_asks_a_running_one_and_leaves_a_final_one(self):
        store, now = self.clocked()
        for key in ("a", "b", "c"):
            store.submit("ana", key, "export", {})
        self.assertEqual(store.cancel("ana", 1)["state"], "cancelled")
        now[0] = 1
        job = store.claim_job()
        self.assertEqual(job["id"], 2)  # a cancelled job is never claimed
        self.assertEqual(store.cancel("ana", 2)["state"], "cancel_requested")
        self.assertEqual(store.progress(2, job["attempt"], 1, 2), "cancel_requested")  # its worker sees it
        self.assertEqual(store.finish(2, job["attempt"], {"rows": 1}), False)  # and confirms it: no result
        self.assertEqual((store.status("ana", 2)["state"], store.result("ana", 2)), ("cancelled", None))
        job = store.claim_job()
        store.finish(3, job["attempt"], {"rows": 1})
        self.assertEqual(store.cancel("ana", 3)["state"], "succeeded")
        now[0] = 10
        self.assertIsNone(store.claim_job())  # a final job never runs again

    def test_a_claim_leases_the_oldest_claimable_job_of_its_kinds(self):
        store, now = self.clocked()
        store.submit("ana", "a", "export", {"n": 1})
        store.submit("ana", "b", "import", {"n": 2})
        store.submit("ana", "c", "export", {"n": 3})
        now[0] = 1
        self.assertEqual(store.claim_job(["import"]), {"id": 2, "attempt": 1, "kind": "import", "params": {"n": 2}})
        self.assertEqual(store.claim_job()["id"], 1)
        self.assertEqual(store.claim_job(("export",))["id"], 3)
        self.assertIsNone(store.claim_job())
        now[0] = 3  # job 1's lease ran out: its worker died, and it is claimed again, its attempt one more
        self.assertEqual(store.claim_job(), {"id": 1, "attempt": 2, "kind": "export", "params": {"n": 1}})
        for kinds in ([], "export", [1], {"export"}):
            with self.subTest(kinds=kinds), self.assertRaises(ValueError):
                store.claim_job(kinds)

    def test_a_job_past_its_deadline_or_out_of_attempts_is_failed_not_claimed(self):
        store, now = self.clocked()
        store.submit("ana", "a", "export", {}, deadline_seconds=3)
        store.submit("ana", "b", "export", {}, max_attempts=1)
        store.submit("ana", "c", "export", {}, max_attempts=1)
        now[0] = 1
        store.claim_job(), store.claim_job(), store.claim_job()
        store.cancel("ana", 3)  # asked, and then its worker died
        now[0] = 4  # every lease ran out
        self.assertIsNone(store.claim_job())
        self.assertEqual([store.status("ana", n)["state"] for n in (1, 2, 3)], ["failed", "failed", "cancelled"])
        self.assertEqual([store.status("ana", n)["error"] for n in (1, 2)], ["deadline_exceeded", "lease_expired"])

    def test_a_job_past_its_deadline_has_failed_whatever_its_state_whichever_call_comes_first(self):
        store, now = self.clocked()
        owners = {"status": (lambda job: store.status("ana", job["id"])["state"], "failed"),
                  "events": (lambda job: store.events("ana", job["id"])[-1]["event"], "failed"),
                  "cancel": (lambda job: store.cancel("ana", job["id"])["state"], "failed"),
                  "claim_job": (lambda job: store.claim_job(), None)}
        workers = {"progress": (lambda job: store.progress(job["id"], job["attempt"], 1, 1), "failed"),
                   "renew_job": (lambda job: store.renew_job(job["id"], job["attempt"]), "failed"),
                   "finish": (lambda job: store.finish(job["id"], job["attempt"], {"late": True}), False),
                   "fail": (lambda job: store.fail(job["id"], job["attempt"], "busy", retry_after=0), "failed")}
        lived = {"queued": ["submitted"], "running": ["submitted", "claimed"],
                 "cancel_requested": ["submitted", "claimed", "cancel_requested"]}
        for state in lived:
            for first, (touch, said) in {**owners, **(workers if state != "queued" else {})}.items():
                with self.subTest(state=state, first=first):
                    now[0] += 10
                    job = store.submit("ana", f"{state}-{first}", "export", {}, deadline_seconds=3)
                    now[0] += 1
                    job = store.claim_job() if state != "queued" else job
                    if state == "cancel_requested":
                        store.cancel("ana", job["id"])
                    now[0] += 2  # its deadline (its lease ran out too): the first call to touch it says it failed
                    self.assertEqual(touch(job), said)
                    store.cancel("ana", job["id"])  # too late: it has ended
                    self.assertEqual((self.events(store, job["id"]), store.status("ana", job["id"])["error"]),
                                     (lived[state] + ["failed"], "deadline_exceeded"))

    def test_progress_goes_forward_within_its_total_renews_the_lease_and_says_the_state(self):
        store, now = self.clocked()
        store.submit("ana", "k", "export", {})
        now[0] = 1
        job = store.claim_job()
        for done, total in ((-1, 3), (4, 3), (1.0, 3), (True, 3)):
            with self.subTest(done=done, total=total), self.assertRaises(ValueError):
                store.progress(1, job["attempt"], done, total)
        now[0] = 2.5
        store.progress(1, job["attempt"], 2, 3)
        with self.assertRaises(ValueError):
            store.progress(1, job["attempt"], 1, 3)  # never backwards
        now[0] = 4  # past the claim's lease (3), within the one progress renewed (4.5)
        self.assertEqual(store.progress(1, job["attempt"], 3, 3), "running")
        self.assertEqual(self.events(store, 1), ["submitted", "claimed", "progress", "progress"])

    def test_progress_and_a_renewal_tell_a_worker_whose_lease_runs_that_its_job_has_failed_past_its_deadline(self):
        store, now = self.clocked()
        for key in ("a", "b", "c"):
            store.submit("ana", key, "export", {}, deadline_seconds=3)
        now[0] = 1
        jobs = [store.claim_job() for _ in range(3)]
        now[0] = 2
        for job in jobs:
            store.renew_job(job["id"], job["attempt"])  # each lease runs until 4
        now[0] = 3
        self.assertEqual(store.status("ana", 3)["state"], "failed")  # its owner asked first (a run asked again)
        said = [store.progress(1, jobs[0]["attempt"], 1, 2), store.renew_job(2, jobs[1]["attempt"]),
                store.progress(3, jobs[2]["attempt"], 1, 2), store.renew_job(1, jobs[0]["attempt"])]
        self.assertEqual(said, ["failed"] * 4)  # its work is no longer wanted: never a lease renewed, nor a fence
        self.assertEqual([self.events(store, n) for n in (1, 2, 3)], [["submitted", "claimed", "failed"]] * 3)

    def test_a_finish_checks_first_that_the_job_has_not_ended_nor_passed_its_deadline_then_the_cancel(self):
        store, now = self.clocked()
        store.submit("ana", "a", "export", {}, deadline_seconds=3)
        store.submit("ana", "b", "export", {})
        now[0] = 1
        first, second = store.claim_job(), store.claim_job()
        now[0] = 2
        store.progress(1, first["attempt"], 1, 1)
        store.progress(2, second["attempt"], 1, 1)
        now[0] = 3
        self.assertFalse(store.finish(1, first["attempt"], {"late": True}))  # the deadline came
        self.assertEqual((store.status("ana", 1)["state"], store.status("ana", 1)["error"], store.result("ana", 1)),
                         ("failed", "deadline_exceeded", None))
        self.assertTrue(store.finish(2, second["attempt"], {"n": 1}))
        for who in (store, self.store(lease_seconds=2)):  # ended: False, whoever asks, and nothing changes
            with self.subTest(who=who is store):
                self.assertFalse(who.finish(2, second["attempt"], {"n": 2}))
                self.assertFalse(who.finish(2, 99, {"n": 2}))
        self.assertEqual(store.result("ana", 2)["result"], {"n": 1})
        for result in (float("nan"), object(), (1, 2)):
            with self.subTest(result=result), self.assertRaises(ValueError):
                store.finish(2, second["attempt"], result)

    def test_a_failure_is_queued_again_after_its_wait_only_with_an_attempt_and_time_left(self):
        store, now = self.clocked()
        store.submit("ana", "k", "export", {}, deadline_seconds=20)
        now[0] = 1
        job = store.claim_job()
        now[0] = 2
        self.assertEqual(store.fail(1, job["attempt"], "busy", retry_after=3), "queued")
        now[0] = 4
        self.assertIsNone(store.claim_job())  # not before 5
        now[0] = 5
        job = store.claim_job()
        now[0] = 6
        self.assertEqual(job["attempt"], 2)
        self.assertEqual(store.fail(1, job["attempt"], "busy", retry_after=3), "failed")  # no attempt left
        self.assertEqual(store.status("ana", 1)["error"], "busy")
        store.submit("ana", "k2", "export", {}, deadline_seconds=5, max_attempts=5)
        job = store.claim_job()
        self.assertEqual(store.fail(2, job["attempt"], "busy", retry_after=5), "failed")  # it would end past the deadline
        for error in ("", "x" * 81, None):
            with self.subTest(error=error), self.assertRaises(ValueError):
                store.fail(2, 1, error)

    def test_a_worker_whose_claim_is_not_current_is_fenced(self):
        store, now = self.clocked()
        other = self.store(lease_seconds=2, clock=lambda: now[0])
        store.submit("ana", "k", "export", {})
        now[0] = 1
        late = store.claim_job()
        now[0] = 4  # its lease ran out, and nobody has claimed the job since
        for call in (lambda: store.progress(1, late["attempt"], 1, 2), lambda: store.finish(1, late["attempt"], {}),
                     lambda: store.fail(1, late["attempt"], "busy"), lambda: store.renew_job(1, late["attempt"])):
            with self.assertRaises(agent_loop.Superseded) as fenced:
                call()
            self.assertEqual(fenced.exception.reason, "lease_expired")
        current = other.claim_job()
        with self.assertRaises(agent_loop.Superseded) as fenced:
            store.finish(1, late["attempt"], {"by": "late"})
        self.assertEqual(fenced.exception.reason, "stale")
        with self.assertRaises(agent_loop.Superseded):  # the same attempt, held by another store: stale too
            store.finish(1, current["attempt"], {"by": "late"})
        self.assertTrue(other.finish(1, current["attempt"], {"by": "current"}))
        self.assertEqual((store.result("ana", 1)["result"], self.events(store, 1).count("succeeded")),
                         ({"by": "current"}, 1))

    def test_what_a_job_must_be_is_a_value_error(self):
        store, _ = self.clocked()
        cases = [(("", "k", "x", {}), "owner must be a string of 1 to 80 printable characters"),
                 (("a", "k" * 81, "x", {}), "action_key must be a string of 1 to 80 printable characters"),
                 (("a", "k", None, {}), "kind must be a string of 1 to 80 printable characters"),
                 (("a\x00", "k", "x", {}), "owner must be a string of 1 to 80 printable characters"),
                 (("a", "k\n", "x", {}), "action_key must be a string of 1 to 80 printable characters"),
                 (("a", "k", "x", {}, None, 2**31), "max_attempts must be an int >= 1"),
                 (("a", "k", "x", {"n": float("inf")}), "params must be plain JSON data"),
                 (("a", "k", "x", {}, 0), "deadline_seconds must be a finite number > 0, or None"),
                 (("a", "k", "x", {}, None, 0), "max_attempts must be an int >= 1")]
        for args, message in cases:
            with self.subTest(args=args), self.assertRaises(ValueError) as refused:
                store.submit(*args)
            self.assertEqual(str(refused.exception), message)
        with self.assertRaises(ValueError):
            self.store(max_jobs=0)

    async def test_work_jobs_runs_each_kind_reports_progress_and_ends_each_job_as_its_function_did(self):
        store = self.store(lease_seconds=5)
        seen = []

        def export(month, progress):  # a plain function: in a thread, its progress plain too
            for done in (1, 2):
                progress(done, 2)
            return {"month": month, "rows": 2}

        async def count(n, progress):  # an async one: awaited, its progress async
            await progress(1, 1)
            return {"n": n}

        async def busy(progress):
            seen.append("busy")
            raise agent_loop.RetryLater(0)

        def broken(progress):
            raise KeyError("private detail")

        for key, kind, params in (("a", "export", {"month": "2026-08"}), ("b", "count", {"n": 7}),
                                  ("c", "busy", {}), ("d", "broken", {}), ("e", "count", [1]), ("f", "other", {})):
            store.submit("ana", key, kind, params)
        worked = await agent_loop.work_jobs(store, {"export": export, "count": count, "busy": busy, "broken": broken})
        states = [(store.status("ana", n)["state"], store.status("ana", n)["error"]) for n in range(1, 7)]
        self.assertEqual(states, [("succeeded", None), ("succeeded", None), ("failed", "retry_later"),
                                  ("failed", "KeyError"), ("failed", "params_not_an_object"), ("queued", None)])
        self.assertEqual((worked, seen), (6, ["busy", "busy"]))  # busy: two attempts
        self.assertEqual(store.result("ana", 1)["result"], {"month": "2026-08", "rows": 2})
        self.assertEqual(self.events(store, 1), ["submitted", "claimed", "progress", "progress", "succeeded"])
        self.assertNotIn("private", json.dumps([store.events("ana", n) for n in range(1, 7)]))

    async def test_work_jobs_stops_a_job_at_its_next_progress_once_its_cancel_was_asked(self):
        store = self.store(lease_seconds=5)
        store.submit("ana", "k", "long", {})
        reported, asked = [], threading.Event()

        def long(progress):
            for done in range(1, 100):
                reported.append(done)
                progress(done, 99)
                if done == 2:
                    asked.wait(30)  # the owner asks to cancel here
            return {"done": 99}

        working = asyncio.create_task(agent_loop.work_jobs(store, {"long": long}))
        await wait_until(lambda: len(reported) == 2)
        self.assertEqual(store.cancel("ana", 1)["state"], "cancel_requested")
        asked.set()
        await working
        self.assertEqual((store.status("ana", 1)["state"], reported, store.result("ana", 1)), ("cancelled", [1, 2, 3], None))

    async def test_work_jobs_stops_a_job_that_hangs_at_its_next_renewal_once_its_deadline_has_passed(self):
        now = [0.0]
        store = self.store(lease_seconds=3, clock=lambda: now[0])  # renewed every second
        store.submit("ana", "k", "hangs", {}, deadline_seconds=1)
        started, stopped = asyncio.Event(), []

        async def hangs(progress):  # never a word, never an end
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                stopped.append("cancelled")
                raise

        working = asyncio.create_task(agent_loop.work_jobs(store, {"hangs": hangs}))
        await started.wait()
        now[0] = 2  # past its deadline, within its lease
        self.assertEqual(await asyncio.wait_for(working, 30), 1)
        self.assertEqual((store.status("ana", 1)["error"], stopped, self.events(store, 1)),
                         ("deadline_exceeded", ["cancelled"], ["submitted", "claimed", "failed"]))

    async def test_work_jobs_keeps_the_lease_of_a_job_that_reports_no_progress_and_fills_asyncios_pool(self):
        store = self.store(lease_seconds=1.0)
        other = self.store(lease_seconds=1.0)
        store.submit("ana", "k", "quiet", {})
        release = threading.Event()
        self.addCleanup(release.set)

        async def quiet(progress):  # not a word for over two leases, its blocking work in the pool to_thread shares
            await asyncio.gather(*(asyncio.to_thread(release.wait, 60) for _ in range(40)))
            return {"quiet": True}

        working = asyncio.create_task(agent_loop.work_jobs(store, {"quiet": quiet}))
        for _ in range(8):
            await asyncio.sleep(0.3)
            self.assertIsNone(other.claim_job())  # never free: its lease is kept, renewed off that pool
        release.set()
        await working
        self.assertEqual(self.events(store, 1), ["submitted", "claimed", "succeeded"])

    def test_work_jobs_is_given_a_store_and_its_functions(self):
        store = self.store()
        for args, message in (((object(), {"a": dict}), "store must be a SqlStore"),
                              ((store, {}), "functions must be a dict of job kinds to functions"),
                              ((store, {"a": 1}), "functions must be a dict of job kinds to functions")):
            with self.subTest(message=message), self.assertRaises(ValueError) as refused:
                asyncio.run(agent_loop.work_jobs(*args))
            self.assertEqual(str(refused.exception), message)

    def test_numbers_and_names_the_database_cannot_hold_are_refused_or_answered_none(self):
        store, now = self.clocked()
        store.submit("ana", "k", "export", {})
        now[0] = 1
        job = store.claim_job()
        for job_id in (2**64, -1, 0):
            self.assertEqual((store.status("ana", job_id), store.events("ana", job_id)), (None, None))
        self.assertEqual(store.events("ana", 1, after=2**64), [])
        self.assertEqual(len(store.events("ana", 1, after=-2**64)), 2)
        self.assertEqual(store.status(1, 1), None)  # an owner is a string: 1 is nobody's
        for call in (lambda: store.progress(1, job["attempt"], 2**31, 2**31), lambda: store.claim_job(["a\x00"]),
                     lambda: store.fail(1, job["attempt"], "x\x00"), lambda: store.fail(1, job["attempt"], "x",
                                                                                        retry_after=10**400)):
            with self.assertRaises(ValueError):
                call()
        self.assertEqual(store.status("ana", 1)["state"], "running")  # nothing changed

    def test_a_clock_that_is_not_a_number_is_refused_not_stored(self):
        now = [0.0]
        store = self.store(lease_seconds=2, clock=lambda: now[0])
        store.submit("ana", "k", "export", {})
        now[0] = math.nan
        with self.assertRaises(ValueError) as refused:
            store.claim_job()
        self.assertEqual(str(refused.exception), "the store's clock gave no finite number of seconds")
        now[0] = 1.0
        self.assertEqual(store.claim_job()["attempt"], 1)  # nothing was claimed with a NaN lease

    async def test_a_function_that_raises_anything_on_its_call_or_its_await_fails_its_job_by_class(self):
        async def strict(x, progress):
            return {"x": x}

        async def cancels_itself(progress):
            raise asyncio.CancelledError

        async def exits(progress):
            raise SystemExit(3)

        def plain(x, progress):
            return {"x": x}

        async def later(progress):
            raise agent_loop.RetryLater(10**400)

        store = self.store(lease_seconds=5)
        cases = (("strict", {"y": 1}, "TypeError"), ("strict", {"x": 1, "progress": 5}, "TypeError"),
                 ("plain", {"x": 1, "progress": 5}, "TypeError"), ("cancels_itself", {}, "CancelledError"),
                 ("exits", {}, "SystemExit"), ("later", {}, "RetryLater"))
        for n, (kind, params, _) in enumerate(cases):
            store.submit("ana", f"k{n}", kind, params, max_attempts=1)
        functions = {"strict": strict, "cancels_itself": cancels_itself, "exits": exits, "plain": plain,
                     "later": later}
        self.assertEqual(await agent_loop.work_jobs(store, functions), len(cases))
        self.assertEqual([(store.status("ana", n + 1)["state"], store.status("ana", n + 1)["error"])
                          for n in range(len(cases))], [("failed", error) for *_, error in cases])

    async def test_a_superseded_the_function_raises_or_a_class_name_no_code_can_be_fails_its_job_by_a_short_code(self):
        odd = type("Quota\nExceeded", (Exception,), {})  # a class's name is not always a short code

        def superseded(progress):  # its own store's fence, say: not this worker's
            raise agent_loop.Superseded("another-run", "stale")

        async def superseded_async(progress):
            raise agent_loop.Superseded("another-run", "stale")

        def odd_name(progress):
            raise odd("private detail")

        async def no_name(progress):
            raise type("", (Exception,), {})()

        store = self.store(lease_seconds=5)
        kinds = ("superseded", "superseded_async", "odd_name", "no_name")
        for kind in kinds:
            store.submit("ana", kind, kind, {}, max_attempts=2)
        functions = {"superseded": superseded, "superseded_async": superseded_async, "odd_name": odd_name,
                     "no_name": no_name}
        self.assertEqual(await agent_loop.work_jobs(store, functions), 4)  # each once: none left running
        self.assertEqual([(store.status("ana", n)["state"], store.status("ana", n)["error"]) for n in (1, 2, 3, 4)],
                         [("failed", "Superseded"), ("failed", "Superseded"), ("failed", "error"), ("failed", "error")])
        self.assertEqual([self.events(store, n) for n in (1, 2, 3, 4)], [["submitted", "claimed", "failed"]] * 4)
        self.assertNotIn("private", json.dumps(store.events("ana", 3)))

    def test_an_attempt_that_is_not_an_int_is_a_value_error_not_a_stale_claim(self):
        store, now = self.clocked()
        store.submit("ana", "k", "export", {})
        now[0] = 1
        self.assertEqual(store.claim_job()["attempt"], 1)
        for attempt in ("1", None, True, 1.0):
            for call in (lambda: store.progress(1, attempt, 1, 2), lambda: store.finish(1, attempt, {}),
                         lambda: store.fail(1, attempt, "busy"), lambda: store.renew_job(1, attempt)):
                with self.subTest(attempt=attempt):
                    with self.assertRaises(ValueError) as refused:
                        call()
                    self.assertEqual(str(refused.exception), "attempt must be an int, as claim_job gave it")
        self.assertEqual((store.status("ana", 1)["state"], self.events(store, 1)), ("running", ["submitted", "claimed"]))

    async def test_a_worker_waits_out_a_busy_database_to_finish_its_job(self):
        store = self.impatient(lease_seconds=5)
        store.submit("ana", "k", "quick", {})
        held = threading.Event()

        def hold():  # another connection holds the database (SQLite) or the job's row (PostgreSQL) for a second
            db = self.connect()
            cursor = db.cursor()
            cursor.execute("BEGIN IMMEDIATE" if self.kind() == "sqlite" else "BEGIN")
            if self.kind() != "sqlite":
                cursor.execute("SELECT * FROM agent_loop_jobs WHERE id = 1 FOR UPDATE")
            held.set()
            time.sleep(1.0)
            cursor.execute("COMMIT")
            db.close()

        holder = threading.Thread(target=hold)

        def quick(progress):  # it ends while the other connection holds what its finish needs
            holder.start()
            held.wait(30)
            return {"done": True}

        worked = await agent_loop.work_jobs(store, {"quick": quick})
        holder.join(30)
        self.assertEqual((worked, store.result("ana", 1)["result"]), (1, {"done": True}))

    def impatient(self, **options):
        """A store whose SQLite connection waits 0.1 s for a lock (PostgreSQL's statements wait _LOCK_WAIT)."""
        connect = (lambda: sqlite3.connect(self.where, isolation_level=None, timeout=0.1, check_same_thread=False)) \
            if self.kind() == "sqlite" else self.connect
        store = agent_loop.SqlStore(connect, **options)
        self.addCleanup(store.close)
        return store

    async def test_a_worker_frozen_inside_a_job_transaction_holds_it_a_lease_on_postgresql_and_the_lock_on_sqlite(self):
        store = self.impatient(lease_seconds=JOB_LEASE)
        store.submit("ana", "k", "export", {})
        ready = os.path.join(self.folder, "frozen")
        worker = subprocess.Popen(child_command("frozen_job_worker", self.kind(), self.where, ready),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(worker.wait, 60)
        self.addCleanup(worker.kill)
        await wait_until(lambda: os.path.exists(ready), 60)
        os.kill(worker.pid, signal.SIGSTOP)  # inside its progress's transaction: the job's row, or SQLite's lock
        await asyncio.sleep(JOB_LEASE + agent_loop._STALLED + 0.5)
        claimed = await asyncio.to_thread(store.claim_job)
        if self.kind() == "sqlite":  # one lock, which no live process can take: nobody gets the job, nobody hangs
            self.assertIsNone(claimed)
        else:  # its session ended once its lease ran out: the job is another worker's
            self.assertEqual((claimed["id"], claimed["attempt"]), (1, 2))

    async def test_a_worker_frozen_claiming_a_queued_job_holds_it_a_stall_on_postgresql_and_the_lock_on_sqlite(self):
        store = self.impatient(lease_seconds=JOB_LEASE)
        store.submit("ana", "k", "export", {})
        ready = os.path.join(self.folder, "frozen")
        worker = subprocess.Popen(child_command("frozen_job_worker", self.kind(), self.where, ready, "claim"),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(worker.wait, 60)
        self.addCleanup(worker.kill)
        await wait_until(lambda: os.path.exists(ready), 60)
        os.kill(worker.pid, signal.SIGSTOP)  # inside its claim's transaction: the queued job's row, or SQLite's lock
        if self.kind() == "postgres":
            await asyncio.sleep(agent_loop._STALLED + 0.5)  # its transaction has stalled
        if self.kind() == "sqlite":  # one lock, which no live process can take: the owner hears busy, nobody hangs
            with self.assertRaises(agent_loop.JobError) as busy:
                store.status("ana", 1)
            self.assertEqual((busy.exception.code, await asyncio.to_thread(store.claim_job)), ("busy", None))
        else:  # a job no lease holds: its claimer's session, stalled, is ended, and the job is another worker's
            self.assertEqual(store.status("ana", 1)["state"], "queued")
            claimed = await asyncio.to_thread(store.claim_job)
            self.assertEqual((claimed["id"], claimed["attempt"]), (1, 1))

    async def test_a_cancel_run_that_meets_a_held_run_says_busy_never_the_drivers_error(self):
        store = self.impatient()
        store.add("r")
        holder = self.connect()
        self.addCleanup(holder.close)
        holder.execute("BEGIN IMMEDIATE" if self.kind() == "sqlite" else "BEGIN")
        holder.execute("SELECT 1 FROM agent_loop_runs WHERE run_id = 'r'" + ("" if self.kind() == "sqlite" else
                                                                             " FOR UPDATE"))
        with self.assertRaises(agent_loop.JobError) as busy:
            store.cancel_run("r")
        holder.execute("ROLLBACK")
        self.assertEqual((busy.exception.code, store.cancel_run("r")), ("busy", "cancelled"))

    def crashed_worker(self, stop):
        """A worker process that claims job 1 and, one step in, writes ready and stops there: killed (SIGKILL), or
        stopped (SIGSTOP) and returned, to be woken."""
        ready = os.path.join(self.folder, "ready")
        log = open(os.path.join(self.folder, "worker.log"), "w+")
        self.addCleanup(log.close)
        worker = subprocess.Popen(child_command("job_worker", self.kind(), self.where, ready), stdout=log,
                                  stderr=subprocess.STDOUT)
        self.addCleanup(worker.wait, 60)
        self.addCleanup(worker.kill)
        end = time.monotonic() + 60
        while not os.path.exists(ready):
            self.assertTrue(worker.poll() is None and time.monotonic() < end, "the worker never got there")
            time.sleep(0.01)
        os.kill(worker.pid, signal.SIGKILL if stop == "kill" else signal.SIGSTOP)
        return worker, log

    async def test_a_worker_killed_mid_job_leaves_it_to_another_after_its_lease_and_it_has_one_result(self):
        store = self.store(lease_seconds=JOB_LEASE)
        store.submit("ana", "k", "export", {"month": "2026-08"})
        worker, _ = self.crashed_worker("kill")
        worker.wait(60)
        self.assertIsNone(store.claim_job())  # its lease still runs
        await asyncio.sleep(JOB_LEASE * 1.5)
        self.assertEqual(await agent_loop.work_jobs(store, {"export": quick_export}), 1)
        self.assertEqual((store.status("ana", 1)["attempt"], store.result("ana", 1)["result"]), (2, {"by": "second"}))
        self.assertEqual(self.events(store, 1).count("succeeded"), 1)

    async def test_a_worker_stopped_past_its_lease_and_woken_is_refused_and_the_job_keeps_one_result(self):
        store = self.store(lease_seconds=JOB_LEASE)
        store.submit("ana", "k", "export", {"month": "2026-08"})
        worker, log = self.crashed_worker("stop")
        await asyncio.sleep(JOB_LEASE * 1.5)
        self.assertEqual(await agent_loop.work_jobs(store, {"export": quick_export}), 1)  # another took it over
        open(os.path.join(self.folder, "ready.woken"), "w").close()
        os.kill(worker.pid, signal.SIGCONT)
        self.assertEqual(worker.wait(60), 0)
        log.seek(0)
        said = [json.loads(line) for line in log.read().splitlines()]
        self.assertEqual(said, [{"progress": "stale"}, {"finish": False}])  # woken: refused; the job had ended
        self.assertEqual((store.result("ana", 1)["result"], self.events(store, 1).count("succeeded")),
                         ({"by": "second"}, 1))


def quick_export(month, progress):
    progress(1, 1)
    return {"by": "second"}
