"""PART 10: a named run saved in SQLite, resumed after a crash with nothing refunded; a crash is a real one, a child
process killed with SIGKILL.
"""

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest
import unittest.mock

import agent_loop
from agent_loop import call, fake_model, Fixtures, Limits, run_agent, scripted, TOOLS, ToolSpec
from test_agent_loop import calls, code_blocks, errors, final, HERE, never_accept, readme_section, ROOMY, wait_until
from tests.support import dict_store, run_in_a_process, store_result, StoreTestCase
from examples.orders import order_accepted, order_model, ORDER_TOOLS, OrderDesk


class SavedRunTests(StoreTestCase):
    """PART 10: a named run, saved in SQLite at each step that spends, resumed where it stopped after a crash."""

    def folder(self):
        folder = tempfile.mkdtemp(prefix="agent_loop_store_")
        self.addCleanup(shutil.rmtree, folder, True)
        return folder

    async def test_a_named_run_is_saved_and_once_ended_returns_its_stored_result_asking_nothing(self):
        store = self.store()
        first = await run_agent(store=store, run_id="job-42", limits=ROOMY)
        self.assertEqual((first["status"], first["run_id"], first["trace"][-1]["run_id"]), ("completed", "job-42", "job-42"))
        asked, fixtures = [], Fixtures()
        again = await run_agent(scripted(asked.append), store=store, run_id="job-42", fixtures=fixtures, limits=ROOMY)
        self.assertEqual((again, asked, fixtures.started, store.unfinished()), (first, [], [], []))
        plain = await run_agent(limits=ROOMY)  # without a store nothing changes: the same run, no run_id
        self.assertEqual(plain, {key: value for key, value in first.items() if key != "run_id"} | {
            "trace": [{key: value for key, value in event.items() if key != "run_id"} for event in first["trace"]]})

    async def test_a_run_without_a_store_meets_no_journal_and_one_with_a_store_meets_its_seams(self):
        seen = collections.Counter()
        real = {name: getattr(agent_loop._Journal, name) for name in ("resume", "spent", "gate", "end")}

        def spy(name):
            async def seam(journal, run, *args):
                seen[name] += 1
                return await real[name](journal, run, *args)
            return seam

        with unittest.mock.patch.multiple(agent_loop._Journal, **{name: spy(name) for name in real}):
            plain = await run_agent(limits=ROOMY)
            self.assertEqual((plain["status"], sum(seen.values())), ("completed", 0))  # the core ran it all itself
            named = await run_agent(store=self.store(), run_id="job", limits=ROOMY)
        self.assertEqual(named["status"], "completed")
        # Once to resume, a save per step that spends (3 decisions paid, 2 batches admitted, 1 serial call, 2 batches
        # observed), the gate before each batch, the end.
        self.assertEqual(seen, {"resume": 1, "spent": 8, "gate": 2, "end": 1})

    async def test_whatever_a_store_of_yours_raises_stops_the_run_store_failed_by_its_class(self):
        class Interrupted(BaseException):
            pass

        for raised in (RuntimeError("private"), Interrupted("private"), asyncio.CancelledError("private"),
                       KeyboardInterrupt()):
            with self.subTest(raised=type(raised).__name__):
                store = dict_store()
                save = store.save

                def failing(*args, raised=raised, save=save):
                    if args[3]:  # once it has records: the first batch admitted
                        raise raised
                    return save(*args)

                store.save = failing
                result = await run_agent(store=store, run_id="job", limits=ROOMY)
                self.assertEqual((result["status"], result["trace"][-1]["error_type"]),
                                 ("store_failed", type(raised).__name__))
                self.assertNoPrivateText(result)
        store, asked = dict_store(), []
        store.load = lambda run_id: (_ for _ in ()).throw(ValueError("private"))  # not your mistake: the run's end
        result = await run_agent(scripted(asked.append), store=store, run_id="job", limits=ROOMY)
        self.assertEqual((result["status"], result["trace"][-1]["error_type"], asked), ("store_failed", "ValueError",
                                                                                       []))
        self.assertNoPrivateText(result)
        for path in (None, 5):
            with self.subTest(path=path), self.assertRaises(ValueError) as raised:
                agent_loop.SqliteStore(path)
            self.assertEqual(str(raised.exception), 'path must be the path of a file, or ":memory:"')

    async def test_a_run_whose_config_was_erased_by_hand_is_not_taken_for_a_new_one(self):
        store = self.store()
        paused = await run_agent(order_model, registry=ORDER_TOOLS, fixtures=OrderDesk(),
                                 accept=order_accepted, store=store, run_id="job", approve=lambda w: "ask",
                                 limits=ROOMY)
        self.assertEqual(paused["status"], "awaiting_approval")
        store.db.execute("UPDATE agent_loop_runs SET config = NULL")
        await self.assertRefusedBeforeTheModelIsAsked("job: what the store holds for it is not a run this version saved",
                                                      store=store, run_id="job")

    async def test_a_store_needs_a_run_id_of_1_to_80_printable_characters_refused_before_the_model_is_asked(self):
        store = self.store()
        cases = [({"store": store}, "run_id must be a string of 1 to 80 printable characters"),
                 ({"store": store, "run_id": ""}, "run_id must be a string of 1 to 80 printable characters"),
                 ({"store": store, "run_id": "x" * 81}, "run_id must be a string of 1 to 80 printable characters"),
                 ({"store": store, "run_id": "a\nb"}, "run_id must be a string of 1 to 80 printable characters"),
                 ({"store": store, "run_id": 42}, "run_id must be a string of 1 to 80 printable characters"),
                 ({"run_id": "job"}, "run_id names a run in a store: give the store too"),
                 ({"store": object(), "run_id": "job"}, "store must be a store, such as a SqliteStore")]
        for options, message in cases:
            with self.subTest(options=options):
                await self.assertRefusedBeforeTheModelIsAsked(message, **options)
        self.assertEqual(store.unfinished(), [])

    async def test_what_is_not_a_run_this_store_can_resume_is_refused_and_nothing_is_claimed(self):
        folder = self.folder()
        text = os.path.join(folder, "notes.txt")
        with open(text, "w") as file:
            file.write("not a database\n" * 100)
        other = os.path.join(folder, "other.db")
        with contextlib.closing(sqlite3.connect(other)) as db:
            db.execute("CREATE TABLE orders (id INTEGER)")
            db.commit()
        for path, says in ((text, "not a store"), (other, "not a store")):
            with self.subTest(path=os.path.basename(path)), self.assertRaises(ValueError) as raised:
                agent_loop.SqliteStore(path)
            self.assertIn(says, str(raised.exception))
        path = os.path.join(folder, "runs.db")
        store = self.store(path)
        await run_agent(store=store, run_id="job", fixtures=Fixtures(failures={"north": ["timeout"]}),
                        limits=Limits(tool_seconds=0.05, total_seconds=0.02))
        generation = store.load("job")["generation"]
        tampered = os.path.join(folder, "tampered.db")
        with contextlib.closing(sqlite3.connect(tampered)) as db:
            store.db.backup(db)
        with contextlib.closing(sqlite3.connect(tampered)) as db:
            db.execute("UPDATE agent_loop_records SET body = '{\"round\": 1}'")
            db.execute("UPDATE agent_loop_meta SET value = ? WHERE key = 'version'", (str(agent_loop.STORE_VERSION),))
            db.commit()
        cases = [({"store": store, "limits": ROOMY}, "job: saved with another registry or other limits"),
                 ({"store": store, "registry": {**TOOLS, "compute_plan": dataclasses.replace(TOOLS["compute_plan"], cost=5)}},
                  "job: saved with another registry or other limits")]
        for options, message in cases:
            with self.subTest(message=message):
                await self.assertRefusedBeforeTheModelIsAsked(message, run_id="job", **options)
        with self.assertRaises(ValueError) as raised:
            await run_agent(store=self.store(tampered), run_id="job", limits=Limits(tool_seconds=0.05, total_seconds=0.02))
        self.assertEqual(str(raised.exception), "job: what the store holds for it is not a run this version saved")
        with contextlib.closing(sqlite3.connect(tampered)) as db:
            db.execute("UPDATE agent_loop_meta SET value = ? WHERE key = 'version'", (str(agent_loop.STORE_VERSION + 1),))
            db.commit()
        with self.assertRaises(ValueError) as raised:
            agent_loop.SqliteStore(tampered)
        self.assertIn("another version", str(raised.exception))
        self.assertEqual(store.load("job")["generation"], generation)  # no refusal claimed the run

    async def test_each_step_that_spends_is_saved_before_it_starts(self):
        store = self.store()
        seen = []

        async def model(history):  # what the store holds while the model decides: this round, paid
            saved = store.load("job")
            seen.append(("model", saved["state"]["used"]["rounds"], len(saved["history"])))
            return await fake_model(history)

        class Checking(Fixtures):
            async def invoke(self, call):  # what the store holds as a tool starts: its batch, admitted, unobserved
                saved = store.load("job")
                seen.append((call["call_id"], saved["history"][-1]["observations"],
                             call["call_id"] in [item["call_id"] for item in saved["history"][-1]["calls"]]))
                return await super().invoke(call)

        result = await run_agent(model, store=store, run_id="job", fixtures=Checking(delays={}), limits=ROOMY)
        self.assertEqual(result["status"], "completed")
        self.assertEqual(seen, [("model", 1, 0), ("r1-north", [], True), ("r1-south", [], True), ("model", 2, 1),
                                ("r2-plan", [], True), ("model", 3, 2)])
        saved = store.load("job")
        self.assertEqual((saved["status"], saved["history"], saved["trace"]), ("completed", result["history"], result["trace"]))

    async def test_a_save_writes_what_changed_and_not_the_whole_history(self):
        written = []

        class Counting(agent_loop.SqliteStore):
            def save(self, run_id, generation, state, records, events, end=None):
                written.append((len(records), len(events)))
                return super().save(run_id, generation, state, records, events, end)

        store = Counting(":memory:")
        self.addCleanup(store.close)
        async def model(history):  # one call a round, with a fresh id, for as long as the rounds last
            return calls(call(f"t{len(history)}", "tick", n=len(history)))

        registry = {"tick": ToolSpec(0, True, True, validate=lambda args: True)}
        tools = agent_loop.FunctionTools({"tick": lambda n: {"n": n}})
        result = await run_agent(model, store=store, run_id="long", fixtures=tools, registry=registry,
                                 accept=never_accept, limits=Limits(rounds=60, calls=60, credits=180, attempts=1,
                                                                   tool_seconds=5, model_seconds=5, total_seconds=60))
        self.assertEqual((result["status"], len(result["history"])), ("round_limit", 60))
        self.assertLessEqual(max(records for records, _ in written), 2)  # a round's record, and the one before it
        self.assertLessEqual(max(events for _, events in written), 2)
        self.assertEqual(len(store.load("long")["trace"]), len(result["trace"]))

    async def test_a_resumed_run_past_its_deadline_ends_deadline_without_asking_the_model(self):
        path = os.path.join(self.folder(), "runs.db")
        store = self.store(path)
        limits = Limits(tool_seconds=5, model_seconds=5, total_seconds=30)
        task = asyncio.create_task(run_agent(store=store, run_id="late", limits=limits,
                                             fixtures=Fixtures(failures={"north": ["timeout"]})))
        await wait_until(lambda: store.load("late") and store.load("late")["history"])
        task.cancel()  # a crash, as far as the store knows: nothing after the admitted batch is saved
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.closing(sqlite3.connect(path)) as db:  # the crash happened 31 s ago
            db.execute("UPDATE agent_loop_runs SET started = started - 31")
            db.commit()
        asked = []
        result = await run_agent(scripted(asked.append), store=store, run_id="late", limits=limits)
        self.assertEqual((result["status"], asked), ("deadline", []))
        self.assertEqual([event["event"] for event in result["trace"]], ["decision", "resumed", "observations", "stop"])
        self.assertEqual(result["used"], {"rounds": 1, "calls": 2, "credits": 7})  # the interrupted batch is charged

    async def test_two_processes_that_resume_one_run_only_one_goes_on(self):
        path = os.path.join(self.folder(), "runs.db")
        first, second = self.store(path), self.store(path)
        taken, started = asyncio.Event(), []

        class Waiting(Fixtures):  # the first process's tools wait until the second has taken the run over
            async def invoke(self, call):
                started.append(call["call_id"])
                await taken.wait()
                return await super().invoke(call)

        limits = Limits(tool_seconds=5, model_seconds=5, total_seconds=30)
        task = asyncio.create_task(run_agent(store=first, run_id="job", fixtures=Waiting(delays={}), limits=limits))
        await wait_until(lambda: len(started) == 2)
        later = Fixtures(delays={})
        resumed = await run_agent(store=second, run_id="job", fixtures=later, limits=limits)
        taken.set()
        lost = await task
        self.assertEqual((lost["status"], lost["answer"], lost["trace"][-1]["reason"]),
                         ("superseded", None, "another process claimed the run"))
        self.assertEqual(started, ["r1-north", "r1-south"])  # the first started nothing after it was fenced
        self.assertEqual((resumed["status"], errors(resumed)[:2]), ("completed", ["interrupted", "interrupted"]))
        self.assertEqual(store_result(second, "job"), resumed)

    async def test_a_run_that_finds_itself_taken_over_at_its_last_save_ends_superseded_without_its_answer(self):
        path = os.path.join(self.folder(), "runs.db")
        first, second = self.store(path), self.store(path)

        async def taken_over_while_answering(history):  # the other process claims the run during the last decision
            if len(history) == 2:
                saved = second.load("job")
                second.claim("job", saved["config"], saved["started"])
            return await fake_model(history)

        watched = []
        result = await run_agent(taken_over_while_answering, store=first, run_id="job", limits=ROOMY,
                                 on_event=watched.append)
        self.assertEqual((result["status"], result["answer"], result["trace"][-1]["status"]),
                         ("superseded", None, "superseded"))
        self.assertEqual(watched, result["trace"])  # the watcher heard only of the end that stands
        self.assertEqual((second.load("job")["status"], second.unfinished()), (None, ["job"]))

    async def test_a_store_that_cannot_save_stops_the_run_at_once_saying_why(self):
        class Full(agent_loop.SqliteStore):
            def save(self, *args, **kwargs):
                if self.load("job")["state"]["used"]["rounds"] >= 1:
                    raise sqlite3.OperationalError("database or disk is full")
                return super().save(*args, **kwargs)

        store = Full(":memory:")
        self.addCleanup(store.close)
        fixtures = Fixtures()
        result = await run_agent(store=store, run_id="job", fixtures=fixtures, limits=ROOMY)
        self.assertEqual((result["status"], result["trace"][-1]["error_type"], fixtures.started),
                         ("store_failed", "OperationalError", []))
        self.assertEqual(store.unfinished(), ["job"])  # what it saved stays: a later resume goes on from there

    def test_a_run_killed_while_a_tool_runs_resumes_in_a_new_process_with_nothing_refunded(self):
        folder = self.folder()
        path, log = os.path.join(folder, "runs.db"), os.path.join(folder, "started.log")
        run_in_a_process("crashing_run", path, "job", "tool", log, kill_when=log + ".ready")
        with agent_loop.SqliteStore(path) as store:
            self.assertEqual(store.unfinished(), ["job"])
        result = run_in_a_process("crashing_run", path, "job", "none", log)
        self.assertEqual(result["status"], "completed")
        self.assertEqual([event["event"] for event in result["trace"]][:4], ["decision", "resumed", "observations", "decision"])
        self.assertEqual(result["trace"][1], {"event": "resumed", "round": 1, "rounds": 1, "calls": 0, "credits": 3})
        self.assertEqual([(obs["call_id"], obs["error"], obs["retryable"]) for obs in result["history"][0]["observations"]],
                         [("r1-north", "interrupted", True), ("r1-south", "interrupted", True)])
        self.assertEqual(result["used"], {"rounds": 4, "calls": 5, "credits": 24})  # both interrupted reads were charged
        with open(log) as file:
            ran = file.read().split()
        self.assertEqual(ran.count("r1-north") + ran.count("r1-south"), 2)  # no tool of the crashed round ran again
        self.assertEqual(sorted(ran[2:]), ["r2-north", "r2-south", "r3-plan"])
        (shown,) = code_blocks(readme_section("A named run, saved, that resumes after a crash"), "json")
        self.assertEqual(json.loads(shown), result["trace"][:4])

    def test_a_run_killed_while_the_model_decides_keeps_that_decision_paid(self):
        folder = self.folder()
        path, log = os.path.join(folder, "runs.db"), os.path.join(folder, "started.log")
        run_in_a_process("crashing_run", path, "job", "model", log, kill_when=log + ".ready")
        result = run_in_a_process("crashing_run", path, "job", "none", log)
        self.assertEqual((result["status"], result["used"]), ("completed", {"rounds": 4, "calls": 3, "credits": 20}))
        self.assertEqual(result["trace"][2], {"event": "resumed", "round": 2, "rounds": 2, "calls": 2, "credits": 10})
        self.assertEqual([record["round"] for record in result["history"]], [1, 3])  # round 2 was paid, never decided
        with open(log) as file:
            self.assertEqual(sorted(file.read().split()), ["r1-north", "r1-south", "r2-plan"])  # fake_model numbers by history

    async def test_ids_and_repeats_used_before_a_crash_stay_used_after_it(self):
        path = os.path.join(self.folder(), "runs.db")
        store = self.store(path)
        limits = Limits(tool_seconds=5, model_seconds=5, total_seconds=30)
        read = call("a", partition="north")
        task = asyncio.create_task(run_agent(scripted(calls(read), calls(call("b", partition="north")), calls(call("c", partition="north"))),
                                             store=store, run_id="job", limits=limits,
                                             fixtures=Fixtures(failures={"north": ["temporary", "timeout"]})))
        await wait_until(lambda: len((store.load("job") or {"history": []})["history"]) == 2)  # a, b admitted; b hangs
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for model, status in ((scripted(calls(call("a", partition="south"))), "duplicate_call_id"),
                              (scripted(calls(call("z", partition="north"))), "repeat_limit")):
            with self.subTest(status=status):  # refused at the first decision after the resume: round 3
                copy_path = os.path.join(os.path.dirname(path), f"{status}.db")
                with contextlib.closing(sqlite3.connect(path)) as source, \
                        contextlib.closing(sqlite3.connect(copy_path)) as target:
                    source.backup(target)
                result = await run_agent(model, store=self.store(copy_path), run_id="job", limits=limits)
                self.assertEqual((result["status"], result["used"]), (status, {"rounds": 3, "calls": 2, "credits": 13}))

    async def test_a_round_that_stopped_the_run_stops_it_again_when_its_end_was_not_saved(self):
        path = os.path.join(self.folder(), "runs.db")

        class EndLost(agent_loop.SqliteStore):  # the disk fills just as the end is saved
            def save(self, run_id, generation, state, records, events, end=None):
                if end is not None:
                    raise sqlite3.OperationalError("disk I/O error")
                return super().save(run_id, generation, state, records, events, end)

        with EndLost(path) as store:
            first = await run_agent(store=store, run_id="job", fixtures=Fixtures(failures={"north": ["permission"]}),
                                    limits=ROOMY)
        self.assertEqual(first["status"], "store_failed")
        asked, fixtures = [], Fixtures()
        again = await run_agent(scripted(asked.append), store=self.store(path), run_id="job", fixtures=fixtures,
                                limits=ROOMY)
        self.assertEqual((again["status"], again["used"], asked, fixtures.started),
                         ("permission_denied", {"rounds": 1, "calls": 2, "credits": 7}, [], []))

    async def test_a_fenced_process_starts_no_further_call_of_its_serial_batch(self):
        path = os.path.join(self.folder(), "runs.db")
        first, second = self.store(path), self.store(path)
        serial = {**TOOLS, "read_partition": dataclasses.replace(TOOLS["read_partition"], parallel_safe=False)}
        taken, started = asyncio.Event(), []

        class Waiting(Fixtures):
            async def invoke(self, call):
                started.append(call["call_id"])
                await taken.wait()  # the other process takes the run over meanwhile
                return await super().invoke(call)

        task = asyncio.create_task(run_agent(store=first, run_id="job", fixtures=Waiting(delays={}), registry=serial,
                                             limits=ROOMY))
        await wait_until(lambda: started)
        saved = second.load("job")
        second.claim("job", saved["config"], saved["started"])
        taken.set()
        result = await task
        self.assertEqual((result["status"], started), ("superseded", ["r1-north"]))  # south never started

    async def test_what_a_run_saved_is_checked_before_any_claim(self):
        path = os.path.join(self.folder(), "runs.db")
        store = self.store(path)
        limits = Limits(tool_seconds=5, model_seconds=5, total_seconds=30)
        await run_agent(store=store, run_id="job", limits=limits, on_refused="observe",
                        model=scripted(calls(call("bad", partition="east")), calls(call("x", partition="north"))),
                        accept=never_accept)
        tamperings = {  # what is changed: (table, column, a SQL expression)
            "a refused event without its round": ("agent_loop_events", "body",
                                                  "replace(body, '\"round\": 1, \"status\"', '\"status\"')"),
            "a call id that is a list": ("agent_loop_records", "body", "replace(body, '\"bad\"', '[1]')"),
            "more calls used than the limits allow": ("agent_loop_runs", "state",
                                                      "replace(state, '\"calls\": 1', '\"calls\": 999')"),
            "a status no run has": ("agent_loop_runs", "status", "'banana'"),
            "a round after the rounds used": ("agent_loop_records", "body",
                                              "replace(body, '\"round\": 2', '\"round\": 7')"),
        }
        for why, (table, column, expression) in tamperings.items():
            with self.subTest(why=why):
                copy_path = os.path.join(os.path.dirname(path), "tampered.db")
                with contextlib.closing(sqlite3.connect(copy_path)) as target:
                    store.db.backup(target)
                    changed = target.execute(f"UPDATE {table} SET {column} = {expression}").rowcount
                    target.commit()
                self.assertGreater(changed, 0)
                tampered = self.store(copy_path)
                generation = tampered.load("job")["generation"]
                with self.assertRaises(ValueError) as raised:
                    await run_agent(store=tampered, run_id="job", limits=limits, on_refused="observe")
                self.assertEqual(str(raised.exception), "job: what the store holds for it is not a run this version saved")
                self.assertEqual(tampered.load("job")["generation"], generation)
                tampered.close()
                os.remove(copy_path)

    async def test_a_store_edited_out_of_the_shapes_the_runtime_saves_is_refused(self):
        path = os.path.join(self.folder(), "runs.db")
        store = self.store(path)
        done = await run_agent(store=store, run_id="job", fixtures=Fixtures(failures={"north": ["temporary"]}),
                               limits=ROOMY)
        self.assertEqual((done["status"], done["used"]["calls"]), ("completed", 4))
        records = "UPDATE agent_loop_records SET body = replace(body, '{}', '{}')"
        failed = '"error": "temporary", "retryable": true'
        unended = ["UPDATE agent_loop_runs SET status = NULL, answer = NULL",
                   "DELETE FROM agent_loop_events WHERE body LIKE '%\"stop\"%'"]
        tamperings = {  # each a list of SQL statements
            "a failure without retryable": [records.format(failed, '"error": "temporary"')],
            "an error that is a number": [records.format(failed, '"error": 7, "retryable": true')],
            "an error that is the status completed": [records.format(failed, '"error": "completed", "retryable": false')],
            "a failure not to retry that is no status": [records.format(failed, '"error": "batch_aborted", '
                                                                                 '"retryable": false')],
            "an unknown outcome of a read": [records.format(failed, '"error": "unknown_outcome", "retryable": false')],
            "a cut call whose arguments are not a dict": [
                *unended, "UPDATE agent_loop_records SET body = json_set(json_set(body, '$.observations', json('[]')), "
                          "'$.calls[0].arguments', json('[1]')) WHERE round = 3",
                "UPDATE agent_loop_runs SET state = json_set(state, '$.used.calls', 3)"],
            "rounds not paid for": ["UPDATE agent_loop_runs SET state = json_set(state, '$.used.credits', 3)"],
            "a success not counted": ["UPDATE agent_loop_runs SET state = json_set(state, '$.used.calls', 0)"],
            "a stop with no status": ["INSERT INTO agent_loop_events VALUES ('job', -1, '{\"event\": \"stop\", "
                                      "\"status\": \"banana\"}')"],  # (first: the last is the run's end)
            "an end that is not its stop's": ["UPDATE agent_loop_runs SET status = 'round_limit'"],
            "a write whose verdict is no verdict": ["UPDATE agent_loop_runs SET state = json_set(state, '$.writes', "
                                                     "json('{\"w\": {\"verdict\": \"maybe\", \"by\": \"policy\", "
                                                     "\"started\": false}}'))"],
            "a write that is a list": ["UPDATE agent_loop_runs SET state = json_set(state, '$.writes', "
                                       "json('{\"w\": [1]}'))"],
            "a pause that waits for nothing known": ["UPDATE agent_loop_runs SET state = json_set(state, '$.waits', "
                                                     "'a person')"],
            "a cut batch past the budget": [*unended, "UPDATE agent_loop_records SET body = json_set(body, "
                                            "'$.observations', json('[]')) WHERE round = 3",
                                            "UPDATE agent_loop_runs SET state = json_set(state, '$.used.calls', 5)"],
        }
        for why, statements in tamperings.items():
            with self.subTest(why=why):
                copy_path = os.path.join(os.path.dirname(path), "tampered.db")
                with contextlib.closing(sqlite3.connect(copy_path)) as target:
                    store.db.backup(target)
                    for statement in statements:
                        self.assertGreater(target.execute(statement).rowcount, 0, statement)
                    target.commit()
                with agent_loop.SqliteStore(copy_path) as tampered, self.assertRaises(ValueError) as raised:
                    await run_agent(store=tampered, run_id="job", limits=ROOMY)
                self.assertEqual(str(raised.exception), "job: what the store holds for it is not a run this version saved")
                os.remove(copy_path)
        base = [*unended, "UPDATE agent_loop_records SET body = json_set(body, '$.observations', json('[]')) "
                          "WHERE round = 3", "UPDATE agent_loop_runs SET state = json_set(state, '$.used.calls', 3)"]
        with contextlib.closing(sqlite3.connect(os.path.join(os.path.dirname(path), "cut.db"))) as target:
            store.db.backup(target)
            for statement in base:  # the same cut, within the budget: a crash's, resumed
                target.execute(statement)
            target.commit()
        with agent_loop.SqliteStore(os.path.join(os.path.dirname(path), "cut.db")) as cut:
            resumed = await run_agent(store=cut, run_id="job", limits=ROOMY)
            self.assertEqual(resumed["history"][2]["observations"][0]["error"], "interrupted")  # (then out of credits)

    async def test_a_run_with_a_refused_call_of_any_shape_observed_resumes_and_returns_its_end(self):
        bad = {"call_id": "bad", "name": "read_partition", "arguments": ["north"]}  # not a dict: refused, observed
        store, hold = self.store(), asyncio.Event()

        async def model(history):
            if history:
                await hold.wait()  # round 2: the crash comes while the model thinks
            return calls(bad) if not history else final(1)

        options = dict(store=store, limits=ROOMY, on_refused="observe", accept=never_accept)
        task = asyncio.create_task(run_agent(model, run_id="cut", **options))
        await wait_until(lambda: store.load("cut") and store.load("cut")["history"])
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        hold.set()
        resumed = await run_agent(model, run_id="cut", **options)
        self.assertEqual((resumed["status"], resumed["history"][0]["calls"][0]["arguments"]), ("invalid_final", ["north"]))
        self.assertEqual(await run_agent(model, run_id="cut", **options), resumed)  # ended: its stored result

    async def test_a_store_with_its_tables_broken_is_not_a_store(self):
        folder = self.folder()
        for sql in ("DROP TABLE agent_loop_runs", "ALTER TABLE agent_loop_records RENAME COLUMN body TO text"):
            with self.subTest(sql=sql):
                path = os.path.join(folder, f"{len(os.listdir(folder))}.db")
                agent_loop.SqliteStore(path).close()
                with contextlib.closing(sqlite3.connect(path)) as db:
                    db.execute(sql)
                    db.commit()
                with self.assertRaises(ValueError) as raised:
                    agent_loop.SqliteStore(path)
                self.assertIn("not a store", str(raised.exception))

    async def test_observations_are_saved_before_the_watcher_sees_them(self):
        path = os.path.join(self.folder(), "runs.db")
        store = self.store(path)
        watching = asyncio.Event()

        async def slow_watcher(event):
            if event["event"] == "observations":
                watching.set()
                await asyncio.sleep(60)

        limits = Limits(tool_seconds=30, model_seconds=5, total_seconds=60)
        task = asyncio.create_task(run_agent(store=store, run_id="job", on_event=slow_watcher, limits=limits))
        await watching.wait()
        task.cancel()  # the crash comes while the watcher looks at the round's observations
        await asyncio.gather(task, return_exceptions=True)
        result = await run_agent(store=store, run_id="job", limits=limits)
        self.assertEqual((result["status"], errors(result)), ("completed", []))  # nothing was interrupted
        self.assertEqual(result["used"], {"rounds": 3, "calls": 3, "credits": 17})

    async def test_limits_equal_in_value_resume_a_run(self):
        store = self.store()
        task = asyncio.create_task(run_agent(store=store, run_id="job", limits=Limits(total_seconds=30),
                                             fixtures=Fixtures(failures={"north": ["timeout"]})))
        await wait_until(lambda: (store.load("job") or {"history": []})["history"])
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        result = await run_agent(store=store, run_id="job", limits=Limits(total_seconds=30.0))
        self.assertEqual(result["status"], "completed")

    async def test_a_record_is_written_when_it_changes_and_not_again(self):
        written = collections.Counter()

        class Counting(agent_loop.SqliteStore):
            def save(self, run_id, generation, state, records, events, end=None):
                written.update(record["round"] for record in records)
                return super().save(run_id, generation, state, records, events, end)

        with Counting(":memory:") as store:
            result = await run_agent(store=store, run_id="job", limits=ROOMY)
        self.assertEqual(result["status"], "completed")
        self.assertEqual(written, {1: 2, 2: 2})  # admitted, then observed: each once

    def test_the_store_keeps_its_promised_durability(self):
        with agent_loop.SqliteStore(os.path.join(self.folder(), "runs.db")) as store:
            self.assertEqual(store.db.execute("PRAGMA journal_mode").fetchone(), ("wal",))
            self.assertEqual(store.db.execute("PRAGMA synchronous").fetchone(), (2,))  # FULL

    async def test_a_refused_save_leaves_the_store_free_for_the_next_run(self):
        store = self.store(os.path.join(self.folder(), "runs.db"))
        with self.assertRaises(agent_loop.Superseded):
            store.save("nobody", 1, {"used": {"rounds": 0, "calls": 0, "credits": 0}, "paused": 0.0,
                                     "paused_at": None}, [], [])
        other = self.store(store.path)
        other.claim("job", "{}", time.time())  # a write lock left behind would make this wait, then fail
        other.claimed("job", 1)  # held under generation 1: nothing raised

    def test_claims_at_the_same_instant_from_several_processes_get_distinct_generations(self):
        path = os.path.join(self.folder(), "runs.db")
        agent_loop.SqliteStore(path).close()
        script = textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {HERE!r})
            import agent_loop
            with agent_loop.SqliteStore({path!r}) as store:
                while time.time() < float(sys.argv[1]):
                    pass
                print(store.claim("job", "{{}}", 0.0))
        """)
        start = time.time() + 0.5
        flags = ["-O"] if sys.flags.optimize else []
        processes = [subprocess.Popen([sys.executable, *flags, "-c", script, str(start)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for _ in range(4)]
        outputs = [process.communicate(timeout=60) for process in processes]
        self.assertEqual([err for _, err in outputs], [""] * 4)
        self.assertEqual(sorted(int(out) for out, _ in outputs), [1, 2, 3, 4])

    async def test_a_refused_rounds_calls_are_no_attempts_after_a_resume(self):
        path = os.path.join(self.folder(), "runs.db")
        store = self.store(path)
        limits = Limits(tool_seconds=5, model_seconds=5, total_seconds=30, attempts=1)
        east = call("e1", partition="east")  # refused (not a partition), observed: no attempt of read north
        asked = []

        async def refused_then_thinking(history):
            asked.append(len(history))
            if history:
                await asyncio.sleep(60)  # the crash comes while the second decision is made
            return calls(east, call("n1", partition="north"))

        task = asyncio.create_task(run_agent(refused_then_thinking, store=store, run_id="job", limits=limits,
                                             on_refused="observe", accept=never_accept))
        await wait_until(lambda: len(asked) == 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        result = await run_agent(scripted(calls(call("n2", partition="north"))), store=store, run_id="job",
                                 limits=limits, on_refused="observe", accept=never_accept)
        self.assertEqual(result["history"][-1]["observations"][0]["ok"], True)  # its one attempt was not spent

    def test_a_store_leaves_no_database_open(self):
        script = textwrap.dedent(f"""
            import asyncio, sys
            sys.path.insert(0, {HERE!r})
            import agent_loop
            with agent_loop.SqliteStore(":memory:") as store:
                asyncio.run(agent_loop.run_agent(store=store, run_id="job"))
            path = "{os.path.join(tempfile.gettempdir(), 'agent_loop_not_a_store.txt')}"
            with open(path, "w") as file:
                file.write("not a database" * 100)
            try:
                agent_loop.SqliteStore(path)
            except ValueError:
                pass
        """)
        done = subprocess.run([sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", script],
                              capture_output=True, text=True, timeout=120, check=False)
        self.assertEqual((done.returncode, done.stderr), (0, ""))
