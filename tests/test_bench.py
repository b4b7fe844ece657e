"""The benchmark: its figures are checked for sanity, never for speed.
"""

import asyncio
import json
import math
import os
import platform
import subprocess
import sys
import unittest
import unittest.mock

import agent_loop
from test_agent_loop import HERE, run_command
from benchmarks import bench
from benchmarks.bench import _growth, _store_cost, BENCH_PARTS


QUICK_BENCH = {}  # the quick bench's run, started when the whole suite loads: it is mostly waits


def start_the_quick_bench():
    flags = ["-O"] if sys.flags.optimize else []
    command = [sys.executable, *flags, os.path.join(HERE, "benchmarks", "bench.py"), "--quick", "--json"]
    QUICK_BENCH["process"] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def load_tests(loader, tests, pattern):
    """The whole suite, loaded: start the quick bench now, so that it overlaps the others (it is mostly waits)."""
    if not QUICK_BENCH:
        start_the_quick_bench()
    return tests


# The benchmark: what parallel batches and bounded waits buy, and what the runtime costs

class BenchTests(unittest.TestCase):
    """The benchmark: its figures are checked for sanity, never for speed."""

    def test_help_lists_the_commands_of_the_whole_module(self):
        done = run_command("--help")
        self.assertEqual((done.returncode, list(agent_loop.every_command())), (0, ["demo", "store"]))
        for command in agent_loop.every_command():
            self.assertIn(f"    {command} ", done.stdout)

    def test_the_quick_bench_prints_every_figure_positive_and_finite(self):
        if not QUICK_BENCH:  # this test run alone, by name
            start_the_quick_bench()
        stdout, stderr = QUICK_BENCH["process"].communicate(timeout=600)
        self.assertEqual((QUICK_BENCH["process"].returncode, stderr), (0, ""))
        figures = json.loads(stdout)
        self.assertEqual(list(figures)[:7], ["python", "cores", "repeats", "parallel_efficiency", "overhead",
                                             "limit_overshoot", "growth"])  # then what later parts measure
        self.assertEqual(list(figures)[7:], [name for name, _, _ in BENCH_PARTS])
        self.assertEqual(figures["python"], platform.python_version())
        self.assertEqual(sorted(figures["parallel_efficiency"]), ["1", "2", "4"])
        self.assertEqual(sorted(figures["overhead"]), ["call_us", "round_us"])
        self.assertEqual(sorted(figures["limit_overshoot"]), ["tool_ms", "total_ms"])
        durations = [spread for modes in figures["parallel_efficiency"].values() for spread in modes.values()]
        durations += [figures["overhead"]["round_us"]]
        durations += [spread for row in figures["growth"].values() for spread in row.values()]
        # Differences of two times (a further call, the time past a limit) may come out below zero on a busy machine.
        differences = [figures["overhead"]["call_us"], *figures["limit_overshoot"].values()]
        self.assertEqual(len(durations + differences), 6 + 2 + 2 + 2 * len(figures["growth"]))
        pool, saving = figures["pool_runs_per_second"], figures["store_ms"]
        self.assertEqual(({where: sorted(rows) for where, rows in pool.items()}, sorted(saving)),
                         ({"SQLite": ["1", "2", "4"]}, ["10", "100"]))
        self.assertIsNone(figures["postgres_store_ms"])  # measured by python3 tests/servers.py bench
        durations += [*pool["SQLite"].values(), *saving.values()]
        for positive, spreads in ((True, durations), (False, differences)):
            for spread in spreads:
                self.assertEqual(sorted(spread), ["max", "median", "min"])
                self.assertTrue(all(math.isfinite(value) for value in spread.values()), spread)
                self.assertTrue(spread["min"] > 0 or not positive, spread)
                self.assertLessEqual(spread["min"], spread["median"])
                self.assertLessEqual(spread["median"], spread["max"])
        # Physical floors, not speeds: k waits of 50 ms one after another take at least k x 50 ms; side by side, 50 ms.
        for k, modes in figures["parallel_efficiency"].items():
            with self.subTest(k=k):
                self.assertGreaterEqual(modes["serial"]["min"], int(k) * 0.999)
                self.assertGreaterEqual(modes["parallel"]["min"], 0.999)
        # Under a cap of c calls in flight, 8 waits of 50 ms take at least ceil(8 / c) of them, one after another.
        waves = figures["concurrency_ms"]
        self.assertEqual({c: row["ideal_ms"] for c, row in waves.items()}, {"1": 400, "2": 200, "4": 100, "8": 50})
        for c, row in waves.items():
            with self.subTest(concurrency=c):
                self.assertGreaterEqual(row["wall_ms"]["min"], row["ideal_ms"] * 0.999)
        self.assertTrue(all(math.isfinite(value) for value in figures["retry_us"].values()))

    def test_the_bench_measures_the_stores_cost_per_round_at_each_length(self):
        figures = asyncio.run(_store_cost(quick=True))
        self.assertEqual(list(figures), ["10", "100"])
        for spread in figures.values():  # a time, not a speed: positive and finite, in order
            self.assertTrue(0 < spread["min"] <= spread["median"] <= spread["max"] < math.inf, spread)

    def test_growth_is_measured_beside_the_copy_floor_of_the_same_history(self):
        copied = []
        real_copy = agent_loop._copy

        def spy(value, *args):
            if type(value) is list and len(value) == 10 and all(type(record) is dict and "round" in record
                                                                for record in value):
                copied.append(len(value))
            return real_copy(value, *args)

        with unittest.mock.patch.object(agent_loop, "_copy", spy), unittest.mock.patch.object(bench, "_copy", spy):
            figures = asyncio.run(_growth((10,), samples=3))
        self.assertEqual(copied, [10] * 4)  # the model's copy in round 11, then the floor's three
        self.assertEqual(sorted(figures["10"]), ["copy_ms", "round_ms"])
