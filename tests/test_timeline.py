"""See a run: its decisions and calls drawn on a time axis.
"""

import asyncio
import contextlib
import dataclasses
import io
import os
import re
import subprocess
import sys
import tempfile
import time
import unicodedata
import unittest
import unittest.mock
import xml.etree.ElementTree

import agent_loop
from agent_loop import call, fake_model, Fixtures, Limits, run_agent, scripted, TemporaryError, TOOLS, ToolSpec
from test_agent_loop import (
    any_answer, calls, conversion_accepted, CONVERSION_TOOLS, DEMO_TRANSCRIPT, errors, final, HERE, never_accept,
    observations, PlainTools, PLAN, RateDesk, readme_section, retrying, ROOMY,
    RuntimeTestCase,
)
from tests.support import run_script, run_scripts, STATUSES
from examples.scenarios import ATLAS, run_scenario
from examples.timeline import _COLOURS, Timeline


# See a run: its decisions and calls drawn on a time axis

def bars(drawing, label=30):
    """{lane label: (first column, last column, outcome)} of a text drawing's calls ('.' for one that never ran)."""
    found = {}
    for line in drawing.splitlines():
        if line.startswith("  ") and line[:label].strip() and not line.startswith("  model"):
            row, outcome = line[label:].rsplit(" ", 1)
            marks = [index for index, char in enumerate(row) if char in "=."]
            found[line[:label].strip()] = (marks[0], marks[-1], outcome)
    return found


def columns(text):
    """How many terminal columns text takes: two for a wide or fullwidth character, none for a combining mark."""
    return sum(0 if unicodedata.combining(char) else 2 if unicodedata.east_asian_width(char) in "WF" else 1
               for char in text)


