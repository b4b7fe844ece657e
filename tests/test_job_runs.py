"""PART 15: a run that waits for its jobs without holding a process; runs cancelled and followed from anywhere.
"""

import asyncio
import dataclasses
import json
import os
import sqlite3
import subprocess
import threading
import time

import agent_loop
from agent_loop import accepted, call, Fixtures, Limits, run_agent, scripted, TOOLS, ToolSpec
from test_agent_loop import any_answer, calls, errors, final, observations, PLAN, read_file, ROOMY, wait_until
from tests.support import child_command, JOB_RUN_OPTIONS, JOB_X, JobRunTools, LeaseCase, run_in_a_process
from examples.orders import JOB_ORDER_TOOLS, place_order_job, receipt_accepted, receipt_model


class JobRunTests(LeaseCase):
    """PART 15 and PART 11: job tools in a named run, awaiting_job and going on; a run cancelled and followed from
    another process; a run that kills its workers set aside; here on SQLite (PostgresJobRunTests: PostgreSQL)."""

    def run_options(self, store, run_id="order", **options):
        return dict(registry=JOB_ORDER_TOOLS, accept=receipt_accepted,
                    fixtures=Fixtures(delays={}), store=store, run_id=run_id, limits=ROOMY, **options)

    def asked(self):
        """receipt_model, counting the decisions it makes."""
        count = []

        async def model(history):
            count.append(len(history))
            return await receipt_model(history)

        return model, count

    async def test_a_job_tool_needs_a_store_that_keeps_jobs(self):
        registry = JOB_ORDER_TOOLS
        await self.assertRefusedBeforeTheModelIsAsked(
            "place_order: a job tool needs a store: run_agent(..., store=..., run_id=...)", registry=registry,
            accept=receipt_accepted, fixtures=Fixtures(delays={}))

        class Runs(agent_loop.Store):  # a store of named runs that keeps no jobs
            load = claim = claimed = save = unfinished = lambda self, *args: None

        await self.assertRefusedBeforeTheModelIsAsked(
            "place_order: a job tool needs a store that keeps jobs, such as a SqlStore", registry=registry,
            accept=receipt_accepted, fixtures=Fixtures(delays={}), store=Runs(), run_id="r")

    async def test_a_job_call_submits_its_job_and_the_run_pauses_holding_no_lease(self):
        store = self.store()
        result = await run_agent(receipt_model, approve=lambda write: "approve", **self.run_options(store))
        (pending,) = result["pending"]
        self.assertEqual((result["status"], pending["call_id"], pending["name"], pending["job"]),
                         ("awaiting_job", "r3-order", "place_order", 1))
        self.assertEqual(pending["arguments"], {"items": PLAN["items"]})
        self.assertEqual(result["used"], {"rounds": 3, "calls": 4, "credits": 20})  # the job's call charged as one
        (run,) = store.overview()["runs"]
        self.assertEqual((run["holder"], run["until"], run["waits"]), (None, None, "awaiting_job"))
        self.assertEqual(store.status("order", 1)["state"], "queued")  # its owner: the run
        job = store.claim_job()
        self.assertEqual((job["kind"], job["params"]), ("place_order", {"items": PLAN["items"]}))
        key = agent_loop.idempotency_key("order", "r3-order", store.store_id)
        self.assertEqual(store.submit("order", key, "place_order", {"items": PLAN["items"]})["id"], 1)  # its key

    async def test_a_write_job_is_approved_before_its_job_is_submitted(self):
        store = self.store()
        result = await run_agent(receipt_model, approve=lambda write: "ask", **self.run_options(store))
        self.assertEqual((result["status"], store.overview()["jobs"]), ("awaiting_approval", []))
        result = await run_agent(receipt_model, approvals={"r3-order": "approve"}, **self.run_options(store))
        self.assertEqual((result["status"], len(store.overview()["jobs"])), ("awaiting_job", 1))

    async def test_the_run_asks_the_model_nothing_until_every_job_has_ended_then_goes_on_with_its_result(self):
        store = self.store()
        model, asked = self.asked()
        await run_agent(model, approve=lambda write: "approve", **self.run_options(store))
        self.assertIsNone(store.claim_next())  # waiting on its job: no worker gets it
        again = await run_agent(model, **self.run_options(store))
        self.assertEqual((again["status"], again["used"], len(asked)), ("awaiting_job", {"rounds": 3, "calls": 4,
                                                                                          "credits": 20}, 3))
        self.assertEqual(await agent_loop.work_jobs(store, {"place_order": place_order_job}), 1)
        self.assertEqual(store.claim_next(), "order")  # its jobs have ended: a worker may go on with it
        done = await run_agent(model, **self.run_options(store))
        receipt = {"order": "PO-1", "lines": 3, "total_cents": 21900}
        self.assertEqual((done["status"], done["answer"], len(asked)), ("completed", receipt, 4))
        order = done["history"][2]["observations"][0]
        self.assertEqual((order["ok"], order["data"], order["job"]), (True, receipt, 1))
        self.assertEqual(len(store.overview()["jobs"]), 1)  # submitted once, whatever the resumes

    async def test_a_job_that_failed_or_was_cancelled_is_a_retryable_observation(self):
        for ending, error in (("failed", "job_failed"), ("cancelled", "job_cancelled")):
            with self.subTest(ending=ending):
                store = self.store()
                model = scripted(calls(call("r1-order", "place_order", items=PLAN["items"])), final("done"))
                options = {**self.run_options(store, ending), "accept": any_answer}
                paused = await run_agent(model, approve=lambda write: "approve", **options)
                job_id = paused["pending"][0]["job"]
                if ending == "failed":
                    job = store.claim_job()
                    store.fail(job["id"], job["attempt"], "out_of_stock")
                else:
                    store.cancel(ending, job_id)
                result = await run_agent(model, **options)
                (obs,) = observations(result)
                self.assertEqual((result["status"], obs["error"], obs["retryable"], obs.get("reason")),
                                 ("completed", error, True, "out_of_stock" if ending == "failed" else None))

    async def test_the_time_paused_is_none_of_the_runs_and_each_job_has_the_runs_job_seconds(self):
        now = [time.time()]
        store = self.store(clock=lambda: now[0])
        limits = Limits(total_seconds=0.5, tool_seconds=0.2, job_seconds=60)
        options = {**self.run_options(store), "limits": limits}
        await run_agent(receipt_model, approve=lambda write: "approve", **options)
        await asyncio.sleep(0.6)  # longer than the run may take: paused, it is no time of the run's
        now[0] += 61  # and past the job's deadline, on the store's clock
        self.assertIsNone(store.claim_job())
        self.assertEqual(store.status("order", 1)["error"], "deadline_exceeded")
        result = await run_agent(receipt_model, **options)  # not past its deadline: it goes on
        failed = observations(result)[3]
        self.assertEqual((failed["error"], failed["reason"]), ("job_failed", "deadline_exceeded"))
        self.assertEqual((result["status"], result["pending"][0]["call_id"]), ("awaiting_approval", "r4-order"))

    async def test_a_run_killed_right_after_submitting_its_job_resumes_without_a_second_job(self):
        ready = os.path.join(self.folder, "submitted")
        run_in_a_process("job_run", self.kind(), self.where, ready, kill_when=ready)
        store = self.store()
        self.assertEqual(len(store.overview()["jobs"]), 1)  # its submit committed; its observation was never saved
        options = self.run_options(store)
        paused = await run_agent(receipt_model, **options)
        self.assertEqual((paused["status"], paused["pending"][0]["job"]), ("awaiting_job", 1))
        self.assertEqual(errors(paused)[-1], "awaiting_job")
        await agent_loop.work_jobs(store, {"place_order": place_order_job})
        done = await run_agent(receipt_model, **options)
        self.assertEqual((done["status"], len(store.overview()["jobs"])), ("completed", 1))
        self.assertEqual(done["used"]["calls"], 4)  # the cut call charged once

    async def test_a_run_no_lease_holds_is_cancelled_at_once_and_its_jobs_are_asked_to_cancel(self):
        store = self.store()
        await run_agent(receipt_model, approve=lambda write: "approve", **self.run_options(store))
        store.add("queued")
        self.assertEqual(store.cancel_run("order", by="ops"), "cancelled")
        self.assertEqual(store.cancel_run("queued"), "cancelled")
        self.assertEqual(store.status("order", 1)["state"], "cancelled")
        model, asked = self.asked()
        result = await run_agent(model, **self.run_options(store))  # its stored result: nothing asked
        self.assertEqual((result["status"], result["trace"][-1]["by"], asked), ("cancelled", "ops", []))
        queued = await run_agent(model, **{**self.run_options(store), "run_id": "queued"})
        self.assertEqual((queued["status"], queued["trace"][-1]["by"], asked), ("cancelled", "cancel_run", []))
        self.assertEqual((store.cancel_run("order"), store.cancel_run("nobody")), ("cancelled", None))
        done = await run_agent(**{**self.run_options(self.store()), "run_id": "done", "registry": TOOLS,
                                  "accept": accepted})
        self.assertEqual((done["status"], store.cancel_run("done")), ("completed", "completed"))  # left as it was

    async def test_a_cancel_from_another_process_stops_a_running_run_at_its_next_save(self):
        log = os.path.join(self.folder, "slow.log")
        worker = subprocess.Popen(child_command("slow_run", self.kind(), self.where, log), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        self.addCleanup(worker.kill)
        await wait_until(lambda: "r2-plan" in read_file(log), 60)  # its plan runs
        canceller = subprocess.run(child_command("cancel_run", self.kind(), self.where, "slow", "ops"),
                                   capture_output=True, text=True, timeout=60)
        open(log + ".go", "w").close()  # the plan ends once the other process has asked
        self.assertEqual(json.loads(canceller.stdout), "cancel_requested")
        out, _ = worker.communicate(timeout=60)
        result = json.loads(out.splitlines()[-1])
        self.assertEqual((result["status"], result["trace"][-1]["by"]), ("cancelled", "ops"))
        self.assertEqual(result["used"]["rounds"], 2)  # at its next save, once the plan it was running was observed
        self.assertEqual(self.store().load("slow")["status"], "cancelled")

    async def test_a_follower_in_another_process_sees_every_event_once_in_order(self):
        store = self.store()
        store.add("followed")
        follower = subprocess.Popen(child_command("follow", self.kind(), self.where, "followed"),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.addCleanup(follower.kill)
        slow = Fixtures(delays={"north": 0.05, "south": 0.05, "compute_plan": 0.05})
        result = await run_agent(store=store, run_id="followed", fixtures=slow, limits=ROOMY)
        out, _ = follower.communicate(timeout=60)
        seen = [json.loads(line) for line in out.splitlines()]
        self.assertEqual([event["seq"] for event in seen], list(range(1, len(result["trace"]) + 1)))
        self.assertEqual([{k: v for k, v in event.items() if k != "seq"} for event in seen], result["trace"])
        self.assertEqual(store.trace("followed", 3), [{"seq": n, **event} for n, event in
                                                     enumerate(result["trace"][3:], 4)])

    def test_a_run_whose_workers_die_every_time_is_handed_out_max_claims_times_then_set_aside(self):
        now = [0.0]
        store = self.store(lease_seconds=1, clock=lambda: now[0], max_claims=3)
        store.add("a-poison")
        store.add("b-fine")
        handed = []
        for _ in range(6):
            handed.append(store.claim_next())
            now[0] += 2  # its worker died with it: the lease runs out
        self.assertEqual(handed, ["a-poison"] * 3 + ["b-fine"] * 3)
        (poison, fine) = store.overview()["runs"]
        self.assertEqual((poison["waits"], poison["why"]), ("aside", "handed out 3 times in a row, its lease ran out "
                                                                     "each time"))
        store.add("other")
        self.assertEqual(store.claim_next(), "other")
        store.release("other", 1)  # a claim that ended otherwise starts the count again
        for _ in range(3):
            self.assertEqual(store.claim_next(), "other")
            now[0] += 2
        self.assertIsNone(store.claim_next())

    def jobs_of(self, store):
        return [(job["id"], job["kind"], job["state"]) for job in store.overview()["jobs"]]

    async def test_a_serial_batch_cut_after_its_first_job_was_submitted_submits_no_other(self):
        ready = os.path.join(self.folder, "submitted")
        run_in_a_process("serial_jobs_run", self.kind(), self.where, ready, kill_when=ready)
        store = self.store()
        paused = await run_agent(scripted(calls(call("a", "ja", x=1), call("b", "jb", x=2))), **JOB_RUN_OPTIONS,
                                 store=store, run_id="serial")
        self.assertEqual([(obs["call_id"], obs["error"]) for obs in observations(paused)],
                         [("a", "awaiting_job"), ("b", "batch_aborted")])  # b never started: it waited for a
        self.assertEqual(paused["used"]["calls"], 1)
        self.assertEqual(self.jobs_of(store), [(1, "ja", "queued")])

    async def test_a_submit_that_outlived_its_time_limit_is_the_same_job_not_a_second(self):
        class Slow(agent_loop.SqlStore):
            submits = 0

            def submit(self, *args, **options):
                Slow.submits += 1
                if Slow.submits == 1:
                    time.sleep(0.5)  # past the call's tool_seconds; it commits all the same
                return super().submit(*args, **options)

        store = Slow(self.connect)
        self.addCleanup(store.close)
        result = await run_agent(scripted(calls(call("w1", "jw", x=1)), calls(call("w2", "jw", x=1))),
                                 **{**JOB_RUN_OPTIONS, "limits": dataclasses.replace(ROOMY, tool_seconds=0.2)},
                                 store=store, run_id="slow", approve=lambda write: "approve")
        self.assertEqual((result["status"], result["pending"][0]["call_id"]), ("awaiting_job", "w1"))
        self.assertEqual(self.jobs_of(store), [(1, "jw", "queued")])

    async def test_a_cancel_asked_while_a_writes_outcome_is_unknown_ends_the_run_once_it_is_settled(self):
        said = [None]

        class Unsure(JobRunTools):
            async def invoke(self, call):
                if call["name"] == "wr":
                    await asyncio.sleep(10)  # applied, never answers
                return await super().invoke(call)

            async def reconcile(self, call):
                self.asked.append(call["call_id"])
                return said[0]

        store = self.store()
        options = {**JOB_RUN_OPTIONS, "store": store, "run_id": "w",
                   "limits": dataclasses.replace(ROOMY, tool_seconds=0.2)}
        model = scripted(calls(call("w", "wr", x=1)), final("done"))
        paused = await run_agent(model, **{**options, "fixtures": Unsure()}, approve=lambda write: "approve")
        self.assertEqual(paused["status"], "unknown_outcome")
        self.assertEqual(store.cancel_run("w", by="ops"), "cancel_requested")  # not ended: its write is unknown
        tools = Unsure()
        still = await run_agent(model, **{**options, "fixtures": tools})
        self.assertEqual((still["status"], tools.asked, store.load("w")["status"]), ("cancelled", ["w"], None))
        said[0], tools = {"applied": True, "data": {"placed": 1}}, Unsure()
        ended = await run_agent(model, **{**options, "fixtures": tools})
        self.assertEqual((ended["status"], ended["trace"][-1]["by"], tools.asked), ("cancelled", "ops", ["w"]))
        self.assertEqual((observations(ended)[0]["reconciled"], store.load("w")["status"]), (True, "cancelled"))

    async def test_an_ended_runs_jobs_are_asked_to_cancel_whatever_ended_it(self):
        store = self.store()

        class Asked(agent_loop.SqlStore):
            def submit(self, *args, **options):  # another process asks to cancel the run just before the submit
                if not self.asked:
                    self.asked = True
                    store.cancel_run("race", by="ops")
                return super().submit(*args, **options)

        racing = Asked(self.connect)
        racing.asked = False
        self.addCleanup(racing.close)
        cancelled = await run_agent(scripted(calls(call("a", "ja", x=1))), **JOB_RUN_OPTIONS, store=racing,
                                    run_id="race")
        failing = await run_agent(scripted(calls(call("b", "rd", x=0), call("c", "jp", x=1))), **JOB_RUN_OPTIONS,
                                  store=store, run_id="fails")
        self.assertEqual((cancelled["status"], failing["status"]), ("cancelled", "tool_exception"))
        self.assertEqual(self.jobs_of(store), [(1, "ja", "cancelled"), (2, "jp", "cancelled")])

    async def test_a_call_that_fails_ends_the_run_whatever_the_order_of_a_job_beside_it_and_its_job_is_cancelled(self):
        store = self.store()
        for run_id, batch in (("job first", [call("a", "jp", x=1), call("b", "rd", x=0)]),
                              ("read first", [call("a", "rd", x=0), call("b", "jp", x=2)])):
            with self.subTest(run_id=run_id):
                result = await run_agent(scripted(calls(*batch)), **JOB_RUN_OPTIONS, store=store, run_id=run_id)
                self.assertEqual((result["status"], "pending" in result, result["trace"][-1]["name"]),
                                 ("tool_exception", False, "rd"))
        self.assertEqual(self.jobs_of(store), [(1, "jp", "cancelled"), (2, "jp", "cancelled")])

    async def test_a_job_past_its_deadline_while_the_run_waits_lets_the_run_go_on(self):
        now = [time.time()]
        store = self.store(clock=lambda: now[0])
        options = {**JOB_RUN_OPTIONS, "store": store, "run_id": "late",
                   "limits": dataclasses.replace(JOB_RUN_OPTIONS["limits"], job_seconds=10)}
        model = scripted(calls(call("a", "ja", x=1)), final("done"))
        await run_agent(model, **options)
        now[0] += 1000  # no worker ever took it
        self.assertEqual(store.claim_next(), "late")  # its job has ended: past its deadline
        result = await run_agent(model, **options)
        (obs,) = observations(result)
        self.assertEqual((result["status"], obs["error"], obs["reason"]), ("completed", "job_failed",
                                                                           "deadline_exceeded"))

    async def test_a_running_job_past_its_deadline_lets_the_run_go_on_and_its_next_progress_stops_its_function(self):
        now = [time.time()]
        store = self.store(clock=lambda: now[0])  # a lease of 30 s: the worker's runs all along
        options = {**JOB_RUN_OPTIONS, "store": store, "run_id": "slow-job",
                   "limits": dataclasses.replace(JOB_RUN_OPTIONS["limits"], job_seconds=10)}
        model = scripted(calls(call("a", "ja", x=1)), final("done"))
        self.assertEqual((await run_agent(model, **options))["status"], "awaiting_job")
        started, go, steps = threading.Event(), threading.Event(), []
        self.addCleanup(go.set)

        def ja(x, progress):  # a plain function: in a thread, which nothing can cancel
            for done in (1, 2, 3):
                progress(done, 3)
                steps.append(done)
                started.set()
                go.wait(60)
            return {"x": x}

        working = asyncio.create_task(agent_loop.work_jobs(store, {"ja": ja}))
        await asyncio.to_thread(started.wait, 60)
        now[0] += 11  # past the job's deadline (job_seconds from its submit), while its function still runs
        self.assertEqual(store.claim_next(), "slow-job")  # its job has ended: the run is free to go on
        result = await run_agent(model, **options)
        (obs,) = observations(result)
        self.assertEqual((result["status"], obs["error"], obs["reason"], steps, working.done()),
                         ("completed", "job_failed", "deadline_exceeded", [1], False))
        go.set()
        self.assertEqual(await working, 1)  # its next progress told it: the function stopped there
        self.assertEqual((steps, [event["event"] for event in store.events("slow-job", 1)]),
                         ([1], ["submitted", "claimed", "progress", "failed"]))

    async def test_a_runs_end_and_cancel_run_meet_a_job_past_its_deadline_as_failed_not_cancelled(self):
        now = [time.time()]
        store, watcher = self.store(clock=lambda: now[0]), self.store()
        limits = dataclasses.replace(JOB_RUN_OPTIONS["limits"], job_seconds=10)

        class Late(JobRunTools):
            async def invoke(self, call):
                if call["name"] == "rd":  # it fails once the batch's job was submitted and its deadline passed
                    await wait_until(lambda: watcher.overview()["jobs"], 60)
                    now[0] += 20  # (within the run's lease of 30 s)
                return await super().invoke(call)

        failing = await run_agent(scripted(calls(call("b", "rd", x=0), call("c", "jp", x=1))), store=store,
                                  **{**JOB_RUN_OPTIONS, "fixtures": Late(), "limits": limits}, run_id="fails")
        paused = await run_agent(scripted(calls(call("a", "ja", x=1))), **{**JOB_RUN_OPTIONS, "limits": limits},
                                 store=store, run_id="paused")
        now[0] += 20  # past its job's deadline
        self.assertEqual((failing["status"], paused["status"], store.cancel_run("paused")),
                         ("tool_exception", "awaiting_job", "cancelled"))
        self.assertEqual(self.jobs_of(store), [(1, "jp", "failed"), (2, "ja", "failed")])
        self.assertEqual([store.status(run_id, n)["error"] for run_id, n in (("fails", 1), ("paused", 2))],
                         ["deadline_exceeded"] * 2)

    async def test_a_run_waiting_on_jobs_is_handed_out_once_every_one_has_ended_and_not_before(self):
        now = [time.time()]
        store = self.store(clock=lambda: now[0])
        worker = self.store(clock=lambda: now[0], lease_seconds=1000)
        dying = self.store(clock=lambda: now[0], lease_seconds=50)  # its worker dies: its lease runs out
        # Each run waits on jobs of a kind of its own, named as it is; each is left in a state a waiting run may meet.
        registry = {}
        options = {**JOB_RUN_OPTIONS, "store": store, "registry": registry}

        async def waiting(run_id, jobs=1, job_seconds=3600):
            """The ids of the jobs of a run that paused on them, each job's deadline job_seconds from now."""
            registry[run_id] = ToolSpec(1, True, True, parameters=JOB_X, job=True)
            model = scripted(calls(*(call(f"{run_id}-{n}", run_id, x=n) for n in range(jobs))), final("done"))
            limits = dataclasses.replace(JOB_RUN_OPTIONS["limits"], job_seconds=job_seconds)
            paused = await run_agent(model, **{**options, "limits": limits}, run_id=run_id)
            self.assertEqual(paused["status"], "awaiting_job")
            return [pending["job"] for pending in paused["pending"]]

        def claimed(run_id, by=worker):
            job = by.claim_job([run_id])
            return job["id"], job["attempt"]

        await waiting("queued")
        await waiting("queued_to_retry")
        worker.fail(*claimed("queued_to_retry"), "busy", retry_after=1000)
        await waiting("queued_past_its_deadline", job_seconds=10)
        await waiting("running")
        claimed("running")
        await waiting("running_its_worker_dead")
        claimed("running_its_worker_dead", by=dying)
        await waiting("running_past_its_deadline", job_seconds=10)
        claimed("running_past_its_deadline")
        (job_id,) = await waiting("cancel_requested")
        claimed("cancel_requested")
        store.cancel("cancel_requested", job_id)
        (job_id,) = await waiting("cancel_requested_its_worker_dead")
        claimed("cancel_requested_its_worker_dead", by=dying)
        store.cancel("cancel_requested_its_worker_dead", job_id)
        await waiting("succeeded")
        worker.finish(*claimed("succeeded"), {"v": 1})
        await waiting("failed")
        worker.fail(*claimed("failed"), "out_of_stock")
        (late,) = await waiting("failed_past_its_deadline", job_seconds=10)
        (job_id,) = await waiting("cancelled_queued")
        store.cancel("cancelled_queued", job_id)
        (job_id,) = await waiting("cancelled_by_its_worker")
        attempt = claimed("cancelled_by_its_worker")
        store.cancel("cancelled_by_its_worker", job_id)
        worker.finish(*attempt, None)  # the cancel confirmed
        await waiting("one_of_two_ended", jobs=2)
        worker.finish(*claimed("one_of_two_ended"), {"v": 1})
        claimed("one_of_two_ended")
        (_, second) = await waiting("both_ended", jobs=2)
        worker.finish(*claimed("both_ended"), {"v": 1})  # the first: the oldest
        store.cancel("both_ended", second)
        now[0] += 100  # past the deadlines of 10 s, and the dead worker's lease
        store.status("failed_past_its_deadline", late)  # which fails a job queued past its deadline
        cases = {  # run: the states of its jobs, and whether claim_next hands it out
            "queued": (["queued"], False),
            "queued_to_retry": (["queued"], False),
            "queued_past_its_deadline": (["queued"], True),  # it will never start: ended
            "running": (["running"], False),
            "running_its_worker_dead": (["running"], False),
            "running_past_its_deadline": (["running"], True),  # as stored; past its deadline, it has ended too
            "cancel_requested": (["cancel_requested"], False),
            "cancel_requested_its_worker_dead": (["cancel_requested"], False),
            "succeeded": (["succeeded"], True),
            "failed": (["failed"], True),
            "failed_past_its_deadline": (["failed"], True),
            "cancelled_queued": (["cancelled"], True),
            "cancelled_by_its_worker": (["cancelled"], True),
            "one_of_two_ended": (["succeeded", "running"], False),
            "both_ended": (["succeeded", "cancelled"], True),
        }
        jobs = store.overview()["jobs"]
        self.assertEqual({run_id: [job["state"] for job in jobs if job["owner"] == run_id] for run_id in cases},
                         {run_id: states for run_id, (states, _) in cases.items()})
        handed = [store.claim_next() for _ in range(len(cases) + 1)]  # each leased as it is handed out: once
        self.assertEqual(sorted(filter(None, handed)), sorted(run_id for run_id, (_, out) in cases.items() if out))

    async def test_a_job_the_store_refuses_is_a_failed_observation_never_an_exception(self):
        store = self.store(max_jobs=1)
        store.submit("someone", "k", "export", {})  # the queue is full
        result = await run_agent(scripted(calls(call("a", "ja", x=1)), final("done")), **JOB_RUN_OPTIONS,
                                 store=store, run_id="full")
        (obs,) = observations(result)
        self.assertEqual((result["status"], obs["error"], obs["reason"], obs["retryable"]),
                         ("completed", "job_failed", "queue_full", True))

    async def test_what_a_job_tool_must_be_is_refused_before_the_model_is_asked(self):
        long = "j" * 81
        await self.assertRefusedBeforeTheModelIsAsked(
            f"{long[:80]}: a job tool's name is its jobs' kind: 1 to 80 printable characters",
            registry={long: ToolSpec(1, True, False, parameters=JOB_X, job=True)}, accept=any_answer,
            fixtures=JobRunTools(), store=self.store(), run_id="r")
        with self.assertRaises(ValueError):
            agent_loop.Catalog().add("export", ToolSpec(1, True, True, parameters=JOB_X, job=True), permission="p")

    def test_a_claim_by_name_that_ended_otherwise_starts_the_count_again(self):
        now = [0.0]
        store = self.store(lease_seconds=1, clock=lambda: now[0], max_claims=1)
        store.add("r")
        generation = store.leased[store.claim_next()]
        store.save("r", generation, {**agent_loop._NOTHING_SAVED, "paused_at": 1.0}, [], [])  # it paused: ended
        store.claim("r", "{}", 0.0)  # a claim by name, whose process then dies
        now[0] += 2
        self.assertEqual(store.claim_next(), "r")  # handed out once in a row, not twice
        now[0] += 2
        self.assertIsNone(store.claim_next())  # that one died too: set aside

    async def test_a_job_of_another_program_with_the_runs_id_as_owner_is_not_the_runs(self):
        store = self.store()
        other = store.submit("r", "my-own-key", "nightly_export", {"month": "2026-08"})
        await run_agent(scripted(calls(call("a", "ja", x=1)), final("done")), **JOB_RUN_OPTIONS, store=store,
                        run_id="r")
        job = store.claim_job(["ja"])
        store.finish(job["id"], job["attempt"], {"v": 1})
        self.assertEqual(store.claim_next(), "r")  # the other program's job is not one it waits for
        self.assertEqual((store.cancel_run("r"), store.status("r", other["id"])["state"]), ("cancel_requested",
                                                                                          "queued"))

    def test_a_trace_is_asked_with_any_cursor_and_a_run_id(self):
        store = self.store()
        asyncio.run(run_agent(store=store, run_id="t", limits=ROOMY))
        self.assertEqual((store.trace("t", 2**70), len(store.trace("t", -2**70))), ([], len(store.load("t")["trace"])))
        for call in (lambda: store.trace(["t"]), lambda: store.cancel_run({"a": 1}), lambda: store.trace("t", 1.0)):
            with self.assertRaises(ValueError):
                call()

    async def test_a_resume_looks_a_cut_jobs_call_up_and_never_submits_what_never_was(self):
        def dies(write):
            raise SystemExit  # as SIGKILL would, while the policy is asked: the write's verdict never saved

        store = self.store()
        model = scripted(calls(call("w", "jw", x=1)), final("done"))
        with self.assertRaises(SystemExit):
            await run_agent(model, **JOB_RUN_OPTIONS, store=store, run_id="r", approve=dies)
        result = await run_agent(model, **JOB_RUN_OPTIONS, store=store, run_id="r", approve=lambda w: "reject")
        self.assertEqual((result["status"], errors(result), store.overview()["jobs"]), ("completed", ["interrupted"],
                                                                                       []))

    async def test_a_job_write_the_store_refuses_did_not_apply_and_the_run_goes_on(self):
        store = self.store(max_jobs=1)
        store.submit("someone", "k", "export", {})  # the queue is full
        result = await run_agent(scripted(calls(call("w", "jw", x=1)), final("done")), **JOB_RUN_OPTIONS,
                                 store=store, run_id="r", approve=lambda write: "approve")
        self.assertEqual((result["status"], errors(result), "unknown" in result), ("completed", ["job_failed"],
                                                                                 False))

    async def test_a_store_that_fails_as_the_run_reads_its_jobs_result_stops_it_store_failed(self):
        class Failing(agent_loop.SqlStore):
            def result(self, owner, job_id):
                raise sqlite3.OperationalError("private: disk I/O error")

        store = self.store()
        options = {**JOB_RUN_OPTIONS, "run_id": "r"}
        await run_agent(scripted(calls(call("a", "ja", x=1)), final("done")), **options, store=store)
        job = store.claim_job()
        store.finish(job["id"], job["attempt"], {"v": 1})
        failing = Failing(self.connect)
        self.addCleanup(failing.close)
        result = await run_agent(scripted(calls(call("a", "ja", x=1)), final("done")), **options, store=failing)
        self.assertEqual((result["status"], result["trace"][-1]["error_type"]), ("store_failed", "OperationalError"))
        self.assertNoPrivateText(result)

    async def test_cancel_run_ends_a_run_a_crash_cut_in_its_reads_at_once_and_observes_a_paused_batch(self):
        now = [time.time()]
        store = self.store(lease_seconds=1, clock=lambda: now[0])
        held = Fixtures(delays={"north": 30})
        running = asyncio.create_task(run_agent(store=store, run_id="cut", fixtures=held, limits=ROOMY))
        await wait_until(lambda: len(held.started) == 2)
        running.cancel()  # the crash, while both reads run
        await asyncio.gather(running, return_exceptions=True)
        now[0] += 5  # its lease ran out
        self.assertEqual((store.cancel_run("cut", by="ops"), store.claim_next()), ("cancelled", None))  # no write
        ended = await run_agent(store=store, run_id="cut", fixtures=Fixtures(delays={}), limits=ROOMY)
        self.assertEqual((ended["status"], ended["used"], errors(ended), ended["trace"][-1]["by"]),
                         ("cancelled", {"rounds": 1, "calls": 2, "credits": 7}, ["interrupted", "interrupted"], "ops"))
        self.assertNotIn("resumed", [event["event"] for event in ended["trace"]])  # the store ended it: no worker
        model = scripted(calls(call("a", "ja", x=1), call("w", "wr", x=2)), final("done"))
        paused = await run_agent(model, **JOB_RUN_OPTIONS, store=store, run_id="ask", approve=lambda write: "ask")
        self.assertEqual((paused["status"], store.cancel_run("ask")), ("awaiting_approval", "cancelled"))
        stored = await run_agent(model, **JOB_RUN_OPTIONS, store=store, run_id="ask")
        self.assertEqual((stored["status"], errors(stored), "pending" in stored),
                         ("cancelled", ["cancelled", "cancelled"], False))

    async def test_a_cancel_asked_mid_serial_batch_observes_every_call_the_stop_overtook(self):
        store, started = self.store(), []

        class Asks(JobRunTools):
            async def invoke(self, call):
                started.append(call["call_id"])
                if call["call_id"] == "a":
                    await asyncio.to_thread(store.cancel_run, "serial", "ops")  # from "another process"
                return await super().invoke(call)

        model = scripted(calls(*(call(cid, "rs", x=n) for n, cid in enumerate("abc"))), final("done"))
        options = {**JOB_RUN_OPTIONS, "registry": {"rs": ToolSpec(1, True, False, parameters=JOB_X)},
                   "fixtures": Asks()}
        result = await run_agent(model, **options, store=store, run_id="serial")
        self.assertEqual((result["status"], started, [obs.get("error") for obs in observations(result)]),
                         ("cancelled", ["a"], [None, "cancelled", "cancelled"]))
        self.assertEqual(store.load("serial")["history"], result["history"])

    def test_a_pool_of_run_workers_and_job_workers_one_of_each_killed_ends_every_run_once_each_job_once(self):
        queue = self.store()
        runs = [f"run-{n:02}" for n in range(20)]
        for run_id in runs:
            queue.add(run_id)
        # Each victim works alone until it is killed (so that it has work however the machine schedules them),
        # then the others of its kind start: the run workers, then the last job worker.
        go = {kind: os.path.join(self.folder, f"go-{kind}") for kind in ("runs", "jobs")}
        workers, lines = self.workers("job_pool_worker", ("runs-victim", "runs"), ("runs-1", "runs", go["runs"]),
                                      ("runs-2", "runs", go["runs"]), ("jobs-victim", "jobs"),
                                      ("jobs-1", "jobs", go["jobs"]))

        end = time.monotonic() + 90
        for victim, mark, kind in (("runs-victim", "claimed", "runs"), ("jobs-victim", "working", "jobs")):
            while len([line for line in lines(victim) if mark in line]) < 2:
                self.assertLess(time.monotonic(), end, lines(victim))
                time.sleep(0.01)
            workers[victim].kill()  # SIGKILL, mid-run or mid-job
            open(go[kind], "w").close()
        for name in ("runs-1", "runs-2", "jobs-1"):
            self.assertEqual(workers[name].wait(timeout=120), 0, lines(name))
        jobs = queue.overview()["jobs"]
        self.assertEqual(sorted(job["owner"] for job in jobs), runs)  # one job per call
        for run_id in runs:
            saved = queue.load(run_id)
            (job,) = [job for job in jobs if job["owner"] == run_id]
            self.assertEqual((saved["status"], job["state"]), ("completed", "succeeded"), run_id)
            self.assertEqual(saved["answer"], queue.result(run_id, job["id"])["result"])
            self.assertEqual([event["event"] for event in queue.events(run_id, job["id"])].count("succeeded"), 1)
            self.assertEqual([event.get("status") for event in saved["trace"]].count("completed"), 1)
