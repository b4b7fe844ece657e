"""python3 agent_loop.py store: a store's runs and jobs, and a run's events as they are saved.
"""

import asyncio
import json
import os
import subprocess
import sys

import agent_loop
from agent_loop import call, Limits, run_agent, scripted, ToolSpec
from test_agent_loop import any_answer, calls, final, HERE, ROOMY, run_command, run_commands
from tests.support import JOB_X, LeaseCase


# PART 17: see a store

class SeeStoreTests(LeaseCase):
    """PART 17: python3 agent_loop.py store PATH: a SQLite store's runs and jobs, a line each; a run followed."""

    def test_the_store_is_read_never_written_and_a_writer_holding_it_does_not_stop_the_reader(self):
        empty = os.path.join(self.folder, "empty.db")
        open(empty, "w").close()
        done = run_command("store", empty)
        self.assertEqual((done.returncode, done.stderr.splitlines()[-1].endswith(": not a store"),
                          os.path.getsize(empty)), (2, True, 0))
        store = self.store()
        store.add("r")
        writer = self.connect()
        writer.execute("BEGIN IMMEDIATE")  # another connection writes meanwhile
        try:
            listed = run_command("store", self.where)
        finally:
            writer.execute("ROLLBACK")
            writer.close()
        self.assertEqual((listed.returncode, listed.stdout.split()[:3]), (0, ["run", "r", "queued"]))

    def test_the_path_is_a_files_name_whatever_its_characters_never_part_of_a_uri(self):
        names = ["q?x.db", "h#x.db", "p%41x.db", "a b.db"]
        for name in names:
            with agent_loop.SqliteStore(os.path.join(self.folder, name)) as store:
                store.add("r")
        made = sorted(name for name in os.listdir(self.folder) if not name.endswith(("-shm", "-wal")))
        paths = [os.path.join(self.folder, name) for name in names]
        paths.append("/" + os.path.abspath(paths[0]))  # a path that starts with //: the same file
        for path, done in zip(paths, run_commands(*[("store", path) for path in paths])):
            with self.subTest(path=path):
                self.assertEqual((done.returncode, done.stderr, done.stdout.split()[:3]), (0, "", ["run", "r", "queued"]))
        self.assertEqual(sorted(name for name in os.listdir(self.folder) if not name.endswith(("-shm", "-wal"))), made)

    async def test_a_follower_goes_on_past_a_pause_until_the_run_has_ended(self):
        class Hangs:
            async def invoke(self, call):
                await asyncio.sleep(10)  # the run's deadline cuts the write: its outcome unknown, the run pauses

            async def reconcile(self, call):
                return self.said

        store, tools = self.store(), Hangs()
        store.add("r")
        follower = subprocess.Popen(["python3" if False else sys.executable, os.path.join(HERE, "agent_loop.py"),
                                     "store", self.where, "--follow", "r"], stdout=subprocess.PIPE, text=True)
        self.addCleanup(follower.kill)
        options = dict(registry={"wr": ToolSpec(1, False, False, parameters=JOB_X)}, accept=any_answer,
                       fixtures=tools, store=store, run_id="r", limits=Limits(tool_seconds=5, total_seconds=0.5))
        tools.said = None
        paused = await run_agent(scripted(calls(call("w", "wr", x=1)), final("done")), approve=lambda w: "approve",
                                 **options)
        self.assertEqual((paused["status"], "unknown" in paused), ("deadline", True))
        await asyncio.sleep(0.5)
        self.assertIsNone(follower.poll())  # a pause: it follows on
        tools.said = {"applied": True, "data": {"placed": 1}}
        ended = await run_agent(scripted(calls(call("w", "wr", x=1)), final("done")), **options)
        out, _ = follower.communicate(timeout=60)
        self.assertEqual([json.loads(line) for line in out.splitlines()], ended["trace"])

    def test_see_a_store_lists_runs_and_jobs_and_follows_a_run(self):
        store = self.store()
        store.add("queued")
        asyncio.run(run_agent(store=store, run_id="done", limits=ROOMY))
        store.submit("ana", "k", "export", {"month": "2026-08"})
        listed, followed = run_commands(["store", self.where], ["store", self.where, "--follow", "done"])
        self.assertEqual((listed.returncode, listed.stderr), (0, ""))
        lines = listed.stdout.splitlines()
        self.assertRegex(lines[0], r"^run queued +queued +generation 0 +round 0, 0 calls, 0 credits  -$")
        self.assertRegex(lines[1], r"^run done +completed +generation 1 +round 3, 3 calls, 17 credits  -$")
        self.assertRegex(lines[2], r"^job 1 +queued +attempt 0 +0/0  -  ana: export$")
        self.assertEqual([json.loads(line) for line in followed.stdout.splitlines()], store.load("done")["trace"])
        missing = run_command("store", os.path.join(self.folder, "none.db"))
        self.assertEqual((missing.returncode, missing.stderr.splitlines()[-1].endswith(": no such file")), (2, True))

    def test_following_a_run_the_store_does_not_have_says_so_and_fails_and_an_added_one_is_followed(self):
        store = self.store()
        store.add("added")  # a run, not started yet
        absent = run_command("store", self.where, "--follow", "nobody")
        self.assertEqual((absent.returncode, absent.stdout, absent.stderr.splitlines()[-1]),
                         (2, "", f"agent_loop.py: error: {self.where}: no run 'nobody'"))
        follower = subprocess.Popen([sys.executable, os.path.join(HERE, "agent_loop.py"), "store", self.where,
                                     "--follow", "added"], stdout=subprocess.PIPE, text=True)
        self.addCleanup(follower.kill)
        self.assertEqual(store.cancel_run("added", by="ops"), "cancelled")
        out, _ = follower.communicate(timeout=60)
        self.assertEqual((follower.returncode, [json.loads(line)["by"] for line in out.splitlines()]), (0, ["ops"]))
