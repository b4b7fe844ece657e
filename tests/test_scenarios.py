"""The scenario atlas: one small, deterministic run per stop status.
"""

import json
import re

import agent_loop
from agent_loop import STOP_STATUSES
from test_agent_loop import errors, PLAN, readme_section, RuntimeTestCase
from tests.support import run_script, run_scripts, STATUSES
from examples.scenarios import ATLAS, run_scenario


# The scenario atlas: one small, deterministic run per stop status

ATLAS_EXPECTED = {  # name: (rounds, calls, credits, observation errors in order)
    "completed": (3, 3, 17, []),
    "round_limit": (2, 3, 14, []),
    "call_limit": (1, 0, 3, []),
    "credit_limit": (2, 3, 14, []),
    "deadline": (1, 2, 7, ["tool_timeout", "tool_timeout"]),
    "cancelled": (1, 2, 7, ["cancelled", "cancelled"]),
    "model_timeout": (1, 0, 3, []),
    "model_exception": (1, 0, 3, []),
    "invalid_decision": (1, 0, 3, []),
    "invalid_final": (1, 0, 3, []),
    "invalid_batch": (1, 0, 3, []),
    "invalid_call": (1, 0, 3, []),
    "invalid_call_id": (1, 0, 3, []),
    "duplicate_call_id": (1, 0, 3, []),
    "unknown_tool": (2, 2, 10, []),
    "permission_denied": (1, 1, 5, ["permission_denied", "batch_aborted"]),
    "invalid_arguments": (1, 0, 3, []),
    "repeat_limit": (3, 3, 15, ["temporary", "temporary"]),
    "tool_exception": (1, 2, 7, ["tool_exception"]),
    "token_limit": (3, 3, 17, []),  # PART 16's
    "invalid_result": (1, 2, 7, ["invalid_result", "invalid_result"]),  # PART 17's
}


# What `python3 examples/scenarios.py` prints, written out (the README shows the same table).
ATLAS_TABLE = """\
scenario           status             rounds calls credits  what happened
completed          completed               3     3      17  both reads in one parallel batch, then the plan; the answer passed the final check
round_limit        round_limit             2     3      14  two rounds read and planned; no round was left for the answer
call_limit         call_limit              1     0       3  the first batch holds two reads but one call was allowed: nothing ran
credit_limit       credit_limit            2     3      14  the plan was computed, then 14 + 3 credits for the answer passed 16
deadline           deadline                1     2       7  both reads hung; the 0.3 s run deadline cut them off (tool_timeout) and ended the run
cancelled          cancelled               1     2       7  the cancel event was set while both reads ran; both were cancelled and kept as observations
model_timeout      model_timeout           1     0       3  the model did not decide within 0.05 s
model_exception    model_exception         1     0       3  the model raised; its message is not kept
invalid_decision   invalid_decision        1     0       3  the model returned text instead of a decision
invalid_final      invalid_final           1     0       3  a correct answer guessed before any evidence was read
invalid_batch      invalid_batch           1     0       3  an empty batch of calls
invalid_call       invalid_call            1     0       3  a call that is a string, not a dict
invalid_call_id    invalid_call_id         1     0       3  an empty call id
duplicate_call_id  duplicate_call_id       1     0       3  two calls with the id 'a' in one batch: nothing ran
unknown_tool       unknown_tool            2     2      10  the injected note asked for place_order; text in data grants no tool
permission_denied  permission_denied       1     1       5  north refused permission; in a serial batch south was then batch_aborted
invalid_arguments  invalid_arguments       1     0       3  a path-like partition, '../north'
repeat_limit       repeat_limit            3     3      15  north failed temporarily twice; a third identical read was refused
tool_exception     tool_exception          1     2       7  north had an internal fault; its message is not kept
"""