READ = {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"], "additionalProperties": False}


class TimelineTests(RuntimeTestCase):
    """A run drawn on a time axis: lanes, bars and outcomes, the SVG, and the drawings of the command line."""

    async def drawn(self, fixtures, **options):
        timeline = Timeline()
        result = await run_agent(timeline.model(options.pop("model", fake_model)), fixtures=timeline.tools(fixtures),
                                 on_event=timeline.event, **options)
        return timeline, result

    async def test_the_recorder_changes_nothing_of_the_run(self):
        plain = await run_agent(fixtures=Fixtures(failures={"north": ["temporary"]}), limits=ROOMY)
        _, drawn = await self.drawn(Fixtures(failures={"north": ["temporary"]}), limits=ROOMY)
        self.assertEqual({key: drawn[key] for key in ("status", "answer", "used", "history", "trace")},
                         {key: plain[key] for key in ("status", "answer", "used", "history", "trace")})

    async def test_lanes_come_in_request_order_and_a_parallel_batch_overlaps(self):
        timeline, result = await self.drawn(Fixtures(delays={"north": 0.05, "south": 0.01}), limits=ROOMY)
        drawing = timeline.text(result, width=100)
        lanes = bars(drawing)
        self.assertEqual(list(lanes), ["r1-north read_partition", "r1-south read_partition", "r2-plan compute_plan"])
        north, south = lanes["r1-north read_partition"], lanes["r1-south read_partition"]
        self.assertLess(south[0], north[1])  # side by side: south began before north ended
        self.assertEqual([lane[2] for lane in lanes.values()], ["ok", "ok", "ok"])
        self.assertTrue(all(len(line) <= 100 for line in drawing.splitlines()))

    async def test_a_serial_batch_does_not_overlap(self):
        registry = {**TOOLS, "read_partition": dataclasses.replace(TOOLS["read_partition"], parallel_safe=False)}
        timeline, result = await self.drawn(Fixtures(delays={"north": 0.05, "south": 0.05}), registry=registry, limits=ROOMY)
        lanes = bars(timeline.text(result))
        north, south = lanes["r1-north read_partition"], lanes["r1-south read_partition"]
        self.assertGreaterEqual(south[0], north[1])  # one after the other
        self.assertLess(north[0], south[0])

    async def test_each_bar_ends_with_its_outcome_and_the_limits_that_acted_are_marked(self):
        cases = [  # (scenario, outcomes of its calls in request order, the mark of the limit that acted)
            ("deadline", ["tool_timeout", "tool_timeout"], "^ deadline"),
            ("cancelled", ["cancelled", "cancelled"], "^ cancel"),
            ("permission_denied", ["permission_denied", "batch_aborted"], None),
            ("repeat_limit", ["temporary", "ok", "temporary"], None),
        ]
        for name, outcomes, mark in cases:
            with self.subTest(name=name):
                timeline = Timeline()
                result, _ = await run_scenario(name, timeline=timeline)
                drawing = timeline.text(result)
                self.assertEqual([lane[2] for lane in bars(drawing).values()], outcomes)
                self.assertEqual([line.strip() for line in drawing.splitlines() if line.strip().startswith("^")],
                                 [mark] if mark else [])
                self.assertTrue(drawing.splitlines()[-1].startswith(f"{name}: "))
        timeline, result = await self.drawn(Fixtures(failures={"north": ["timeout"]}),
                                            limits=dataclasses.replace(ROOMY, tool_seconds=0.1))
        self.assertIn("^ tool_seconds", timeline.text(result))
        self.assertEqual(result["status"], "completed")

    async def test_the_svg_is_a_document_with_one_bar_per_call_and_its_limit_lines(self):
        for name, limits in (("deadline", 1), ("permission_denied", 0), ("completed", 0)):
            with self.subTest(name=name):
                timeline = Timeline()
                result, _ = await run_scenario(name, timeline=timeline)
                root = xml.etree.ElementTree.fromstring(timeline.svg(result).split("\n", 1)[1])
                svg = "{http://www.w3.org/2000/svg}"
                self.assertEqual(root.tag, f"{svg}svg")
                self.assertEqual(len([r for r in root.iter(f"{svg}rect") if r.get("class") == "call"]),
                                 len(observations(result)))
                self.assertEqual(len([r for r in root.iter(f"{svg}rect") if r.get("class") == "decision"]),
                                 result["used"]["rounds"])
                self.assertEqual(len([line for line in root.iter(f"{svg}line") if line.get("class") == "limit"]), limits)

    async def test_every_scenario_draws(self):
        for name in STATUSES:
            with self.subTest(name=name):
                timeline = Timeline()
                result, _ = await run_scenario(name, timeline=timeline)
                self.assertEqual(result["status"], name)
                self.assertTrue(timeline.text(result).splitlines()[-1].startswith(f"{name}: "))
                xml.etree.ElementTree.fromstring(timeline.svg(result).split("\n", 1)[1])

    async def test_a_call_id_with_control_characters_draws_safely(self):
        timeline = Timeline()
        model = scripted(calls(call("a\x01\n\x1b[31mred", partition="north")))
        result = await run_agent(timeline.model(model), fixtures=timeline.tools(Fixtures()), on_event=timeline.event,
                                 limits=dataclasses.replace(ROOMY, rounds=1))
        drawing = timeline.text(result)
        self.assertFalse([char for char in drawing if not char.isprintable() and char != "\n"])
        xml.etree.ElementTree.fromstring(timeline.svg(result).split("\n", 1)[1])

    def test_a_file_the_svg_cannot_go_to_is_refused_before_the_run(self):
        for done in run_scripts(("timeline", "--svg", os.path.join(HERE, "no such folder", "demo.svg")),
                                ("timeline", "--svg", "")):
            self.assertEqual((done.returncode, done.stdout), (2, ""))
            self.assertIn("can't open", done.stderr)
            self.assertNotIn("Traceback", done.stderr)

    def test_a_command_started_with_its_output_closed_says_so_in_one_line(self):
        flags = "-O" if sys.flags.optimize else ""
        command = f'"{sys.executable}" {flags} "{os.path.join(HERE, "agent_loop.py")}" demo >&-'
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=120, check=False)
        self.assertEqual((done.returncode, done.stderr), (1, "agent_loop.py: error: cannot write the output: "
                                                             "no standard output\n"))

    async def test_every_scenario_draws_but_those_that_resume_a_run_which_are_refused_before_a_file_is_touched(self):
        undrawn = [name for name, _, how in ATLAS if how.get("drawn") is False]
        self.assertEqual(undrawn, ["superseded", "resumed", "approval_expired"])
        for name in [name for name, _, _ in ATLAS if name not in STATUSES]:  # (those: just above)
            with self.subTest(name=name):
                timeline = Timeline()
                with contextlib.redirect_stdout(io.StringIO()):
                    result, _ = await run_scenario(name, timeline=timeline)
                if name in undrawn:
                    self.assertRaises(ValueError, timeline.text, result)  # (so the flag says what is so)
                else:
                    self.assertIn(f"{result['status']}: ", timeline.text(result))
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "kept.svg")
            with open(path, "w", encoding="utf-8") as file:
                file.write("kept")
            for done in run_scripts(*[("timeline", name, "--svg", path) for name in undrawn]):
                self.assertEqual((done.returncode, done.stdout), (2, ""))
                self.assertIn("a Timeline draws a run it recorded whole", done.stderr)
            with open(path, encoding="utf-8") as file:
                self.assertEqual(file.read(), "kept")

    async def test_each_attempt_is_a_bar_of_its_own_with_its_backoff_between(self):
        tried = []

        async def read(sku):
            tried.append(sku)
            await asyncio.sleep(0.02)
            if len(tried) < 3:
                raise TemporaryError if len(tried) == 1 else TimeoutError
            return {"stock": 1}

        registry = {"read": ToolSpec(1, True, True, parameters=READ, retries=2, backoff=(0.05, 0.05))}
        with unittest.mock.patch.object(agent_loop.random, "uniform", lambda low, high: high):
            timeline, result = await self.drawn(PlainTools({"read": read}), registry=registry, accept=never_accept,
                                                model=scripted(calls(call("a", "read", sku="A"))),
                                                limits=dataclasses.replace(ROOMY, rounds=1))
        (row,) = [line for line in timeline.text(result).splitlines() if line.startswith("  a read")]
        self.assertEqual(re.sub(r"(.)\1*", r"\1", row[30:].strip()), "=~=~= ok")  # three bars, two backoffs
        svg = xml.etree.ElementTree.fromstring(timeline.svg(result).split("\n", 1)[1])
        shades = [rect.get("fill") for rect in svg.iter("{http://www.w3.org/2000/svg}rect")
                  if rect.findtext("{http://www.w3.org/2000/svg}title", "").startswith("a read")]
        self.assertEqual(shades, [_COLOURS[code] for code in ("temporary", "tool_timeout", "ok")])
        self.assertEqual(len([line for line in svg.iter("{http://www.w3.org/2000/svg}line")
                              if line.get("class") == "backoff"]), 1)

    async def test_a_limit_is_marked_where_it_cut_an_attempt_not_where_the_call_ended(self):
        # Each attempt: cut by the tool's own limit ("cut"), or it failed by itself ("timeout": its own TimeoutError,
        # "temporary"). The mark goes where the cut one ended, whichever attempt it was.
        for first, second, marked in (("cut", "temporary", 0), ("timeout", "cut", 1)):
            with self.subTest(first=first, second=second):
                tried = []

                async def read(sku):
                    tried.append(sku)
                    how = first if len(tried) == 1 else second
                    await asyncio.sleep(30 if how == "cut" else 0.01)
                    raise TimeoutError if how == "timeout" else TemporaryError

                registry = {"read": ToolSpec(1, True, True, parameters=READ, retries=1, seconds=0.05,
                                             backoff=(0.05, 0.05))}
                limits, timeline = dataclasses.replace(ROOMY, rounds=1), Timeline(registry=registry)
                with unittest.mock.patch.object(agent_loop.random, "uniform", lambda low, high: high):
                    result = await run_agent(timeline.model(scripted(calls(call("a", "read", sku="A")))),
                                             registry=registry, fixtures=timeline.tools(PlainTools({"read": read})),
                                             on_event=timeline.event, accept=never_accept, limits=limits)
                _, marks, _ = timeline.lanes(result)
                self.assertEqual([(limit, when) for limit, when, _ in marks],
                                 [("seconds", timeline.calls["a"][marked][1])])

    async def test_a_timeline_wraps_tools_without_hiding_what_they_say_of_writes(self):
        timeline = Timeline()
        registry = {"save": ToolSpec(1, False, False, parameters=READ)}
        keyless = agent_loop.FunctionTools({"save": lambda sku: {}})
        with agent_loop.SqliteStore(":memory:") as store:
            await self.assertRefusedBeforeTheModelIsAsked(
                "save: a write function takes the keyword argument idempotency_key", registry=registry,
                fixtures=timeline.tools(keyless), accept=any_answer, store=store, run_id="r",
                approve=lambda write: "approve")

    async def test_the_readmes_drawings_are_those_of_the_runs_they_name(self):
        drawings = [block for block in re.findall(r"```\n(.*?)```", readme_section("See a run on a time axis"), re.S)
                    if "round 1" in block]
        self.assertEqual(len(drawings), 1)
        retry = Timeline()
        fixtures = Fixtures(failures={"north": ["temporary"]})
        result = await run_agent(retry.model(fake_model), fixtures=retry.tools(fixtures), on_event=retry.event)
        fresh = [retry.text(result)]
        for shown, drawn in zip(drawings, fresh):
            with self.subTest(drawing=drawn.splitlines()[-1]):
                self.assertEqual({lane: outcome for lane, (*_, outcome) in bars(shown).items()},
                                 {lane: outcome for lane, (*_, outcome) in bars(drawn).items()})
                self.assertEqual([line.strip() for line in shown.splitlines() if line.strip().startswith(("round", "^"))],
                                 [line.strip() for line in drawn.splitlines() if line.strip().startswith(("round", "^"))])
                self.assertEqual(shown.splitlines()[-1].split(":")[0], drawn.splitlines()[-1].split(":")[0])
                self.assertEqual([len(line) for line in shown.splitlines()[:2]],  # the scale, as wide as it is drawn
                                 [len(line) for line in drawn.splitlines()[:2]])

    def test_the_demo_draws_only_when_asked_and_prints_the_same_bytes_besides(self):
        drawn = run_script("timeline")
        self.assertEqual((drawn.returncode, drawn.stderr), (0, ""))
        normal, retry = DEMO_TRANSCRIPT.split("retry completed")
        self.assertTrue(drawn.stdout.startswith(normal))
        self.assertIn("retry completed" + retry, drawn.stdout)
        self.assertEqual(drawn.stdout.count("completed: "), 2)  # one drawing after each run
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "demo.svg")
            done = run_script("timeline", "--svg", path)
            self.assertEqual(done.stdout, DEMO_TRANSCRIPT)  # the drawing went to the file instead
            with open(path, encoding="utf-8") as file:
                xml.etree.ElementTree.fromstring(file.read().split("\n", 1)[1])

    def test_the_command_line_refuses_a_mix_before_it_touches_a_file(self):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "kept.svg")
            with open(path, "w", encoding="utf-8") as file:
                file.write("kept")
            for argv, says in ((("scenarios", "deadline", "--json"), "give no NAME"),
                               (("timeline", "no_such_status", "--svg", path), "invalid choice")):
                with self.subTest(argv=argv):
                    done = run_script(*argv)
                    self.assertEqual((done.returncode, done.stdout), (2, ""))
                    self.assertIn(says, done.stderr)
                    with open(path, encoding="utf-8") as file:
                        self.assertEqual(file.read(), "kept")
            done = run_script("timeline", "deadline", "--svg", path)
            self.assertEqual(done.returncode, 0)
            with open(path, encoding="utf-8") as file:
                self.assertTrue(file.read().startswith("<?xml"))

    @unittest.skipUnless(os.path.exists("/dev/full"), "needs /dev/full, a file that refuses every write")
    def test_a_drawing_that_cannot_be_written_is_an_error_line_not_a_traceback(self):
        for argv in (("timeline", "--svg", "/dev/full"), ("timeline", "cancelled", "--svg", "/dev/full")):
            with self.subTest(argv=argv):
                done = run_script(*argv)
                self.assertEqual(done.returncode, 1)
                self.assertNotIn("Traceback", done.stderr)
                self.assertIn("No space left on device", done.stderr)

    async def test_every_outcome_starts_in_one_terminal_column_whatever_the_labels(self):
        async def read_stock(sku):
            await asyncio.sleep(0.01)
            return {"sku": sku, "stock": 4}

        long_id = "长" * 40
        ids = ["北-1", "南-1", long_id, "cafe\u0301"]  # wide characters, a label too long, a combining accent
        registry = {"读取库存": ToolSpec(1, True, True, parameters=READ)}
        model = scripted(calls(*[call(cid, "读取库存", sku=str(n)) for n, cid in enumerate(ids)]), final("done"))
        timeline = Timeline()
        tools = timeline.tools(agent_loop.FunctionTools({"读取库存": read_stock}))
        result = await run_agent(timeline.model(model), fixtures=tools, registry=registry, accept=any_answer,
                                 on_event=timeline.event, limits=ROOMY)
        self.assertEqual(result["status"], "completed")
        drawing = timeline.text(result, width=100)
        lanes = [line for line in drawing.splitlines() if line.startswith("  ") and line[2] != " "]
        self.assertEqual(len(lanes), 2 + len(ids))  # two decisions and four calls
        starts = {columns(line.rsplit(" ", 1)[0]) + 1 for line in lanes}  # the column where the outcome begins
        self.assertEqual(len(starts), 1, drawing)
        self.assertTrue(all(columns(line) <= 100 for line in drawing.splitlines()))
        (cut,) = [line for line in lanes if "..." in line]
        label = cut[2:cut.index("...") + 3]
        self.assertEqual((label, columns(label)), ("长" * 12 + "...", 27))  # at most 30 - 3 columns
        (accented,) = [line for line in lanes if "cafe" in line]
        self.assertTrue(accented.startswith("  cafe\u0301 读取库存" + " " * (28 - 13)))

