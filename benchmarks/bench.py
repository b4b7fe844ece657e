"""The benchmark: what parallel batches and bounded waits buy, what the runtime costs, and the store's and the pool's
figures.

    python3 benchmarks/bench.py              # every section, a median [min .. max] each
    python3 benchmarks/bench.py --quick      # fewer repeats: a smoke run of a few seconds
    python3 benchmarks/bench.py --json       # the figures as one JSON object

It imports one private helper, agent_loop._copy, the copy of history each round makes for the model: timed alone on
the same history, it is the "copy floor" that a round's growth with history is measured beside.
"""

import argparse
import asyncio
import dataclasses
import json
import math
import multiprocessing
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's root, for agent_loop

from agent_loop import (  # noqa: E402
    DATA, MODEL_COST, SKUS, FunctionTools, Limits, SqlStore, TemporaryError, ToolSpec, _copy, run_command, call,
    run_agent,
)


# The benchmark: what parallel batches and bounded waits buy, what the runtime costs, and the store's and the
# pool's figures

BENCH_WAIT = 0.05  # seconds each tool waits in the parallel-efficiency batches


async def _tick(n):
    return {"n": n}


async def _wait(n):
    await asyncio.sleep(BENCH_WAIT)
    return {"n": n}


async def _hang(n):
    await asyncio.sleep(60)


_BENCH_FUNCTIONS = {"tick": _tick, "wait": _wait, "hang": _hang}


def _accepts_nothing(answer, history):
    return False  # the bench's runs are about time, not answers


def _bench_registry(parallel=True, flaky=False):
    registry = {name: ToolSpec(0, True, parallel, validate=lambda args: True) for name in ("tick", "wait", "hang")}
    if flaky:
        registry["flaky"] = ToolSpec(0, True, parallel, validate=lambda args: True, retries=1, backoff=(1e-9, 1e-9))
    return registry


def _flaky_functions():
    """The bench's functions, and flaky: each n fails once (transiently), then answers at once."""
    failed = set()

    async def flaky(n):
        if n not in failed:
            failed.add(n)
            raise TemporaryError("once")
        return {"n": n}

    return {**_BENCH_FUNCTIONS, "flaky": flaky}


def _batches(name, per_round):
    """A model that asks for `per_round` calls of one tool every round, with fresh ids and arguments."""
    async def model(history):
        number = len(history) + 1
        batch = [call(f"{name}{number}-{i}", name, n=number * 10 + i) for i in range(per_round)]
        return {"kind": "calls", "calls": batch}
    return model


def _roomy(rounds, calls, **seconds):
    times = {"tool_seconds": 30, "model_seconds": 30, "total_seconds": 600, **seconds}
    return Limits(rounds=rounds, calls=calls, credits=MODEL_COST * rounds, attempts=1, **times)


async def _timed(model, limits, parallel=True, functions=_BENCH_FUNCTIONS):
    tools = FunctionTools(functions)
    start = time.perf_counter()
    registry = _bench_registry(parallel, "flaky" in functions)
    result = await run_agent(model, limits=limits, fixtures=tools, registry=registry, accept=_accepts_nothing)
    return time.perf_counter() - start, result


def _spread(samples, scale=1.0):
    """Median, min and max of samples, scaled."""
    return {"median": statistics.median(samples) * scale, "min": min(samples) * scale, "max": max(samples) * scale}


async def _parallel_efficiency(repeats):
    figures = {}
    for k in (1, 2, 4):
        figures[str(k)] = {}
        for mode, parallel in (("parallel", True), ("serial", False)):
            walls = [(await _timed(_batches("wait", k), _roomy(1, k), parallel))[0] for _ in range(repeats)]
            figures[str(k)][mode] = _spread(walls, 1 / BENCH_WAIT)
    return figures


async def _overhead(repeats, runs=40, rounds=5):
    """Microseconds of the runtime's own work per round (one instant call) and per further call in a batch."""
    per_round, per_call = [], []
    for _ in range(repeats):
        one = sum([(await _timed(_batches("tick", 1), _roomy(rounds, rounds)))[0] for _ in range(runs)])
        four = sum([(await _timed(_batches("tick", 4), _roomy(rounds, 4 * rounds)))[0] for _ in range(runs)])
        per_round.append(one / (runs * rounds))
        per_call.append((four - one) / (3 * runs * rounds))
    return {"round_us": _spread(per_round, 1e6), "call_us": _spread(per_call, 1e6)}


