"""The child processes the tests start, run as python3 tests/children.py NAME ARGS: runs that crash, workers of a
pool, workers that freeze.
"""

import asyncio
import dataclasses
import json
import os
import sqlite3
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the root

import agent_loop
from agent_loop import call, fake_model, Fixtures, Limits, run_agent, scripted, TemporaryError, ToolSpec
from test_agent_loop import any_answer, calls, read_file, ROOMY, SLOW_ROOMY
from tests.support import JOB_LEASE, JOB_RUN_OPTIONS
from tests.servers import mcp_lowlevel_server, mcp_server
from examples.orders import _catalog_accepted, _catalog_model, JOB_ORDER_TOOLS, order_accepted, order_catalog, order_model, ORDER_TOOLS, OrderDesk, receipt_accepted, receipt_model


def crashing_run(path, run_id, crash, log):
    """A named run in the SQLite store at path, each call's start logged; with crash "tool" or "model", it writes
    log + ".ready" and hangs while both reads run, or while the second decision is made: the parent kills it there."""
    class Logged(agent_loop.Fixtures):
        async def invoke(self, call):
            with open(log, "a") as file:  # every start, in every process: what ran, and how often
                file.write(call["call_id"] + "\n")
            if crash == "tool" and call["call_id"] == "r1-north":
                while "r1-south" not in open(log).read().split():  # both reads have started: south runs, north hangs
                    await asyncio.sleep(0.001)
                open(log + ".ready", "w").close()
                await asyncio.sleep(600)  # the parent kills us here
            return await super().invoke(call)

    async def model(history):
        if crash == "model" and len(history) == 1:
            open(log + ".ready", "w").close()
            await asyncio.sleep(600)  # the parent kills us while the second decision is being made
        return await fake_model(history)

    async def main():
        with agent_loop.SqliteStore(path) as store:
            limits = Limits(tool_seconds=600, model_seconds=600, total_seconds=600, calls=8, credits=40)
            result = await run_agent(model, store=store, run_id=run_id, fixtures=Logged(delays={}), limits=limits)
        print(json.dumps(result))

    asyncio.run(main())




def writing_run(store_path, service, ready, crash):
    """The inventory's run with its order, against an order service of its own (a file: every effect of a key is a
    row); with crash "after_apply", the order applies, ready is written, and it hangs: the parent kills it there."""
    def service_db():
        db = sqlite3.connect(service, isolation_level=None)
        db.execute("CREATE TABLE IF NOT EXISTS effects (key TEXT, items TEXT)")
        db.execute("CREATE TABLE IF NOT EXISTS asked (key TEXT)")
        return db

    class Desk(OrderDesk):
        async def invoke(self, call):
            if call["name"] != "place_order":
                return await super().invoke(call)
            service_db().execute("INSERT INTO effects VALUES (?, ?)", (call["idempotency_key"], "placed"))
            if crash == "after_apply":
                open(ready, "w").close()
                await asyncio.sleep(600)  # applied; the parent kills us before its observation is saved
            return {"order": "PO-1"}

        async def reconcile(self, call):
            db = service_db()
            db.execute("INSERT INTO asked VALUES (?)", (call["idempotency_key"],))
            applied = db.execute("SELECT COUNT(*) FROM effects WHERE key = ?", (call["idempotency_key"],)).fetchone()[0]
            return {"applied": True, "data": {"order": "PO-1"}} if applied else {"applied": False}

    async def main():
        with agent_loop.SqliteStore(store_path) as store:
            result = await run_agent(order_model, registry=ORDER_TOOLS,
                                     accept=order_accepted, fixtures=Desk(delays={}), store=store,
                                     run_id="order", approve=lambda write: "approve",
                                     limits=Limits(tool_seconds=600, total_seconds=600))
        print(json.dumps(result))

    asyncio.run(main())


async def until_exists(path):
    """Wait until the file path exists (at once for no path): a worker's start, ordered by its test."""
    while path and not os.path.exists(path):
        await asyncio.sleep(0.02)