WHY = {  # each atlas scenario's stop event, beyond event, status and used: why, in plain data
    "completed": {},
    "round_limit": {"reason": "all 2 rounds were used"},
    "call_limit": {"reason": "2 calls asked, 1 left"},
    "credit_limit": {"reason": "a decision costs 3 credits, 2 left"},
    "deadline": {},
    "cancelled": {},
    "model_timeout": {},
    "model_exception": {"error_type": "RuntimeError"},
    "invalid_decision": {"reason": "a decision is a dict"},
    "invalid_final": {"rejected": PLAN, "reason": "the final check did not accept it"},
    "invalid_batch": {"reason": "no calls"},
    "invalid_call": {"reason": "a call is a dict of exactly call_id, name and arguments"},
    "invalid_call_id": {"reason": "a call id is a string of 1 to 80 characters"},
    "duplicate_call_id": {"call_id": "a", "reason": "the call id was used before"},
    "unknown_tool": {"call_id": "order", "name": "place_order", "reason": "no tool of that name"},
    "permission_denied": {"call_id": "r1-north", "name": "read_partition", "error_type": "PermissionError"},
    "invalid_arguments": {"call_id": "a", "name": "read_partition", "reason": "partition: not one of the allowed values"},
    "repeat_limit": {"call_id": "r3-north", "name": "read_partition",
                     "reason": "the same tool and arguments at most 2 times"},
    "tool_exception": {"call_id": "r1-north", "name": "read_partition", "error_type": "RuntimeError"},
}