async def _limit_overshoot(runs):
    """Milliseconds past tool_seconds until a hanging tool stopped, and past total_seconds until run_agent returned."""
    tool, total = [], []
    for _ in range(runs):
        stopped = []

        class Recorded(FunctionTools):
            async def invoke(self, call):
                start = time.perf_counter()
                try:
                    return await super().invoke(call)
                finally:
                    stopped.append(time.perf_counter() - start)

        hanging = Recorded(_BENCH_FUNCTIONS)
        await run_agent(_batches("hang", 1), limits=_roomy(1, 1, tool_seconds=0.05), fixtures=hanging,
                        registry=_bench_registry(), accept=_accepts_nothing)
        tool.append(stopped[0] - 0.05)
        wall, _ = await _timed(_batches("hang", 1), _roomy(1, 1, total_seconds=0.1))
        total.append(wall - 0.1)
    return {"tool_ms": _spread(tool, 1e3), "total_ms": _spread(total, 1e3)}


async def _growth(sizes, samples=20):
    """Milliseconds per round once history holds n rounds, beside the cheapest exact copy of that history (the copy
    floor: a round copies it once, for the model)."""
    figures, ticks = {}, _batches("tick", 1)
    for n in sizes:
        marks = []

        async def model(history):
            marks.append(time.perf_counter())  # one mark per decision: a round is the time between two
            return await ticks(history)

        _, result = await _timed(model, _roomy(n + 1, n + 1))
        rounds = [after - before for before, after in zip(marks, marks[1:])][-samples:]
        history = result["history"][:n]
        copies = []
        for _ in range(min(samples, len(rounds))):
            start = time.perf_counter()
            view = _copy(history)
            del view  # made and let go, as each round's copy is
            copies.append(time.perf_counter() - start)
        figures[str(n)] = {"round_ms": _spread(rounds, 1e3), "copy_ms": _spread(copies, 1e3)}
    return figures


def _sqlite_place(folder):
    """A function that connects to a new SQLite file in folder: a fresh database for one measurement."""
    return partial(sqlite3.connect, os.path.join(folder, os.urandom(8).hex() + ".db"), isolation_level=None,
                   timeout=60)


async def _store_cost(quick, place=None):
    """Milliseconds the store's saves take per round once history holds n rounds (the journal's own time), each n in
    a fresh database: place() gives a function that connects to one (a new SQLite file by default)."""
    figures, samples = {}, 5 if quick else 20
    with tempfile.TemporaryDirectory() as folder:
        for n in (10, 100) if quick else (10, 100, 1000):
            spent = []

            class Timed(SqlStore):
                def save(self, *args, **kwargs):
                    start = time.perf_counter()
                    try:
                        return super().save(*args, **kwargs)
                    finally:
                        spent.append(time.perf_counter() - start)

            with Timed((place or partial(_sqlite_place, folder))()) as store:
                rounds = n + samples
                tools = FunctionTools(_BENCH_FUNCTIONS)
                await run_agent(_batches("tick", 1), store=store, run_id="bench", fixtures=tools,
                                registry=_bench_registry(), accept=_accepts_nothing, limits=_roomy(rounds, rounds))
            per_round = [sum(spent[3 * r:3 * r + 3]) for r in range(n, rounds)]  # a round saves 3 times
            figures[str(n)] = _spread(per_round, 1e3)
    return figures


def _show_store_cost(number, figures, cell, where="SQLite, synchronous=FULL"):
    print(f"\n{number}. The store ({where}): milliseconds of saving per round once history holds n rounds")
    for n, spread in figures.items():
        print(f"   n={n:<5} per round {cell(**spread)}")


BENCH_POSTGRES = []  # a place() for bench's PostgreSQL figures: `python3 tests/servers.py bench` gives one


async def _tick_once(history):
    """The pool's trivial task: one instant call, then an answer."""
    return {"kind": "final", "answer": "ticked"} if history else {"kind": "calls", "calls": [call("t1", "tick", n=1)]}


def _accepts_anything(answer, history):
    return True