def pool_worker(kind, where, name, crash, go=""):
    """A worker of the pool, on SQLite or PostgreSQL (kind) at where: the README's worker loop over runs with writes,
    printing a JSON line per claim and end; with crash "after_second_write", its second order applies, it says so,
    and hangs: the test kills it there. Given go, a file, it starts once that file exists."""
    def connect():
        if kind == "sqlite":
            return sqlite3.connect(where, isolation_level=None, timeout=30)
        import psycopg
        return psycopg.connect(where, autocommit=True)

    def say(**line):
        print(json.dumps({"worker": name, "at": time.time(), **line}), flush=True)

    service, writes = connect(), []

    class Desk(OrderDesk):  # the order service: a table of the same database, every effect of a key a row
        def sql(self, statement, parameters):
            cursor = service.cursor()
            cursor.execute(statement.replace("?", "?" if kind == "sqlite" else "%s"), parameters)
            return cursor

        async def invoke(self, call):
            if call["name"] != "place_order":
                return await super().invoke(call)
            self.sql("INSERT INTO effects VALUES (?, ?)", (call["idempotency_key"], name))
            writes.append(call["idempotency_key"])
            if crash == "after_second_write" and len(writes) == 2:
                say(applied=call["idempotency_key"])
                await asyncio.sleep(600)  # applied; the test kills this worker before the write's observation is saved
            return {"order": call["idempotency_key"][:8]}

        async def reconcile(self, call):
            (count,) = self.sql("SELECT COUNT(*) FROM effects WHERE key = ?", (call["idempotency_key"],)).fetchone()
            return {"applied": True, "data": {"order": call["idempotency_key"][:8]}} if count else {"applied": False}

    async def main():
        await until_exists(go)
        with agent_loop.SqlStore(connect, lease_seconds=1.0) as store:
            while store.runnable():  # the worker loop of the README
                run_id = await asyncio.to_thread(store.claim_next)
                if run_id is None:
                    await asyncio.sleep(0.05)
                    continue
                say(claimed=run_id)
                result = await run_agent(
                    order_model, registry=ORDER_TOOLS, accept=order_accepted,
                    fixtures=Desk(delays={"north": 0.01, "south": 0.01}), store=store, run_id=run_id,
                    approve=lambda write: "approve", limits=Limits(tool_seconds=30, total_seconds=120))
                say(ended=run_id, status=result["status"])

    asyncio.run(main())


def frozen_worker(kind, where, run_id, ready, freeze, lease="1.0"):
    """A worker that runs run_id and freezes inside a transaction of its first save that has something to write: on
    SQLite or PostgreSQL (kind) at where, "between" two of its statements, or, on PostgreSQL, "pipeline": in the
    middle of executemany's statements; or, with freeze "claim_next", that claims the next run and freezes as its
    claim's UPDATE is made. It writes ready and sleeps a moment: the parent stops it there with SIGSTOP, and wakes it
    later with SIGCONT. It prints its run's status (what its claim answered, or the class of what it raised)."""
    def connect():
        if kind == "sqlite":
            return sqlite3.connect(where, isolation_level=None, timeout=30, check_same_thread=False)
        import psycopg

        class Pausing(psycopg.Cursor):  # its executemany stops once all of its statements have gone out
            def executemany(self, query, rows, **options):
                def sent():
                    yield from rows
                    if rows and freeze == "pipeline" and not store.frozen:
                        store.frozen = True
                        freeze_here()  # every statement sent, none synced: the transaction holds the row
                return super().executemany(query, sent(), **options)

        return psycopg.connect(where, autocommit=True, cursor_factory=Pausing)

    def freeze_here():
        open(ready, "w").close()
        time.sleep(5)  # the parent stops us in here

    class Freezing(agent_loop.SqlStore):
        frozen = False

        def _sql(self, statement, parameters=()):
            cursor = super()._sql(statement, parameters)
            at = {"between": "UPDATE agent_loop_runs SET state", "claim_next": "UPDATE agent_loop_runs SET generation"}
            if freeze in at and statement.startswith(at[freeze]) and not self.frozen:
                self.frozen = True
                freeze_here()  # its UPDATE made: the row is locked (on SQLite, the whole database)
            return cursor

    async def main():
        if freeze == "claim_next":
            try:
                print(json.dumps(store.claim_next()))
            except Exception as error:  # its session was ended while it was stopped
                print(json.dumps(type(error).__name__))
            return
        result = await run_agent(store=store, run_id=run_id, fixtures=Fixtures(delays={}),
                                 limits=Limits(tool_seconds=30, model_seconds=30, total_seconds=120))
        print(json.dumps(result["status"]))

    store = Freezing(connect, lease_seconds=float(lease))
    try:
        asyncio.run(main())
    finally:
        store.close()


