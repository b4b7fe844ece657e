"""The chapters' demos: the executor, the large tool set's numbers, the long-running work's experiments.
"""

import asyncio
import contextlib
import functools
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

import agent_loop
from agent_loop import run_agent
from test_agent_loop import HERE, code_blocks, readme_section, RuntimeTestCase
from tests.support import run_script, BRIDGES, Recorder, utf8_json
from examples.executor import executor
from examples.orders import _catalog_accepted, _catalog_model, order_catalog


# The executor chapter's demo

class ExecutorTests(RuntimeTestCase):
    """The chapter's five tools: four reads in flight at once, each under its own limit or retries, then a
    write that fails once and never runs again."""

    async def test_the_reads_run_at_once_each_as_its_tool_says_and_the_write_runs_once(self):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            timeline, result = await executor()
        self.assertEqual((result["status"], result["answer"]),
                         ("completed", {"fetch_page": "ok", "read_file": "ok", "flaky_quote": "ok",
                                        "stuck_feed": "tool_timeout", "save_report": "temporary"}))
        reads, (write,) = (record["observations"] for record in result["history"][:2])
        self.assertEqual([obs.get("attempts", 1) for obs in reads], [1, 1, 3, 1])  # the flaky read's, unseen
        spans = [timeline.calls[obs["call_id"]] for obs in reads]
        self.assertLess(max(tried[0][0] for tried in spans), min(tried[-1][1] for tried in spans))  # all in flight
        self.assertEqual((len(timeline.calls[write["call_id"]]), write["retryable"]), (1, True))
        lines = printed.getvalue().splitlines()
        self.assertIn("  save_report ran 1 time, never again: retries=3 on a write is a ValueError", lines)
        wall, summed = map(int, re.search(r"wall time (\d+) ms; its calls' times summed (\d+) ms", printed.getvalue()
                                          ).groups())
        self.assertLess(wall, summed)  # side by side: the batch took its slowest call's time, not the sum
        self.assertIn("^ seconds", timeline.text(result))  # cut by the stuck read's own limit, not tool_seconds

    def test_the_readme_shows_the_command_as_it_prints(self):
        done = run_script("executor")
        (shown,) = [block for block in code_blocks(readme_section("Retries, time limits and calls in flight"), "")
                    if "the executor" in block]
        numbers = functools.partial(re.sub, r" *\d+", " N")  # its times, as wide as they come
        self.assertEqual((done.returncode, numbers(shown)), (0, numbers(done.stdout)))



# The large tool set chapter's numbers

def sent_after_the_load():
    """The catalog's part (tools, replayed turns) of the request each bridge sends once the chapter's run loaded."""
    catalog, grants, functions = order_catalog()
    result = asyncio.run(run_agent(_catalog_model(), registry={}, accept=_catalog_accepted,
                                   catalog=catalog, grants=grants, fixtures=agent_loop.FunctionTools(functions)))
    figures = []
    for name, key in (("responses", "input"), ("chat", "messages"), ("messages", "messages")):
        make_model, options, _, _ = BRIDGES[name]
        create = Recorder({})
        asyncio.run(make_model(create, "t", {}, catalog=catalog, grants=grants, **options)(result["history"][:2]))
        (request,) = create.requests
        figures.append(len(utf8_json(request["tools"])) + len(utf8_json(request[key][1:])))
    return figures