def _pool_worker(connect, ready, go):
    """One process of bench's pool: claim the next run, run it, repeat, until no run is left."""
    async def work():
        with SqlStore(connect) as store:
            ready.release()
            go.wait()
            while (run_id := store.claim_next()) is not None:
                await run_agent(_tick_once, store=store, run_id=run_id, fixtures=FunctionTools(_BENCH_FUNCTIONS),
                                registry=_bench_registry(), accept=_accepts_anything, limits=_roomy(2, 1))
    asyncio.run(work())


def _pool_rate(place, workers, runs):
    """Runs per second of `workers` processes sharing a fresh database of place() over `runs` runs."""
    connect = place()
    with SqlStore(connect) as store:
        for number in range(runs):
            store.add(f"run-{number:04}")
    spawn = multiprocessing.get_context("spawn")  # a process of its own, whatever the caller's threads and loop
    ready, go = spawn.Semaphore(0), spawn.Event()
    pool = [spawn.Process(target=_pool_worker, args=(connect, ready, go), daemon=True) for _ in range(workers)]
    try:
        for process in pool:
            process.start()
        if not all(ready.acquire(timeout=120) for _ in pool):
            raise RuntimeError("a worker of the pool did not start")
        start = time.perf_counter()  # every worker is up: what is timed is the runs, not the processes starting
        go.set()
        for process in pool:
            process.join(600)
        spent = time.perf_counter() - start
    finally:
        for process in pool:
            process.kill()
    with SqlStore(connect) as store:
        if store.unfinished():
            raise RuntimeError("the pool left runs unfinished")
    return runs / spent


async def _pool_throughput(quick):
    (repeats, runs), figures = (1, 24) if quick else (3, 96), {}
    with tempfile.TemporaryDirectory() as folder:
        places = {"SQLite": partial(_sqlite_place, folder), **({"PostgreSQL": BENCH_POSTGRES[0]} if BENCH_POSTGRES
                                                                else {})}
        for where, place in places.items():
            figures[where] = {str(k): _spread([_pool_rate(place, k, runs) for _ in range(repeats)]) for k in (1, 2, 4)}
    return figures


def _show_pool(number, figures, cell):
    print(f"\n{number}. A pool of worker processes sharing one database: runs per second of a trivial task (one "
          f"instant call, then the answer), by number of workers")
    for where, rows in figures.items():
        print(f"   {where:<10}  " + "  ".join(f"{k}: {cell(**spread)}" for k, spread in rows.items()))


async def _postgres_store_cost(quick):
    return await _store_cost(quick, BENCH_POSTGRES[0]) if BENCH_POSTGRES else None


def _show_postgres_store_cost(number, figures, cell):
    if figures is None:
        print(f"\n{number}. The store on PostgreSQL: not measured here (python3 tests/servers.py bench starts a "
              "server of its own, and measures it)")
        return
    _show_store_cost(number, figures, cell, "PostgreSQL, synchronous_commit=on")


BENCH_NAP = 0.02  # seconds each model of the runs side by side waits before it decides


async def _side_by_side(place=None, runs=50, rounds=4):
    """Milliseconds past BENCH_NAP that each model's wait took, while `runs` runs shared one loop (and one store of
    place(), if given: their saves go on meanwhile)."""
    late = []

    async def model(history):  # each round: a nap, then one instant call (the last round: an answer)
        start = asyncio.get_running_loop().time()
        await asyncio.sleep(BENCH_NAP)
        late.append(asyncio.get_running_loop().time() - start - BENCH_NAP)
        number = len(history)
        return {"kind": "final", "answer": "done"} if number == rounds - 1 else \
            {"kind": "calls", "calls": [call(f"t{number}", "tick", n=number)]}

    options = {"limits": _roomy(rounds, rounds), "fixtures": FunctionTools(_BENCH_FUNCTIONS),
               "registry": _bench_registry(), "accept": _accepts_anything}
    if place is None:
        await asyncio.gather(*(run_agent(model, **options) for _ in range(runs)))
    else:
        with SqlStore(place()) as store:
            await asyncio.gather(*(run_agent(model, store=store, run_id=f"r{n}", **options) for n in range(runs)))
    return _spread(late, 1e3)