def catalog_run(store_path, ready, where):
    """The chapter's catalog run, named and saved: it searches and loads, then writes ready and hangs, where says:
    as the model asks for the call of the loaded tool ("decision"), or while that call runs ("call"). The parent
    kills it there."""
    def crash_here(**arguments):
        open(ready, "w").close()
        time.sleep(600)

    async def main():
        catalog, grants, functions = order_catalog()
        model = _catalog_model(crash_here if where == "decision" else lambda: None)
        if where == "call":
            functions = {**functions, "orders_get": crash_here}
        with agent_loop.SqliteStore(store_path) as store:
            await run_agent(model, registry={}, catalog=catalog, grants=grants, accept=_catalog_accepted,
                            store=store, run_id="chat", fixtures=agent_loop.FunctionTools(functions),
                            limits=SLOW_ROOMY)

    asyncio.run(main())


def retried_run(log, crash=False):
    """A named run's options: its first batch a flaky read with three retries beside a plain read, then a plain read
    a round until Limits.calls stops it; each start of a tool a line of log. Given crash, the flaky read's fourth
    attempt, once the plain read has started, writes log + ".ready" and hangs: the parent kills the child there."""
    key = {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"], "additionalProperties": False}

    async def flaky(k):
        with open(log, "a") as file:
            file.write("flaky\n")
        if crash and read_file(log).count("flaky") == 4:
            while "plain" not in read_file(log):
                await asyncio.sleep(0.01)
            open(log + ".ready", "w").close()
            await asyncio.sleep(600)
        raise TemporaryError("busy")

    def plain(k):
        with open(log, "a") as file:
            file.write("plain\n")
        return {"k": k}

    async def model(history):
        if not history:
            return calls(call("f", "flaky", k="a"), call("p1", "plain", k="b"))
        return calls(call(f"p{len(history) + 1}", "plain", k=str(len(history))))

    registry = {"flaky": ToolSpec(1, True, True, parameters=key, retries=3, backoff=(0.001, 0.001)),
                "plain": ToolSpec(1, True, True, parameters=key)}
    return dict(model=model, registry=registry, fixtures=agent_loop.FunctionTools({"flaky": flaky, "plain": plain}),
                limits=dataclasses.replace(SLOW_ROOMY, calls=6, credits=100, rounds=10), accept=any_answer,
                run_id="retried")


def retrying_run(store_path, log):
    """retried_run, named and saved, killed during its flaky read's fourth attempt."""
    async def main():
        with agent_loop.SqliteStore(store_path) as store:
            await run_agent(store=store, **retried_run(log, crash=True))

    asyncio.run(main())


def job_worker(kind, where, ready):
    """A job worker on SQLite or PostgreSQL (kind) at where: it claims job 1, reports one step, writes ready and
    waits there (the parent kills or stops it) until ready.woken is written; then it tries its next step and its
    finish, printing what each said."""
    def connect():
        if kind == "sqlite":
            return sqlite3.connect(where, isolation_level=None, timeout=30, check_same_thread=False)
        import psycopg
        return psycopg.connect(where, autocommit=True)

    with agent_loop.SqlStore(connect, lease_seconds=JOB_LEASE) as store:
        job = store.claim_job()
        store.progress(job["id"], job["attempt"], 1, 3)
        open(ready, "w").close()
        end = time.monotonic() + 60
        while not os.path.exists(ready + ".woken") and time.monotonic() < end:  # stopped, or killed, in here
            time.sleep(0.01)
        for step, call in (("progress", lambda: store.progress(job["id"], job["attempt"], 2, 3)),
                           ("finish", lambda: store.finish(job["id"], job["attempt"], {"by": "first"}))):
            try:
                print(json.dumps({step: call()}), flush=True)
            except agent_loop.Superseded as fenced:
                print(json.dumps({step: fenced.reason}), flush=True)


def store_of(kind, where, store=None, **options):
    """A SqlStore (or the class store) on SQLite or PostgreSQL (kind) at where."""
    def connect():
        if kind == "sqlite":
            return sqlite3.connect(where, isolation_level=None, timeout=30, check_same_thread=False)
        import psycopg
        return psycopg.connect(where, autocommit=True)

    return (store or agent_loop.SqlStore)(connect, **options)


def hangs_once_submitted(ready):
    """A SqlStore that, the moment a job's submit has committed, writes ready and hangs there: the parent kills its
    process, the call's observation never saved."""
    class Submitted(agent_loop.SqlStore):
        def submit(self, *args, **options):
            receipt = super().submit(*args, **options)
            open(ready, "w").close()
            time.sleep(600)
            return receipt

    return Submitted


def job_run(kind, where, ready):
    """The order as a job, run by name, killed once its job was submitted (hangs_once_submitted)."""
    async def main():
        with store_of(kind, where, hangs_once_submitted(ready)) as store:
            await run_agent(receipt_model, registry=JOB_ORDER_TOOLS,
                            accept=receipt_accepted, fixtures=Fixtures(delays={}), store=store,
                            run_id="order", approve=lambda write: "approve", limits=ROOMY)

    asyncio.run(main())


def slow_run(kind, where, log):
    """The inventory's run, named "slow", each call logged; its plan waits until log + ".go" exists: another process
    cancels the run meanwhile. Its result, as JSON."""
    class Slow(agent_loop.Fixtures):
        async def invoke(self, call):
            with open(log, "a") as file:
                file.write(call["call_id"] + "\n")
            while call["name"] == "compute_plan" and not os.path.exists(log + ".go"):
                await asyncio.sleep(0.01)
            return await super().invoke(call)

    async def main():
        with store_of(kind, where) as store:
            result = await run_agent(store=store, run_id="slow", fixtures=Slow(delays={}), limits=SLOW_ROOMY)
        print(json.dumps(result))

    asyncio.run(main())


def cancel_run(kind, where, run_id, by):
    """Cancel run_id from this process, and print what the store said."""
    with store_of(kind, where) as store:
        print(json.dumps(store.cancel_run(run_id, by=by)))


def follow(kind, where, run_id):
    """Follow run_id from this process: print each event as it is saved, with its seq, until the run ends."""
    with store_of(kind, where) as store:
        after = 0
        while True:
            for event in store.trace(run_id, after):
                after = event["seq"]
                print(json.dumps(event), flush=True)
                if event["event"] == "stop":
                    return
            time.sleep(0.005)


def job_pool_worker(kind, where, name, role, go=""):
    """A worker of a pool whose runs each place their order as a job: role "runs" works runs (the README's worker
    loop), "jobs" works jobs; each prints a JSON line per claim or job begun, until no run is left unfinished.
    Given go, a file, it starts once that file exists."""
    def say(**line):
        print(json.dumps({"worker": name, **line}), flush=True)

    def place(items, progress):
        say(working=True)
        for done in range(1, len(items) + 1):
            time.sleep(0.02)
            progress(done, len(items))
        return {"order": "PO", "lines": len(items), "total_cents": sum(item["cents"] for item in items)}

    async def main():
        await until_exists(go)
        with store_of(kind, where, lease_seconds=1.0) as store:
            while store.runnable():
                if role == "jobs":
                    if not await agent_loop.work_jobs(store, {"place_order": place}):
                        await asyncio.sleep(0.05)
                    continue
                run_id = store.claim_next()
                if run_id is None:
                    await asyncio.sleep(0.05)
                    continue
                say(claimed=run_id)
                await run_agent(receipt_model, registry=JOB_ORDER_TOOLS,
                                accept=receipt_accepted, fixtures=Fixtures(delays={}), store=store,
                                run_id=run_id, approve=lambda write: "approve",  # room for a batch a crash cut
                                limits=dataclasses.replace(SLOW_ROOMY, calls=12, credits=60))

    asyncio.run(main())


def frozen_job_worker(kind, where, ready, at="progress"):
    """A job worker that claims job 1 and freezes inside its first progress's transaction (or, at "claim", inside
    its claim's), its UPDATE made: it writes ready and sleeps there; the parent stops it with SIGSTOP."""
    class Freezing(agent_loop.SqlStore):
        def _sql(self, statement, parameters=()):
            cursor = super()._sql(statement, parameters)
            if statement.startswith({"progress": "UPDATE agent_loop_jobs SET done",
                                     "claim": "UPDATE agent_loop_jobs SET state = 'running'"}[at]):
                open(ready, "w").close()
                time.sleep(60)
            return cursor

    with store_of(kind, where, Freezing, lease_seconds=JOB_LEASE) as store:
        job = store.claim_job()
        store.progress(job["id"], job["attempt"], 1, 2)


def serial_jobs_run(kind, where, ready):
    """A serial batch of two job calls, run by name, killed once the first's job was submitted."""
    async def main():
        with store_of(kind, where, hangs_once_submitted(ready)) as store:
            await run_agent(scripted(calls(call("a", "ja", x=1), call("b", "jb", x=2))), **JOB_RUN_OPTIONS,
                            store=store, run_id="serial")

    asyncio.run(main())


def counted_run(path, ready, crash):
    """The counted run (tests/test_usage.py), named "counted" in the SQLite store at path, killed as crash says:
    "plan", while the second reply's call runs; "model", while the model makes its second decision."""
    from tests.test_usage import COUNTED_LIMITS, counted_model

    class Hanging(Fixtures):
        async def invoke(self, call):
            if crash == "plan" and call["name"] == "compute_plan":
                open(ready, "w").close()
                await asyncio.sleep(600)  # the parent kills us here
            return await super().invoke(call)

    async def model(history):
        if crash == "model" and len(history) == 1:
            open(ready, "w").close()
            await asyncio.sleep(600)  # the parent kills us while the second decision is being made
        return await counted_model(history)

    async def main():
        with agent_loop.SqliteStore(path) as store:
            await run_agent(model, store=store, run_id="counted", fixtures=Hanging(delays={}), limits=COUNTED_LIMITS)

    asyncio.run(main())


CHILDREN = {"mcp_server": mcp_server, "mcp_lowlevel_server": mcp_lowlevel_server, "crashing_run": crashing_run,
            "writing_run": writing_run,
            "pool_worker": pool_worker, "frozen_worker": frozen_worker, "catalog_run": catalog_run,
            "retrying_run": retrying_run,
            "job_worker": job_worker, "job_run": job_run, "slow_run": slow_run, "cancel_run": cancel_run,
            "follow": follow, "job_pool_worker": job_pool_worker,
            "frozen_job_worker": frozen_job_worker, "serial_jobs_run": serial_jobs_run,
            "counted_run": counted_run}  # what `python3 tests/children.py NAME ARGS` runs


if __name__ == "__main__":
    raise SystemExit(CHILDREN[sys.argv[1]](*sys.argv[2:]))
