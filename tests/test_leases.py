"""PART 11: leases and stores on SQLite: what only SQLite does.
"""

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys

import agent_loop
from agent_loop import Fixtures, run_agent
from test_agent_loop import ROOMY, SLOW_ROOMY, wait_until
from tests.support import LeaseCase


class SqliteLeaseTests(LeaseCase):
    """PART 11 on SQLite alone: its one lock, and what a store says of a file it cannot use."""

    async def test_a_sqlite_worker_frozen_in_a_transaction_holds_the_writers_and_the_pool_goes_on(self):
        busy = self.store(lease_seconds=1.0)
        busy.db.execute("PRAGMA busy_timeout = 300")  # a save waits 0.3 s for the lock, then fails
        held, running = Fixtures(delays={"north": 30}), None
        busy.add("queued")
        running = asyncio.create_task(run_agent(store=busy, run_id="healthy", fixtures=held, limits=SLOW_ROOMY))
        await wait_until(lambda: held.started)
        worker, _ = self.frozen("job")
        self.assertIsNone(await asyncio.to_thread(busy.claim_next))  # busy: None, not an exception
        running.cancel()  # (the healthy run's save would wait out the lock: it stops store_failed, as a save must)
        await asyncio.gather(running, return_exceptions=True)
        self.assertIsNone(await asyncio.to_thread(busy.claim_next))
        worker.kill()  # it dies: its lock goes with it
        worker.wait(timeout=60)
        claimed = []
        await wait_until(lambda: claimed.append(busy.claim_next()) or claimed[-1] in ("job", "queued"), 30)

    def test_a_connection_made_for_this_thread_is_refused_for_that_reason_and_taken_made_for_any(self):
        ways = [dict(isolation_level=None)] + ([dict(autocommit=True)] if sys.version_info >= (3, 12) else [])
        for way in ways:
            with self.subTest(way=way):
                with contextlib.closing(sqlite3.connect(self.where, **way)) as mine:
                    with self.assertRaises(ValueError) as refused:
                        agent_loop.SqlStore(mine)
                self.assertEqual(str(refused.exception), "the connection must be usable from the store's thread: "
                                 "sqlite3.connect(..., check_same_thread=False), or a function")
                with contextlib.closing(sqlite3.connect(self.where, check_same_thread=False, **way)) as any_thread:
                    with agent_loop.SqlStore(any_thread) as store:
                        store.add("r")
                        self.assertEqual(store.unfinished(), ["r"])

    def test_a_store_that_cannot_be_written_says_busy_or_read_only_and_a_file_not_a_store_or_of_another_version(self):
        self.store().close()  # a store, made
        holder = sqlite3.connect(self.where, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        with self.assertRaises(ValueError) as busy:
            agent_loop.SqlStore(lambda: sqlite3.connect(self.where, isolation_level=None, timeout=0.2))
        holder.execute("ROLLBACK")
        holder.close()
        with self.assertRaises(ValueError) as read_only:
            agent_loop.SqlStore(lambda: sqlite3.connect(f"file:{self.where}?mode=ro", uri=True, isolation_level=None))
        text = os.path.join(self.folder, "notes.txt")
        with open(text, "w") as file:
            file.write("not a database\n" * 100)
        with self.assertRaises(ValueError) as not_a_store:
            agent_loop.SqlStore(lambda: sqlite3.connect(text, isolation_level=None))
        with contextlib.closing(sqlite3.connect(self.where)) as db:
            db.execute("UPDATE agent_loop_meta SET value = '0' WHERE key = 'version'")
            db.commit()
        with self.assertRaises(ValueError) as other:
            agent_loop.SqlStore(self.connect)
        self.assertEqual([str(error.exception) for error in (busy, read_only, not_a_store, other)],
                         ["the database: busy: another connection holds its lock",
                          "the database: read-only: a store must write", "the database: not a store",
                          "the database: a store of another version"])

    def test_cancel_run_of_a_crashed_run_edited_by_hand_is_a_value_error_and_changes_nothing(self):
        now = [1.0]
        store = self.store(clock=lambda: now[0])
        state = {**agent_loop._NOTHING_SAVED, "used": {"rounds": 1, "calls": 0, "credits": 3}}
        cut = {"round": 1, "calls": [{"call_id": "a", "name": "t", "arguments": {}}], "observations": []}
        edits = [(None, None), ("config", '{"registry": {"t": 5}}'), ("config", '{"registry": {"t": ["x"]}}'),
                 ("state", "[]"), ("state", '{"used": {"rounds": "1"}}'), ("record", "[]"),
                 ("record", '{"round": 1, "calls": [{"call_id": "a"}], "observations": []}'), ("event", "{")]
        for number, (column, text) in enumerate(edits):
            run_id = f"r{number}"
            now[0] = 1.0
            store.save(run_id, store.claim(run_id, '{"registry": {"t": [2]}}', 0.0), state, [cut], [])  # then a crash
            with contextlib.closing(sqlite3.connect(self.where)) as db, db:
                if column == "record":
                    db.execute("UPDATE agent_loop_records SET body = ? WHERE run_id = ?", (text, run_id))
                elif column == "event":
                    db.execute("INSERT INTO agent_loop_events VALUES (?, 1, ?)", (run_id, text))
                elif column:
                    db.execute(f"UPDATE agent_loop_runs SET {column} = ? WHERE run_id = ?", (text, run_id))
            now[0] = 100.0  # its lease ran out
            if column is None:  # as saved: cancelled at once, its cut call charged
                self.assertEqual(store.cancel_run(run_id), "cancelled")
                self.assertEqual(store.load(run_id)["state"]["used"], {"rounds": 1, "calls": 1, "credits": 5})
                continue
            with self.subTest(column=column, text=text), self.assertRaises(ValueError) as refused:
                store.cancel_run(run_id)
            self.assertEqual(str(refused.exception), f"{run_id}: what the store holds for it is not a run this "
                                                     "version saved")
            with contextlib.closing(sqlite3.connect(self.where)) as db:  # nothing changed: it has not ended
                status = db.execute("SELECT status FROM agent_loop_runs WHERE run_id = ?", (run_id,)).fetchall()
            self.assertEqual(status, [(None,)])

    def test_a_store_on_a_read_only_mount_is_called_read_only_not_a_file_that_is_no_store(self):
        mount = os.path.join(self.folder, "mount")
        os.mkdir(mount)
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mount],
                                               capture_output=True).returncode:
            self.skipTest("mounting a file system read-only needs root, and mount")
        self.addCleanup(subprocess.run, ["umount", "-l", mount], capture_output=True)
        path = os.path.join(mount, "runs.db")
        with agent_loop.SqliteStore(path) as store:
            store.add("job")  # a good store, closed: its write-ahead log's index goes with it
        subprocess.run(["mount", "-o", "remount,ro", mount], check=True, capture_output=True)
        refused = []
        for opening in (lambda: agent_loop.SqliteStore(path),
                        lambda: agent_loop.SqlStore(lambda: sqlite3.connect(path, isolation_level=None))):
            with self.assertRaises(ValueError) as raised:
                opening()
            refused.append(str(raised.exception))
        self.assertEqual(refused, [f"{path}: read-only: a store must write",
                                   "the database: read-only: a store must write"])

    async def test_both_forms_of_sqlite3s_autocommit_are_connections_the_store_works_on(self):
        forms = [dict(isolation_level=None)] + [dict(autocommit=True)] * (sys.version_info >= (3, 12))  # (new in 3.12)
        for number, form in enumerate(forms):
            with self.subTest(form=form):
                store = agent_loop.SqlStore(lambda: sqlite3.connect(self.where, check_same_thread=False, **form))
                self.addCleanup(store.close)
                result = await run_agent(store=store, run_id=f"job-{number}", limits=ROOMY)
                self.assertEqual(result["status"], "completed")