class TimelineRecorderTests(RuntimeTestCase):
    """A Timeline records a run without changing it, draws only a run it saw whole, and marks only limits that cut."""

    async def test_a_timeline_that_recorded_another_runs_calls_or_decisions_draws_neither(self):
        for why in ("calls", "decisions"):
            with self.subTest(why=why):
                timeline = Timeline()
                if why == "calls":  # an earlier run through its tools only
                    await run_agent(fixtures=timeline.tools(Fixtures()), limits=ROOMY)
                    result = await run_agent(timeline.model(fake_model), fixtures=Fixtures(), on_event=timeline.event,
                                             limits=ROOMY)
                else:  # an earlier run through its model only
                    await run_agent(timeline.model(fake_model), limits=ROOMY)
                    result = await run_agent(timeline.model(fake_model), fixtures=timeline.tools(Fixtures()),
                                             on_event=timeline.event, limits=ROOMY)
                for draw in (timeline.text, timeline.svg):
                    with self.assertRaises(ValueError):
                        draw(result)

    async def drawn(self, timeline, fixtures, model=fake_model, **options):
        return await run_agent(timeline.model(model), fixtures=timeline.tools(fixtures), on_event=timeline.event,
                               **{"limits": ROOMY, **options})

    async def test_a_timeline_keeps_every_refusal_and_draws_only_the_one_run_it_saw_whole(self):
        def plain_model(history):  # not async: a model_exception, drawn or not
            return final(PLAN)

        for wrap in (False, True):
            timeline = Timeline()
            model = timeline.model(plain_model) if wrap else plain_model
            self.assertEqual((await run_agent(model, limits=ROOMY))["status"], "model_exception")
        timeline = Timeline()
        tools = timeline.tools(agent_loop.FunctionTools({"get_rate": RateDesk().get_rate}))
        await self.assertRefusedBeforeTheModelIsAsked("convert: FunctionTools has no function for it", fixtures=tools,
                                                      registry=CONVERSION_TOOLS, accept=conversion_accepted)
        # A Timeline is for one run: another run, or a model wrapped twice, is refused, not drawn wrong.
        timeline = Timeline()
        for _ in range(2):
            result = await run_agent(timeline.model(fake_model), fixtures=timeline.tools(Fixtures()),
                                     on_event=timeline.event, limits=ROOMY)
        with self.assertRaises(ValueError):
            timeline.text(result)
        timeline = Timeline()
        result = await run_agent(timeline.model(fake_model), on_event=timeline.event, limits=ROOMY)
        with self.assertRaises(ValueError):  # its calls ran, but were not recorded
            timeline.text(result)
        timeline, cancel = Timeline(), asyncio.Event()
        cancel.set()
        result = await run_agent(timeline.model(fake_model), fixtures=timeline.tools(Fixtures()), cancel=cancel,
                                 on_event=timeline.event, limits=ROOMY)
        self.assertEqual(timeline.text(result), "cancelled: no decision was asked\n")
        for width in (10, 100.0):
            with self.assertRaises(ValueError):
                timeline.text(result, width=width)

    async def test_each_limit_is_marked_where_it_acted_and_only_there(self):
        # A serial batch: north is cut by tool_seconds, south then by the run's deadline.
        registry = {**TOOLS, "read_partition": dataclasses.replace(TOOLS["read_partition"], parallel_safe=False)}
        limits = Limits(tool_seconds=0.2, model_seconds=5, total_seconds=0.35)
        timeline = Timeline(limits)
        result = await run_agent(timeline.model(fake_model), fixtures=timeline.tools(Fixtures(delays={"north": 30,
                                 "south": 30})), registry=registry, on_event=timeline.event, limits=limits)
        marks = [line.strip() for line in timeline.text(result).splitlines() if line.strip().startswith("^")]
        self.assertEqual((result["status"], marks), ("deadline", ["^ tool_seconds", "^ deadline"]))

        class OwnTimeout(Fixtures):  # a tool's own TimeoutError, long before its limit: no limit acted
            async def invoke(self, call):
                await super().invoke(call)
                raise TimeoutError()

        limits = dataclasses.replace(ROOMY, rounds=1)
        timeline = Timeline()
        result = await run_agent(timeline.model(fake_model), fixtures=timeline.tools(OwnTimeout(delays={})),
                                 on_event=timeline.event, limits=limits)
        self.assertEqual(errors(result), ["tool_timeout", "tool_timeout"])
        self.assertNotIn("^", timeline.text(result))

    async def test_a_tool_that_edits_its_own_call_changes_nothing_under_a_timeline(self):
        for edit in ("delete", "rename"):
            class Editing(Fixtures):
                async def invoke(self, call):
                    data = await super().invoke(call)
                    if edit == "delete":
                        del call["call_id"]
                    else:
                        call["call_id"] = "elsewhere"
                    return data

            with self.subTest(edit=edit):
                timeline = Timeline()
                result = await self.drawn(timeline, Editing(delays={}))
                self.assertEqual(result["status"], "completed")
                self.assertIn("r1-north", timeline.text(result))

    async def test_a_run_the_timeline_did_not_record_whole_is_a_value_error(self):
        both_fail = {"failures": {"north": ["bug"], "south": ["bug"]}, "delays": {}}
        unwrapped_tools = Timeline()
        result = await run_agent(unwrapped_tools.model(fake_model), fixtures=Fixtures(**both_fail),
                                 on_event=unwrapped_tools.event, limits=ROOMY)
        no_events = Timeline()
        result_without_events = await run_agent(no_events.model(fake_model), fixtures=no_events.tools(Fixtures()),
                                                limits=ROOMY)
        twice = Timeline()
        for _ in range(2):
            second = await run_agent(fake_model, fixtures=twice.tools(Fixtures(delays={})), on_event=twice.event,
                                     limits=ROOMY)
        for timeline, run, says in ((unwrapped_tools, result, "calls ran that were not recorded"),
                                    (no_events, result_without_events, "did not see this run's events"),
                                    (twice, second, "did not see this run's events")):
            with self.subTest(says=says), self.assertRaises(ValueError) as raised:
                timeline.text(run)
            self.assertIn(says, str(raised.exception))

    async def test_a_round_paid_but_stopped_before_its_model_was_asked_still_draws(self):
        copy_of = agent_loop._copy

        def slow_second_view(value, instead=None):  # the deadline passes while round 2's history is copied
            if type(value) is list and len(value) == 1:
                time.sleep(1.5)
            return copy_of(value, instead)

        self.allowBlockingSteps()
        timeline = Timeline()
        with unittest.mock.patch.object(agent_loop, "_copy", slow_second_view):
            result = await self.drawn(timeline, Fixtures(delays={}), limits=Limits(5, 5, 30, 2, 5, 5, 1.0))
        self.assertEqual((result["status"], result["used"]["rounds"], len(timeline.decisions)), ("deadline", 2, 1))
        self.assertIn("deadline", timeline.text(result))

    async def test_a_tools_own_timeout_marks_nothing_and_a_cut_one_marks_its_limit(self):
        class OwnTimeout(Fixtures):
            async def invoke(self, call):
                await super().invoke(call)
                raise TimeoutError()

        timeline = Timeline()
        result = await self.drawn(timeline, OwnTimeout(delays={}), limits=dataclasses.replace(ROOMY, rounds=1))
        self.assertEqual(errors(result), ["tool_timeout", "tool_timeout"])
        self.assertEqual(timeline.cut, set())
        self.assertNotIn("^", timeline.text(result))
        timeline = Timeline()
        result = await self.drawn(timeline, Fixtures(delays={"north": 30, "south": 0}),
                                  limits=Limits(rounds=1, tool_seconds=0.1, model_seconds=5, total_seconds=30))
        self.assertEqual((errors(result), timeline.cut), (["tool_timeout"], {("r1-north", 1)}))
        self.assertIn("^ tool_seconds", timeline.text(result))

    async def test_a_call_the_deadline_cut_is_marked_deadline_even_when_the_run_stopped_later(self):
        def slow_watcher(event):  # holds the loop after the batch: the stop comes well after the cut
            if event["event"] == "observations":
                time.sleep(0.3)

        self.allowBlockingSteps()
        limits = Limits(tool_seconds=5, model_seconds=5, total_seconds=0.3)
        timeline = Timeline(limits)
        result = await run_agent(timeline.model(fake_model), fixtures=timeline.tools(Fixtures(delays={"north": 30,
                                 "south": 30})), on_event=timeline.watching(slow_watcher), limits=limits)
        marks = [line.strip() for line in timeline.text(result).splitlines() if line.strip().startswith("^")]
        self.assertEqual((result["status"], errors(result), marks),
                         ("deadline", ["tool_timeout", "tool_timeout"], ["^ deadline"]))

    async def test_each_timeline_wrapper_refuses_a_bad_value_in_its_own_words_before_anything_runs(self):
        class Model:
            async def __call__(self, history):
                return await fake_model(history)

        model = "Timeline.model: give it the model you would give run_agent, a function"
        tools = "Timeline.tools: give it the tools you would give run_agent, an object with invoke(call)"
        watching = "Timeline.watching: give it the on_event you would give run_agent, a function or None"
        for wrap, thing, message in (("model", Model, model), ("model", None, model), ("tools", object(), tools),
                                     ("tools", Fixtures, tools), ("watching", dict, watching)):
            timeline = Timeline()
            with self.subTest(wrap=wrap, thing=thing), self.assertRaises(ValueError) as raised:
                getattr(timeline, wrap)(thing)
            self.assertEqual(str(raised.exception), message)
            self.assertEqual((timeline.decisions, timeline.calls, timeline.events), ([], {}, []))  # nothing ran

    async def test_watching_hands_each_event_to_an_async_watcher_too(self):
        seen = []

        async def watcher(event):
            await asyncio.sleep(0)
            seen.append(event)

        timeline = Timeline()
        result = await run_agent(timeline.model(fake_model), fixtures=timeline.tools(Fixtures(delays={})),
                                 on_event=timeline.watching(watcher), limits=ROOMY)
        self.assertEqual(seen, result["trace"])
        timeline.text(result)


    async def test_a_run_recorded_in_part_is_a_value_error_for_every_drawing(self):
        cases = [  # (what was left out, run_agent's arguments given a Timeline, the message)
            ("timeline.model", lambda t: {"model": fake_model, "fixtures": t.tools(retrying()), "on_event": t.event},
             "decisions were asked that this Timeline did not record: give run_agent timeline.model(model)"),
            ("timeline.tools", lambda t: {"model": t.model(fake_model), "fixtures": retrying(), "on_event": t.event},
             "calls ran that were not recorded: give run_agent fixtures=timeline.tools(...)"),
            ("on_event", lambda t: {"model": t.model(fake_model), "fixtures": t.tools(retrying())},
             "this Timeline did not see this run's events, or saw another run's too: give run_agent "
             "on_event=timeline.event, one Timeline per run"),
        ]
        for left_out, arguments, message in cases:
            timeline = Timeline()
            result = await run_agent(**arguments(timeline), limits=ROOMY)
            self.assertEqual((result["status"], result["used"]["rounds"]), ("completed", 4))
            for draw in (timeline.lanes, timeline.text, timeline.svg):
                with self.subTest(left_out=left_out, draw=draw.__name__):
                    with self.assertRaises(ValueError) as raised:
                        draw(result)
                    self.assertEqual(str(raised.exception), message)

    async def test_one_timeline_for_two_runs_draws_neither(self):
        timeline = Timeline()
        results = [await run_agent(timeline.model(fake_model), fixtures=timeline.tools(retrying()),
                                   on_event=timeline.event, limits=ROOMY) for _ in range(2)]
        for number, result in enumerate(results, 1):
            for draw in (timeline.text, timeline.svg):
                with self.subTest(run=number, draw=draw.__name__), self.assertRaises(ValueError):
                    draw(result)

    async def test_a_run_recorded_whole_draws_every_round(self):
        timeline = Timeline()
        result = await run_agent(timeline.model(fake_model), fixtures=timeline.tools(retrying()),
                                 on_event=timeline.event, limits=ROOMY)
        drawing = timeline.text(result)
        self.assertEqual([line for line in drawing.splitlines() if line.startswith("round")],
                         ["round 1", "round 2", "round 3", "round 4"])
        self.assertEqual(drawing.count("  model "), 4)

    async def test_a_watcher_that_edits_its_events_changes_neither_the_record_nor_the_drawing(self):
        def meddle(event):
            seen.append(event)
            event["event"] = "edited"
            event.pop("round", None)

        async def meddle_async(event):
            meddle(event)

        for watcher in (meddle, meddle_async):
            with self.subTest(watcher=watcher.__name__):
                seen, timeline = [], Timeline()
                result = await run_agent(timeline.model(fake_model), fixtures=timeline.tools(retrying()),
                                         on_event=timeline.watching(watcher), limits=ROOMY)
                self.assertEqual(len(seen), len(result["trace"]))  # the watcher saw every event
                self.assertEqual([event for _, event in timeline.events], result["trace"])
                self.assertTrue(timeline.text(result).splitlines()[-1].startswith("completed: "))