class AtlasTests(RuntimeTestCase):
    """The scenario atlas: one run per stop status, its stop event, its table, its JSON and its command line."""

    def test_every_stop_status_has_a_scenario_of_that_name_the_contracts_first(self):
        self.assertEqual(list(STOP_STATUSES[:len(STATUSES)]), STATUSES)  # later parts add theirs after
        self.assertEqual([name for name, _, _ in ATLAS][:len(STATUSES)], STATUSES)
        self.assertLessEqual(set(STOP_STATUSES), {name for name, _, _ in ATLAS})

    async def test_each_scenario_stops_with_its_status_budget_and_errors(self):
        for name, (rounds, calls_used, credits, errors_seen) in ATLAS_EXPECTED.items():
            with self.subTest(name=name):
                result, fixtures = await run_scenario(name)
                self.assertEqual(result["status"], name)
                self.assertEqual(result["used"], {"rounds": rounds, "calls": calls_used, "credits": credits})
                self.assertEqual(errors(result), errors_seen)
                self.assertEqual(fixtures.active, 0)
                self.assertNoPrivateText(result)
        self.assertNoTaskLeft()

    def test_the_atlas_covers_the_observation_only_errors(self):
        seen = {error for *_, errors_seen in ATLAS_EXPECTED.values() for error in errors_seen}
        self.assertLessEqual({"temporary", "tool_timeout", "batch_aborted", "cancelled"}, seen)

    def test_the_table_is_the_one_written_out_here_and_in_the_readme(self):
        first, second = run_scripts(["scenarios"], ["scenarios"])
        self.assertEqual((first.returncode, first.stderr), (0, ""))
        self.assertEqual(first.stdout, second.stdout)
        self.assertEqual(first.stdout.splitlines()[:len(STATUSES) + 1], ATLAS_TABLE.splitlines())  # then later parts'

        shown = re.search(r"```\n(scenario .*?)```", readme_section("Every status, one command"), re.S)[1].splitlines()
        self.assertEqual(shown, [line for line in ATLAS_TABLE.splitlines() if line in shown])  # its lines, in order
        self.assertGreaterEqual(len(shown), 2)

    def test_the_json_table_holds_the_same_rows_and_each_runs_errors(self):
        done = run_script("scenarios", "--json")
        self.assertEqual((done.returncode, done.stderr), (0, ""))
        rows = json.loads(done.stdout)
        whys = [line.split(maxsplit=5)[5] for line in ATLAS_TABLE.splitlines()[1:]]
        self.assertEqual([(row["name"], row["why"]) for row in rows[:len(STATUSES)]], list(zip(STATUSES, whys)))
        for row in rows[:len(STATUSES)]:
            used = row["used"]
            self.assertEqual((row["status"], used["rounds"], used["calls"], used["credits"], row["errors"]),
                             (row["name"], *ATLAS_EXPECTED[row["name"]]))

    def test_one_scenario_prints_its_events_as_they_happen_then_its_status_and_answer(self):
        done = run_script("scenarios", "cancelled")
        self.assertEqual((done.returncode, done.stderr), (0, ""))
        head, rest = done.stdout.split("\n", 1)
        self.assertEqual(head, "cancelled: each trace event as it happens")
        events, decoder = [], json.JSONDecoder()
        while rest.startswith("{"):
            event, end = decoder.raw_decode(rest)
            events.append(event)
            rest = rest[end:].lstrip("\n")
        self.assertEqual([(event["event"], event.get("status")) for event in events],
                         [("decision", None), ("observations", None), ("stop", "cancelled")])
        lines = rest.splitlines()
        self.assertEqual(lines[0], "cancelled cancelled {'rounds': 1, 'calls': 2, 'credits': 7}")
        self.assertIn(lines[1], ("finish order: ['r1-north', 'r1-south']", "finish order: ['r1-south', 'r1-north']"))
        self.assertEqual(lines[2:], ["null"])

    def test_an_unknown_scenario_name_is_refused(self):
        done = run_script("scenarios", "no_such_status")
        self.assertEqual(done.returncode, 2)
        self.assertIn("invalid choice", done.stderr)

    async def test_the_atlas_shows_a_takeover_a_full_disk_and_a_crash_resumed(self):
        expected = {  # name: (status, used, observation errors)
            "superseded": ("superseded", {"rounds": 1, "calls": 2, "credits": 7}, []),
            "store_failed": ("store_failed", {"rounds": 1, "calls": 0, "credits": 3}, []),
            "resumed": ("completed", {"rounds": 4, "calls": 5, "credits": 24}, ["interrupted", "interrupted"]),
        }
        for name, (status, used, errors_seen) in expected.items():
            with self.subTest(name=name):
                result, fixtures = await run_scenario(name)
                self.assertEqual((result["status"], result["used"], errors(result)), (status, used, errors_seen))
                self.assertEqual(fixtures.active, 0)

    async def test_the_atlas_shows_a_catalog_tool_refused_at_the_gate_and_never_started(self):
        for name in ("denied", "stale_definition"):
            with self.subTest(name=name):
                result, fixtures = await run_scenario(name)
                self.assertEqual((result["status"], result["used"], fixtures.started),
                                 (name, {"rounds": 3, "calls": 2, "credits": 11}, []))
                self.assertEqual((result["trace"][-1]["call_id"], result["trace"][-1]["name"]), ("r3-order", "orders_get"))

    async def test_the_atlas_shows_the_order_as_a_job_the_run_paused_then_answered_with_its_receipt(self):
        paused, fixtures = await run_scenario("awaiting_job")
        self.assertEqual((paused["status"], paused["used"], [item["job"] for item in paused["pending"]]),
                         ("awaiting_job", {"rounds": 3, "calls": 4, "credits": 20}, [1]))
        self.assertNotIn("r3-order", fixtures.started)  # the order is the job's: no tool of the run placed it
        seen = []
        done, _ = await run_scenario("job_done", seen.append)
        self.assertEqual((done["status"], done["answer"]), ("completed", {"order": "PO-1", "lines": 3,
                                                                           "total_cents": 21900}))
        worker = [event["job"]["event"] for event in seen if "job" in event and len(event) == 1]
        self.assertEqual(worker, ["submitted", "claimed", "progress", "progress", "progress", "succeeded"])
        steps = [event.get("status") or event["event"] for event in seen if len(event) > 1]
        self.assertEqual(steps[steps.index("awaiting_job"):],
                         ["awaiting_job", "resumed", "job", "decision", "completed"])

    def test_every_status_of_the_module_has_a_scenario(self):
        self.assertLessEqual(set(agent_loop.every_status()), {name for name, _, _ in ATLAS})

    async def test_the_atlas_shows_a_write_asked_about_decided_too_late_and_unknown(self):
        expected = {"awaiting_approval": (3, 3, 17), "approval_expired": (3, 3, 17), "unknown_outcome": (3, 4, 20)}
        for name, used in expected.items():
            with self.subTest(name=name):
                result, _ = await run_scenario(name)
                self.assertEqual((result["status"], tuple(result["used"].values())), (name, used))


    async def test_each_failure_says_why_in_its_stop_event(self):
        self.assertEqual(list(WHY), STATUSES)
        for name, why in WHY.items():
            with self.subTest(name=name):
                result, _ = await run_scenario(name)
                stop = result["trace"][-1]
                self.assertEqual({key: value for key, value in stop.items()
                                  if key not in ("event", "status", "rounds", "calls", "credits")}, why)
                self.assertIsNone(result["answer"]) if name != "completed" else None
                self.assertNoPrivateText(result)