async def _loop_waits(quick):
    """The runs side by side: alone in their loop, then sharing one SQLite store (and one PostgreSQL store, if
    BENCH_POSTGRES gives a place for it)."""
    with tempfile.TemporaryDirectory() as folder:
        figures = {"no store": await _side_by_side(), "SQLite": await _side_by_side(partial(_sqlite_place, folder))}
    if BENCH_POSTGRES:
        figures["PostgreSQL"] = await _side_by_side(BENCH_POSTGRES[0])
    return figures


def _show_loop_waits(number, figures, cell):
    print(f"\n{number}. 50 runs in one loop, each model waiting {BENCH_NAP * 1000:.0f} ms a round: milliseconds past "
          "the wait, alone and beside the others' saves to one store")
    for where, spread in figures.items():
        print(f"   {where:<10}  {cell(**spread)}")


async def _concurrency(quick):
    """Milliseconds a batch of 8 calls of BENCH_WAIT takes under each Limits.concurrency, and the ideal: the
    batch in ceil(8 / concurrency) waves."""
    figures = {}
    for concurrency in (1, 2, 4, 8):
        limits = dataclasses.replace(_roomy(1, 8), batch=8, concurrency=concurrency)
        walls = [(await _timed(_batches("wait", 8), limits))[0] for _ in range(3 if quick else 7)]
        figures[str(concurrency)] = {"wall_ms": _spread(walls, 1e3),
                                     "ideal_ms": math.ceil(8 / concurrency) * BENCH_WAIT * 1e3}
    return figures


def _show_concurrency(number, figures, cell):
    print(f"\n{number}. A batch of 8 calls of {BENCH_WAIT * 1000:.0f} ms under Limits.concurrency: milliseconds, "
          "beside the ideal (the batch in waves of that many)")
    for concurrency, row in figures.items():
        print(f"   concurrency={concurrency}  wall {cell(**row['wall_ms'])}   ideal {row['ideal_ms']:5.0f}")


async def _retry_cost(quick, runs=40, rounds=5):
    """Microseconds a retry costs the runtime beyond its backoff (here a nanosecond): a round whose call fails once
    and is tried again at once, against a round whose call answers at once."""
    spent = []
    for _ in range(3 if quick else 7):
        once = sum([(await _timed(_batches("tick", 1), _roomy(rounds, rounds)))[0] for _ in range(runs)])
        twice = sum([(await _timed(_batches("flaky", 1), _roomy(rounds, 2 * rounds), functions=_flaky_functions()))[0]
                     for _ in range(runs)])
        spent.append((twice - once) / (runs * rounds))
    return _spread(spent, 1e6)


def _show_retry_cost(number, spread, cell):
    print(f"\n{number}. A retry (ToolSpec.retries), beyond its backoff: microseconds per retry")
    print(f"   per retry      {cell(**spread)}")


_ROWS = {"type": "object", "properties": {"rows": {"type": "array", "items": {"type": "object", "properties": {
    "sku": {"type": "string", "enum": list(SKUS)}, "stock": {"type": "integer", "minimum": 0},
    "target": {"type": "integer", "minimum": 0}, "unit_cents": {"type": "integer", "minimum": 0}},
    "required": ["sku", "stock", "target", "unit_cents"], "additionalProperties": False}}},
    "required": ["rows"], "additionalProperties": False}  # the demo's rows, as a result_schema would say them


async def _result_check_cost(quick, runs=20, rounds=10):
    """Microseconds the result checks (PART 17) cost a call, each against the same call without it: the schema
    check of the demo's four rows, and measuring a result of 1 MB against a limit."""
    async def rows(n):
        return {"rows": DATA["north"] + DATA["south"]}

    async def big(n):
        return "x" * 1_000_000

    async def timed(name, spec, limit):
        registry, limits = {name: spec}, dataclasses.replace(_roomy(rounds, rounds), result_bytes=limit)
        start = time.perf_counter()
        await run_agent(_batches(name, 1), limits=limits, fixtures=FunctionTools({"rows": rows, "big": big}),
                        registry=registry, accept=_accepts_nothing)
        return time.perf_counter() - start

    plain = ToolSpec(0, True, True, validate=lambda args: True)
    figures = {"schema_us": [], "size_1mb_us": []}
    for _ in range(3 if quick else 7):
        for figure, name, checked, limit in (("schema_us", "rows", dataclasses.replace(plain, result_schema=_ROWS),
                                              None),
                                             ("size_1mb_us", "big", plain, 2_000_000)):
            count = runs // 10 if name == "big" else runs
            without = sum([await timed(name, plain, None) for _ in range(count)])
            within = sum([await timed(name, checked, limit) for _ in range(count)])
            figures[figure].append((within - without) / (count * rounds))
    return {figure: _spread(samples, 1e6) for figure, samples in figures.items()}