class CatalogNumbersTests(unittest.TestCase):
    """The chapter's 300 entries, what is found, loaded and sent, and the five boundaries, one command."""

    def test_an_output_that_cannot_encode_the_text_is_one_line_on_standard_error_not_a_traceback(self):
        flags = ["-O"] if sys.flags.optimize else []
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "runs.db")
            with agent_loop.SqliteStore(path) as store:
                store.add("订单-1")  # a run id the store's listing prints
            for command in ([os.path.join(HERE, "examples", "catalog.py")],
                            [os.path.join(HERE, "agent_loop.py"), "store", path]):
                with self.subTest(command=command[0]):
                    done = subprocess.run([sys.executable, *flags, *command], capture_output=True, text=True,
                                          timeout=120, check=False, env={**os.environ, "PYTHONIOENCODING": "ascii"})
                    self.assertEqual((done.returncode, len(done.stderr.splitlines())), (1, 1))
                    self.assertIn("cannot write the output", done.stderr)

    def test_the_command_prints_the_chapters_numbers_and_the_readme_shows_them(self):
        done = run_script("catalog")
        self.assertEqual((done.returncode, done.stderr), (0, ""))
        lines = done.stdout.splitlines()
        self.assertTrue(lines[0].startswith('registered 300, discoverable 299 (every grant but refunds:write), loaded 2 '
                                            'for the query "查询 订单 状态": orders_get, shipments_get'))
        table = {line[2:60].strip(): [int(figure.replace(",", "")) for figure in line[60:].split()]
                 for line in lines[4:10]}
        on_demand = table["one request after the load, the catalog's part in all"]
        full = table["the full path: all 299 discoverable, every request"]
        self.assertEqual(on_demand, sent_after_the_load())
        self.assertTrue(all(part * 10 < whole for part, whole in zip(on_demand, full)))  # a tenth, and less
        self.assertEqual(lines[-5:], [
            '  no match        search "火星 着陆": []',
            '  a tie           search "状态": orders_get, shipments_get, one hit each: both returned, by name',
            lines[-3], "  grant revoked   orders:read revoked after the load: the run ends denied, orders_get started 0 "
            "times", "  version raised  orders_get at version 2 after the load: the run ends stale_definition, "
            "orders_get started 0 times"])
        size = int(re.search(r"within (\d+) bytes: 2 loaded; within (\d+): definition_budget_exceeded, none loaded",
                             lines[-3])[1])
        self.assertIn(f"within {size - 1}: ", lines[-3])
        (shown,) = [block for block in code_blocks(readme_section("Three hundred tools: a catalog"), "")]
        self.assertEqual(shown, done.stdout)

    def test_the_full_path_is_what_the_bridges_send_for_every_discoverable_definition(self):
        catalog, grants, _ = order_catalog()
        full = {name: entry.spec for name, entry in catalog.entries.items() if entry.permission in grants}
        done = run_script("catalog")
        figures = [int(figure.replace(",", "")) for figure in done.stdout.splitlines()[9][60:].split()]
        sent = [len(json.dumps(tools(full), ensure_ascii=False, separators=(",", ":")).encode()) for tools in (
            agent_loop.responses_tools, agent_loop.chat_tools, agent_loop.messages_tools)]
        self.assertEqual(figures, sent)


# The long-running work chapter's experiments

class JobsChapterTests(unittest.TestCase):
    """A job's lifecycle and its failures, on a clock of their own, one command, as the README shows it."""

    def test_the_command_prints_the_chapters_outcomes_and_the_readme_shows_them(self):
        done = run_script("jobs")
        self.assertEqual((done.returncode, done.stderr), (0, ""))
        lines = done.stdout.splitlines()
        for expected in ("  0  submit: job 1 queued; the store closed and opened again: job 1 queued",
                         "  1  claimed: attempt 1, export_report {\"month\": \"2026-08\"}",
                         "  2  progress 1/3: running; a reader polls (running 1/3), then stops: the job goes on",
                         "     6 events (submitted, claimed, progress, progress, progress, succeeded); after=5: succeeded",
                         "  key conflict      JobError key_conflict; job 1 queued, unchanged",
                         "  two owners        jobs 1 and 2; bob's status of job 1: None",
                         "  late worker       A claims at 1 (lease 2), B at 3; at 4 A's finish: Superseded stale, B's: "
                         "True, 1 result; job 1 succeeded",
                         "  lease run out     A claims at 1; at 4 its finish: Superseded lease_expired; job 1 running",
                         "  cancel, running   asked: cancel_requested; the finish: False, no result; job 1 cancelled",
                         "  deadline of 3     progress at 2, the finish at 3: False; job 1 failed (deadline_exceeded)",
                         "  retry after 3     fail at 2: queued; claim at 4: None; at 5: attempt 2; fail: failed; job 1 "
                         "failed (busy)",
                         "  run     rounds 1-3: reads, plan, the order submitted as job 1; awaiting_job, no lease held",
                         "  worker  job 1: claimed, progress 1/3, progress 2/3, progress 3/3, succeeded",
                         "  run     called again: job 1 succeeded, r3-order observes its result; round 4: completed"):
            with self.subTest(line=expected):
                self.assertIn(expected, lines)
        self.assertRegex(done.stdout, r'  5  finish: True; job 1 succeeded \{"rows": 3, "total_cents": 6000\}, '
                                      r'fingerprint [0-9a-f]{12}')
        (shown,) = code_blocks(readme_section("Work that outlives a call: durable jobs"), "")
        self.assertEqual(shown, done.stdout)
