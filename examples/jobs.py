"""The long-running work chapter's experiments: a job's lifecycle and the ways it fails, on a clock of its own; then a
run that waits for its job.

    python3 examples/jobs.py
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's root, for agent_loop

from agent_loop import JobError, SqliteStore, Superseded, run_command  # noqa: E402
from examples.scenarios import run_scenario  # noqa: E402


# The long-running work chapter's experiments: a job's lifecycle, and the ways it fails, on a clock of its own

def _job_store(folder, now, **options):
    """A store in folder's jobs.db on the clock now[0], leases of 2 seconds."""
    return SqliteStore(os.path.join(folder, "jobs.db"), lease_seconds=2, clock=lambda: now[0], **options)


def _fenced_by(call):
    """What a store call said: its value, or "Superseded <reason>"."""
    try:
        return call()
    except Superseded as fenced:
        return f"Superseded {fenced.reason}"


def _receipt_text(receipt):
    return f"job {receipt['id']} {receipt['state']}" + (f" ({receipt['error']})" if receipt["error"] else "")


def jobs_lifecycle(folder):
    """Print a job's life: submitted, the store reopened, claimed, its progress, finished; its events."""
    now = [0.0]
    store = _job_store(folder, now)
    receipt = store.submit("ana", "sales-2026-08", "export_report", {"month": "2026-08"})
    store.close()
    store = _job_store(folder, now)  # closed and opened again: the receipt was given once the job was saved
    print(f"  0  submit: {_receipt_text(receipt)}; the store closed and opened again: "
          f"{_receipt_text(store.status('ana', receipt['id']))}")
    now[0] = 1
    job = store.claim_job()
    print(f"  1  claimed: attempt {job['attempt']}, {job['kind']} {json.dumps(job['params'])}")
    for done in (1, 2, 3):
        now[0] = 1 + done
        state = store.progress(job["id"], job["attempt"], done, 3)
        seen = store.status("ana", job["id"])
        print(f"  {now[0]:.0f}  progress {done}/3: {state}" + (
            f"; a reader polls ({seen['state']} {seen['done']}/{seen['total']}), then stops: the job goes on"
            if done == 1 else ""))
    now[0] = 5
    stored = store.finish(job["id"], job["attempt"], {"rows": 3, "total_cents": 6000})
    got = store.result("ana", job["id"])
    print(f"  5  finish: {stored}; {_receipt_text(store.status('ana', job['id']))} {json.dumps(got['result'])}, "
          f"fingerprint {got['fingerprint'][:12]}")
    events = [event["event"] for event in store.events("ana", job["id"])]
    after = [event["event"] for event in store.events("ana", job["id"], after=5)]
    print(f"     {len(events)} events ({', '.join(events)}); after=5: {', '.join(after)}")
    store.close()