def _show_result_check_cost(number, figures, cell):
    print(f"\n{number}. The checks of a result (PART 17), beyond the same call without them: microseconds per call")
    print(f"   the demo's rows against a result_schema  {cell(**figures['schema_us'])}")
    print(f"   a result of 1 MB against result_bytes    {cell(**figures['size_1mb_us'])}")


# The figures beyond the first four, each (name, async measure(quick) -> figures, show(number, figures, cell)).
BENCH_PARTS = (("concurrency_ms", _concurrency, _show_concurrency), ("retry_us", _retry_cost, _show_retry_cost),
               ("result_checks_us", _result_check_cost, _show_result_check_cost),
               ("store_ms", _store_cost, _show_store_cost),
               ("postgres_store_ms", _postgres_store_cost, _show_postgres_store_cost),
               ("pool_runs_per_second", _pool_throughput, _show_pool),
               ("loop_waits_ms", _loop_waits, _show_loop_waits))


async def bench(quick=False, as_json=False):
    """Measure parallel efficiency, the runtime's overhead, time-limit overshoot and growth; print the figures."""
    repeats = 3 if quick else 7
    figures = {
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "repeats": repeats,
        "parallel_efficiency": await _parallel_efficiency(repeats),
        "overhead": await _overhead(repeats),
        "limit_overshoot": await _limit_overshoot(5 if quick else 20),
        "growth": await _growth((10, 100) if quick else (10, 100, 1000)),
    }
    for name, measure, _ in BENCH_PARTS:
        figures[name] = await measure(quick)
    if as_json:
        print(json.dumps(figures, ensure_ascii=False, indent=2))
        return
    cell = "{median:8.3f} [{min:.3f} .. {max:.3f}]".format
    print(f"agent_loop bench: Python {figures['python']}, {figures['cores']} cores; median [min .. max] over repeats")
    wait = f"{BENCH_WAIT * 1000:.0f} ms"
    print(f"\n1. Parallel efficiency: k tools each waiting {wait}, batch wall time / {wait}"
          f" ({repeats} repeats; the limits are 1 and k)")
    for k, modes in figures["parallel_efficiency"].items():
        print(f"   k={k}  parallel {cell(**modes['parallel'])}   serial {cell(**modes['serial'])}")
    print(f"\n2. Runtime overhead, instant model and tools, microseconds ({repeats} repeats)")
    print(f"   per round      {cell(**figures['overhead']['round_us'])}")
    print(f"   per tool call  {cell(**figures['overhead']['call_us'])}")
    runs = 5 if quick else 20
    print(f"\n3. Time limits: milliseconds past the limit ({runs} runs)")
    print(f"   a hanging tool stopped after tool_seconds   {cell(**figures['limit_overshoot']['tool_ms'])}")
    print(f"   run_agent returned after total_seconds      {cell(**figures['limit_overshoot']['total_ms'])}")
    print("\n4. Growth: milliseconds per round once history holds n rounds, beside the copy floor (the cheapest exact "
          "copy of that history, which each round makes for the model)")
    for n, row in figures["growth"].items():
        ratio = row["round_ms"]["median"] / row["copy_ms"]["median"]
        print(f"   n={n:<5} per round {cell(**row['round_ms'])}   copy {cell(**row['copy_ms'])}   ratio {ratio:.2f}")
    for number, (name, _, show) in enumerate(BENCH_PARTS, 5):
        show(number, figures[name], cell)


def _bench_options(parser):
    parser.add_argument("--quick", action="store_true", help="fewer repeats: a smoke run of a few seconds")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def main(argv=None):
    """Measure and print the figures: 0, or 1 with one line on standard error."""
    parser = argparse.ArgumentParser(description="Measure parallel batches, overhead, time limits, growth, the store "
                                                 "and the pool.")
    _bench_options(parser)
    return run_command(parser, lambda args, parser: bench(args.quick, args.json), parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
