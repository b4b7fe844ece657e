"""The README: what it shows is what the module does.
"""

import asyncio
import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import sqlite3
import tempfile

import agent_loop
from agent_loop import Fixtures, Limits, run_agent
from test_agent_loop import code_blocks, HERE, readme_section, RuntimeTestCase
from examples.scenarios import run_scenario


# The README's examples, and the result-ownership experiment (result_ownership.py, verify_ownership.py,
# expected.json)


class ReadmeTests(RuntimeTestCase):
    """The README: its shapes of a run come from real runs, and its code blocks run as written."""

    async def test_the_shapes_are_those_of_real_runs(self):
        retry = await run_agent(fixtures=Fixtures(failures={"north": ["temporary"]}))
        scenario, _ = await run_scenario("invalid_arguments")
        blocks = [json.loads(block) for block in code_blocks(readme_section("How a run ends"), "json")]
        self.assertEqual(blocks, [retry["history"][0], scenario])

    async def test_the_usage_shown_is_that_of_the_atlas_run(self):
        (shown,) = code_blocks(readme_section("What a run costs its model"), "json")
        result, _ = await run_scenario("token_limit")
        self.assertEqual(json.loads(shown), result["usage"])

    def test_the_size_table_is_counted_from_the_modules_banners(self):
        with open(os.path.join(HERE, "agent_loop.py"), encoding="utf-8") as file:
            lines = file.read().splitlines()
        starts = {int(m[1]): i for i, line in enumerate(lines) if (m := re.match(r"# PART (\d+):", line))}
        above, whole = [], []
        for n in range(1, 6):
            tail = next(i for i in range(starts[n], starts[n + 1]) if lines[i].startswith(f"# PART {n}, hard cases: "))
            above.append(tail - starts[n])
            whole.append(starts[n + 1] - starts[n])
        table = readme_section("The five parts, beside the article")
        shown = {row[0]: [int(cell.replace(",", "")) for cell in row[1:]]
                 for row in re.findall(r"^\| ([^|]+?) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| "
                                       r"([\d,]+) \|$", table, re.M)}
        self.assertEqual(shown, {"the article": [73, 83, 53, 123, 14, 346], "here, above the tail": [*above, sum(above)],
                                 "here, with the tail": [*whole, sum(whole)]})
        self.assertEqual(sum(whole), starts[6] - starts[1])

    def test_the_limits_table_gives_every_field_and_its_default(self):
        rows = re.findall(r"^\| `(\w+)` \| ([\d.]+|None) \|", readme_section("Copy it into your own prototype"), re.M)
        self.assertEqual([(name, None if default == "None" else float(default)) for name, default in rows],
                         [(field.name, field.default if field.default is None else float(field.default))
                          for field in dataclasses.fields(Limits)])

    async def test_the_pools_worker_goes_on_past_a_busy_database_and_the_loop_goes_on_while_it_asks(self):
        (example,) = code_blocks(readme_section("Many workers, one database"), "python")
        folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, folder)
        where = os.path.join(folder, "runs.db")
        with agent_loop.SqliteStore(where) as store:
            store.add("a")
            store.add("b")
        holder = sqlite3.connect(where, isolation_level=None, check_same_thread=False)
        self.addCleanup(holder.close)
        ticks, answers = [0], []

        class SqlStore(agent_loop.SqlStore):  # the README's, watched: each claim's answer, and if the loop went on
            def claim_next(self):
                if not answers:
                    holder.execute("BEGIN IMMEDIATE")  # another writer, before the first claim: the database is busy
                before = ticks[0]
                answer = super().claim_next()
                answers.append((answer, ticks[0] > before))
                if holder.in_transaction:
                    holder.execute("ROLLBACK")  # the busy spell ends once a claim has met it
                return answer

        async def tick():
            while True:
                ticks[0] += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        namespace = {"SqlStore": SqlStore, "run_agent": run_agent, "asyncio": asyncio}
        exec(compile(example, "README.md", "exec"), namespace)
        connect = lambda: sqlite3.connect(where, isolation_level=None, timeout=0.5, check_same_thread=False)
        await namespace["worker"](connect, agent_loop.fake_model, Fixtures(delays={}), None)
        ticker.cancel()
        self.assertEqual(answers[0], (None, True))  # busy: None, and the loop ticked while the claim waited
        with agent_loop.SqliteStore(where) as store:
            self.assertEqual([store.load(run_id)["status"] for run_id in "ab"], ["completed", "completed"])

    async def test_the_pools_worker_sets_aside_a_run_it_cannot_take_runs_the_next_and_ends(self):
        (example,) = code_blocks(readme_section("Many workers, one database"), "python")
        namespace = {"SqlStore": agent_loop.SqlStore, "run_agent": run_agent, "asyncio": asyncio}
        exec(compile(example, "README.md", "exec"), namespace)
        folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, folder)
        where = os.path.join(folder, "runs.db")
        connect = lambda: sqlite3.connect(where, isolation_level=None, timeout=5, check_same_thread=False)  # noqa: E731
        started = asyncio.Event()

        async def cut(history):  # an old deploy's run, under other limits, cut as it asks for its second decision
            if history:
                started.set()
                await asyncio.sleep(600)
            return await agent_loop.fake_model(history)

        with agent_loop.SqlStore(connect) as store:
            store.add("old")
            store.add("new")
            old = asyncio.create_task(run_agent(cut, store=store, run_id="old", limits=Limits(rounds=5)))
            await started.wait()
            old.cancel()
            await asyncio.gather(old, return_exceptions=True)
            self.assertEqual(store.runnable(), ["old", "new"])
        await asyncio.wait_for(namespace["worker"](connect, agent_loop.fake_model, Fixtures(delays={}), None), 60)
        with agent_loop.SqlStore(connect) as store:  # it went on past the old run, and ended: none left it can run
            self.assertEqual((store.load("new")["status"], store.load("old")["status"]), ("completed", None))
            self.assertEqual((store.runnable(), store.unfinished()), ([], ["old"]))
            (line,) = store.overview()["runs"][:1]
            self.assertEqual((line["run_id"], line["waits"]), ("old", "aside"))
            store.add("later")
        with self.assertRaises(ValueError) as raised:  # a mistake of yours stops it, and leaves the run as it was
            await asyncio.wait_for(namespace["worker"](connect, "not a model", Fixtures(delays={}), None), 60)
        self.assertEqual(str(raised.exception), "model must be an async function of history")
        with agent_loop.SqlStore(connect) as store:
            self.assertEqual(store.runnable(), ["later"])

    async def test_the_pools_worker_goes_on_past_a_database_busy_as_it_claims_a_run(self):
        (example,) = code_blocks(readme_section("Many workers, one database"), "python")
        folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, folder)
        where = os.path.join(folder, "runs.db")
        with agent_loop.SqliteStore(where) as store:
            store.add("a")
            store.add("b")
        holder = sqlite3.connect(where, isolation_level=None, check_same_thread=False)
        self.addCleanup(holder.close)
        claims = []

        class SqlStore(agent_loop.SqlStore):  # another writer holds the database as the first run is claimed
            def claim(self, run_id, config, started):
                claims.append(run_id)
                if len(claims) == 1:
                    holder.execute("BEGIN IMMEDIATE")
                try:
                    return super().claim(run_id, config, started)
                finally:
                    if holder.in_transaction:
                        holder.execute("ROLLBACK")

        namespace = {"SqlStore": SqlStore, "run_agent": run_agent, "asyncio": asyncio}
        exec(compile(example, "README.md", "exec"), namespace)
        connect = lambda: sqlite3.connect(where, isolation_level=None, timeout=0.2, check_same_thread=False)  # noqa
        await asyncio.wait_for(namespace["worker"](connect, agent_loop.fake_model, Fixtures(delays={}), None), 60)
        with agent_loop.SqliteStore(where) as store:  # the first claim failed: that run went back, and ran later
            self.assertEqual([store.load(run_id)["status"] for run_id in "ab"], ["completed", "completed"])
        self.assertEqual(claims[:1], ["a"])
        self.assertEqual(sorted(claims), ["a", "a", "b"])

    def test_the_own_prototype_example_runs_as_written(self):
        example = [block for block in code_blocks(readme_section("Copy it into your own prototype"), "python")
                   if "def check(answer, history)" in block]
        self.assertEqual(len(example), 1)
        printed = re.search(r"print\(.*\)  # (.*)", example[0]).group(1)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            exec(compile(example[0], "README.md", "exec"), {"__name__": "readme_example"})
        self.assertEqual(out.getvalue(), printed + "\n")