def jobs_failures(folder):
    """Print the ways a job fails, or is refused, each its own outcome."""
    now = [0.0]
    store = _job_store(folder, now)
    first = store.submit("ana", "sales-2026-08", "export_report", {"month": "2026-08"})
    again = store.submit("ana", "sales-2026-08", "export_report", {"month": "2026-08"})
    print(f"  repeated submit   the same {_receipt_text(again)}")
    try:
        store.submit("ana", "sales-2026-08", "export_report", {"month": "2026-09"})
    except JobError as refused:
        print(f"  key conflict      JobError {refused.code}; {_receipt_text(store.status('ana', first['id']))}, "
              "unchanged")
    other = store.submit("bob", "sales-2026-08", "export_report", {"month": "2026-08"})
    print(f"  two owners        jobs {first['id']} and {other['id']}; bob's status of job 1: "
          f"{store.status('bob', first['id'])}")
    store.close()

    def case(title, steps):
        now[0] = 0.0
        with tempfile.TemporaryDirectory() as place, _job_store(place, now) as a, _job_store(place, now) as b:
            job_id = a.submit("ana", "k", "export_report", {"month": "2026-08"}, **steps.get("submit", {}))["id"]
            said = steps["run"](a, b, job_id)
            print(f"  {title:<17} {said}; {_receipt_text(a.status('ana', job_id))}")

    def late_worker(a, b, job_id):
        now[0] = 1
        first = a.claim_job()
        now[0] = 3
        second = b.claim_job()
        now[0] = 4
        late = _fenced_by(lambda: a.finish(job_id, first["attempt"], {"by": "A"}))
        kept = b.finish(job_id, second["attempt"], {"by": "B"})
        events = [event["event"] for event in a.events("ana", job_id)].count("succeeded")
        return f"A claims at 1 (lease 2), B at 3; at 4 A's finish: {late}, B's: {kept}, {events} result"

    def lease_out(a, b, job_id):
        now[0] = 1
        job = a.claim_job()
        now[0] = 4
        return f"A claims at 1; at 4 its finish: {_fenced_by(lambda: a.finish(job_id, job['attempt'], {}))}"

    def cancelled(a, b, job_id):
        now[0] = 1
        job = a.claim_job()
        asked = a.cancel("ana", job_id)["state"]
        return f"asked: {asked}; the finish: {a.finish(job_id, job['attempt'], {'rows': 3})}, no result"

    def cancelled_late(a, b, job_id):
        now[0] = 1
        job = a.claim_job()
        a.finish(job_id, job["attempt"], {"rows": 3})
        return f"asked after the finish: {a.cancel('ana', job_id)['state']}, it stays"

    def deadline(a, b, job_id):
        now[0] = 1
        job = a.claim_job()
        now[0] = 2
        a.progress(job_id, job["attempt"], 1, 3)
        now[0] = 3
        return f"progress at 2, the finish at 3: {a.finish(job_id, job['attempt'], {'rows': 3})}"

    def retried(a, b, job_id):
        now[0] = 1
        job = a.claim_job()
        now[0] = 2
        queued = a.fail(job_id, job["attempt"], "busy", retry_after=3)
        now[0] = 4
        early = a.claim_job()
        now[0] = 5
        job = a.claim_job()
        now[0] = 6
        last = a.fail(job_id, job["attempt"], "busy", retry_after=3)
        return f"fail at 2: {queued}; claim at 4: {early}; at 5: attempt {job['attempt']}; fail: {last}"

    case("late worker", {"run": late_worker})
    case("lease run out", {"run": lease_out})
    case("cancel, running", {"run": cancelled})
    case("cancel, too late", {"run": cancelled_late})
    case("deadline of 3", {"run": deadline, "submit": {"deadline_seconds": 3}})
    case("retry after 3", {"run": retried})


async def jobs_in_a_run():
    """Print the atlas's job_done: the order submitted as a job, the run paused, a worker, the run called again."""
    seen = []
    result, _ = await run_scenario("job_done", seen.append)
    paused = next(event for event in seen if event.get("status") == "awaiting_job")
    (pending,) = paused["pending"]
    work = [event["job"] for event in seen if "job" in event and len(event) == 1]
    done = [event for event in seen if event.get("event") == "job"]
    steps = [f"progress {event['done']}/{event['total']}" if event["event"] == "progress" else event["event"]
             for event in work if event["event"] != "submitted"]
    print(f"  run     rounds 1-{paused['rounds']}: reads, plan, the order submitted as job {pending['job']}; "
          f"{paused['status']}, no lease held")
    print(f"  worker  job {pending['job']}: {', '.join(steps)}")
    print(f"  run     called again: job {done[0]['job']} {done[0]['state']}, {done[0]['call_id']} observes its "
          f"result; round {result['used']['rounds']}: {result['status']}")
    print(f"  answer  {json.dumps(result['answer'])}")


async def jobs_chapter():
    """Print the chapter's experiments: a job's lifecycle, then its failures, on a clock of their own; then a run
    that waits for its job."""
    with tempfile.TemporaryDirectory() as folder:
        print("a job's lifecycle (a clock of its own, leases of 2):")
        jobs_lifecycle(folder)
    with tempfile.TemporaryDirectory() as folder:
        print("its failures, each its own outcome:")
        jobs_failures(folder)
    print("a run that waits for its job (scenarios job_done):")
    await jobs_in_a_run()


def main(argv=None):
    """Run the chapter's experiments: 0, or 1 with one line on standard error."""
    parser = argparse.ArgumentParser(description="A durable job's lifecycle and its failures, on a clock of its own.")
    return run_command(parser, lambda *_: jobs_chapter(), parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
