"""See a run: its decisions and calls drawn on a time axis, in the terminal or as SVG.

    python3 examples/timeline.py                 # the demo's two runs, each printed as the demo prints it, then drawn
    python3 examples/timeline.py NAME            # a scenario of the atlas (examples/scenarios.py), then its drawing
    python3 examples/timeline.py [NAME] --svg FILE   # the drawing written to FILE as an SVG document instead
"""

import argparse
import asyncio
import contextlib
import copy
import inspect
import os
import sys
import unicodedata

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's root, for agent_loop

from agent_loop import DEMO_RUNS, Limits, run_command, demo, fake_model, run_agent, show_run  # noqa: E402
from examples.scenarios import ATLAS, _atlas_arguments, _atlas_command  # noqa: E402


# See a run: its decisions and calls drawn on a time axis

SERVED = ("search_tools", "load_tools")  # the catalog's own tools, which the runtime answers itself

# The colour of a bar in SVG, by how its lane ended (a decision's lane by its kind).
_COLOURS = {"ok": "#2f9e44", "temporary": "#f08c00", "tool_error": "#f08c00", "tool_timeout": "#e8590c",
            "cancelled": "#7048e8", "deadline": "#c92a2a", "decision": "#1c7ed6"}
_FAILED = "#c92a2a"  # any other way a call ended: a fault, a refusal, a call that never started


class Timeline:
    """A recorder that draws a run: when each decision was asked and answered, when each call started and
    ended, with its outcome, and the limits that acted, on the event loop's clock. One Timeline per run."""

    def __init__(self, limits=None, registry=None):
        self.limits = limits  # the run's Limits, if known: tells a cut by a call's own limit from one by the deadline
        self.registry = dict(registry or {})  # its registry, if known: a tool's own limit (ToolSpec.seconds) marked so
        self.decisions = []   # (asked, answered) of each decision, in order: one per round
        self.calls = {}       # call_id -> [(started, ended)] of each attempt (see ToolSpec.retries)
        self.cut = set()      # (call_id, attempt), ("model", round): what the runtime's wait ended, not they themselves
        self.events = []      # (time, trace event)

    @staticmethod
    def _now():
        return asyncio.get_running_loop().time()

    def model(self, model):
        """The model, wrapped so that each decision's asking and answering are recorded; nothing else changes."""
        if isinstance(model, type) or not callable(model):  # a class called with history makes only an instance
            raise ValueError("Timeline.model: give it the model you would give run_agent, a function")

        async def timed(history):
            asked = self._now()
            try:
                return await model(history)
            except asyncio.CancelledError:
                self.cut.add(("model", len(self.decisions) + 1))
                raise
            finally:
                self.decisions.append((asked, self._now()))

        return timed

    def tools(self, tools):
        """The tools object, wrapped so that each call's start and end are recorded; nothing else changes."""
        if isinstance(tools, type) or not callable(getattr(tools, "invoke", None)):  # a class's invoke lacks self
            raise ValueError("Timeline.tools: give it the tools you would give run_agent, an object with invoke(call)")
        return _TimedTools(self, tools)

    def event(self, event):
        """For run_agent(on_event=...): record each trace event as it happens."""
        self.events.append((self._now(), event))

    def watching(self, on_event=None):
        """An on_event that records each event, then hands a copy of it to on_event too (plain or async), if given."""
        if on_event is not None and (isinstance(on_event, type) or not callable(on_event)):
            raise ValueError("Timeline.watching: give it the on_event you would give run_agent, a function or None")

        async def both(event):
            self.event(event)
            if on_event is not None:
                seen = on_event(copy.deepcopy(event))  # a watcher that edits its event cannot edit the record
                if inspect.isawaitable(seen):  # on_event may be plain or async, as run_agent's may
                    await seen

        return both

    def lanes(self, result):
        """What the drawing shows: per round, a lane for the decision and one per call (name, tool, start, end,
        outcome, attempts: each attempt's (start, end)); the limits that acted (limit, time, round); the run's
        status; ValueError if this timeline did not record this run, and only it."""
        stop = result["trace"][-1]
        if [event for _, event in self.events] != result["trace"]:
            raise ValueError("this Timeline did not see this run's events, or saw another run's too: give run_agent "
                             "on_event=timeline.event, one Timeline per run")
        # A round may be paid and then stopped before its model was asked (a deadline or cancel during the copy).
        paid, asked = result["used"]["rounds"], len(self.decisions)
        if asked > paid:
            raise ValueError("this Timeline recorded another run too: use one Timeline per run, its model wrapped once")
        if asked < paid - (stop["status"] in ("deadline", "cancelled")):
            raise ValueError("decisions were asked that this Timeline did not record: give run_agent "
                             "timeline.model(model)")
        served = sum(obs["name"] in SERVED or "job" in obs for record in result["history"]
                     for obs in record["observations"])  # calls the runtime answered itself (see below)
        if result["used"]["calls"] > served and not self.calls:
            raise ValueError("calls ran that were not recorded: give run_agent fixtures=timeline.tools(...)")
        ids = {item["call_id"] for record in result["history"] for item in record["calls"]}
        first = self.decisions[0][0] if self.decisions else self.events[0][0]
        if not set(self.calls) <= ids or any(tried[0][0] < first for tried in self.calls.values()):
            raise ValueError("this Timeline recorded calls of another run: use one Timeline per run")
        kinds = {event["round"]: event["kind"] for _, event in self.events if event["event"] == "decision"}
        rounds = {}
        for number, (asked, answered) in enumerate(self.decisions, 1):
            kind = kinds.get(number)
            if kind not in ("calls", "final"):  # no decision came, or none that could be acted on
                kind = stop["status"] if number == len(self.decisions) else str(kind)
            rounds[number] = [("model", "decision", asked, answered, kind, [(asked, answered)])]
        for record in result["history"]:
            for obs in record["observations"]:
                tried = self.calls.get(obs["call_id"], [])
                # The runtime answers some calls itself (a catalog's search and load, a job's submit): no tools object
                # sees them, and they are drawn as the runtime observed them, without a bar.
                if not tried and obs["ok"] and obs["name"] not in SERVED and "job" not in obs:
                    raise ValueError("a call that ran was not recorded: give run_agent fixtures=timeline.tools(...)")
                started, ended = (tried[0][0], tried[-1][1]) if tried else (None, None)
                outcome = "ok" if obs["ok"] else obs["error"]
                rounds.setdefault(record["round"], []).append(
                    (obs["call_id"], obs["name"], started, ended, outcome, tried))
        return rounds, self._marks(rounds, stop["status"]), stop["status"]

    def _marks(self, rounds, status):
        """Where the limits acted: a call or decision cut off by its own time limit or by the run's deadline, and
        the cancel; one mark per limit and round, where it first acted."""
        ends = [lane[3] for lanes in rounds.values() for lane in lanes if lane[3] is not None]
        stopped = self.events[-1][0] if self.events else max(ends, default=None)
        span = (max(ends) - min(lane[2] for lanes in rounds.values() for lane in lanes if lane[2] is not None)
                if ends else 0.0)
        earliest = {}
        for number, lanes in rounds.items():
            for name, tool, _, _, last, tried in lanes:
                for attempt, ((began, ended), outcome) in enumerate(zip(tried, self.outcomes(name, tried, last)), 1):
                    limit = ended is not None and self._limit(
                        ("model", number) if tool == "decision" else (name, attempt), tool, began, ended, outcome,
                        status, stopped - ended <= max(0.002, span / 50))
                    if limit:
                        earliest[limit, number] = min(ended, earliest.get((limit, number), ended))
        limit = {"deadline": "deadline", "cancelled": "cancel"}.get(status)
        if limit and rounds and stopped is not None and not any(mark == limit for mark, _ in earliest):
            earliest[limit, max(rounds)] = stopped  # it acted between calls: where the run stopped
        return [(limit, when, number) for (limit, number), when in earliest.items()]

    def _limit(self, which_cut, tool, began, ended, outcome, status, at_the_end):
        """The limit that ended one attempt (or decision), if one did: its own time limit, the deadline, the cancel."""
        if outcome == "cancelled":
            return "cancel"
        if outcome not in ("tool_timeout", "model_timeout"):
            return None
        which = "model_seconds" if tool == "decision" else "tool_seconds"
        own = getattr(self.limits, which, None)
        if getattr(self.registry.get(tool), "seconds", None) is not None:
            which, own = "seconds", self.registry[tool].seconds
        # Uncut, it raised TimeoutError itself, or it held the loop past its limit (then it acted).
        if which_cut not in self.cut and (own is None or ended - began < own):
            return None
        short = own is not None and ended - began < own * 0.95  # the time left was shorter than its own limit
        return "deadline" if status == "deadline" and (at_the_end or short) else which

    def outcomes(self, name, tried, last):
        """How each attempt of a call ended (each retry's event says how the attempt before it did), the last as
        the call's observation says; a decision's, its one outcome."""
        failed = [event["after"] for _, event in self.events if event["event"] == "retry" and event["call_id"] == name]
        failed = failed[:len(tried) - 1]
        return [None] * (len(tried) - 1 - len(failed)) + failed + [last] if tried else []

    def _axis(self, rounds, marks):
        """(start, span) in seconds of everything recorded."""
        times = [t for lanes in rounds.values() for lane in lanes for t in lane[2:4] if t is not None]
        times += [t for _, t, _ in marks] + [t for t, _ in self.events]
        if not times:
            return 0.0, 1e-3
        return min(times), max(max(times) - min(times), 1e-3)

    def text(self, result, width=100):
        """The run as a terminal drawing: a lane per decision and per call with a bar from its start to its end and
        its outcome after it (a bar per attempt, ~ while it waits out a backoff); parallel calls overlap, serial ones
        follow each other; the limits that acted are marked where they acted, under a scale in milliseconds."""
        if type(width) is not int or width < 60:
            raise ValueError("width must be an int of at least 60")
        rounds, marks, status = self.lanes(result)
        if not rounds:
            return f"{status}: no decision was asked\n"
        start, span = self._axis(rounds, marks)
        digits = _ms_digits(span)
        label = 30
        tail = 1 + max(_columns(lane[4]) for lanes in rounds.values() for lane in lanes)
        columns = width - label - tail

        def at(t):
            return min(int((t - start) / span * columns), columns - 1)

        scale = [" "] * columns
        for text, where in (("0 ms", 0), (f"{span * 500:.{digits}f} ms", columns // 2),
                            (f"{span * 1000:.{digits}f} ms", None)):
            where = columns - len(text) if where is None else where
            scale[where:where + len(text)] = text
        lines = [" " * label + "".join(scale), " " * label + "|" + "-" * (columns - 2) + "|"]
        for number in sorted(rounds):
            lines.append(f"round {number}")
            admitted = rounds[number][0][3] if rounds[number][0][1] == "decision" else None
            for name, tool, began, ended, outcome, tried in rounds[number]:
                row = [" "] * columns
                if began is None:  # it never started: refused, aborted, or overtaken by a stop
                    row[at(admitted) if admitted is not None else 0] = "."
                else:
                    first, last = at(began), at(ended)
                    row[first:last + 1] = "~" * (last - first + 1)
                    for began, ended in tried:
                        first, last = at(began), at(ended)
                        row[first:last + 1] = "=" * (last - first + 1)
                lane = "model" if tool == "decision" else _printable(f"{name} {tool}", label - 3)
                padding = " " * (label - 2 - _columns(lane))  # by columns: a Chinese character takes two
                lines.append(f"  {lane}{padding}{''.join(row)} {outcome}")
            for limit, when, where in sorted(marks, key=lambda mark: mark[1]):
                if where == number:
                    lines.append(" " * (label + at(when)) + f"^ {limit}")
        lines.append(f"{status}: {span * 1000:.{digits}f} ms from the first decision asked; one column is "
                     f"{span / columns * 1000:.2f} ms")
        return "\n".join(line.rstrip() for line in lines) + "\n"

    def svg(self, result, title="agent_loop run"):
        """The same drawing as a standalone SVG document: lanes, bars coloured by outcome, limit lines, labels and a
        legend."""
        return _svg_document([(title, self, result)])


def _columns(text):
    """How many terminal columns text takes: two for a wide or fullwidth character (Chinese, say), none for a
    combining mark, one for any other."""
    return sum(0 if unicodedata.combining(char) else 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
               for char in text)


def _printable(text, most):
    """text for a drawing: a character that a terminal or XML would act on (a control character) shown as ?,
    and at most `most` terminal columns, cut with ... if it is longer."""
    text = "".join(char if char.isprintable() else "?" for char in text)
    if _columns(text) <= most:
        return text
    kept, used = [], 0
    for char in text:
        used += _columns(char)
        if used > most - 3:
            break
        kept.append(char)
    return "".join(kept) + "..."


class _TimedTools:
    """A tools object that records when each call starts and ends, and passes every call on as it is. It answers
    what the runtime asks of tools (check_registry, check_writes, reconcile) as the tools it wraps do."""

    def __init__(self, timeline, tools):
        self.timeline, self.inner = timeline, tools

    def check_registry(self, registry):
        """The check of the tools it wraps, if they have one (FunctionTools does)."""
        check = getattr(type(self.inner), "check_registry", None)
        if check is not None:
            check(self.inner, registry)

    def check_writes(self, names):
        """The check of the tools it wraps, if they have one: a write function takes its idempotency_key."""
        check = getattr(type(self.inner), "check_writes", None)
        if check is not None:
            check(self.inner, names)

    async def reconcile(self, call):
        """What the tools it wraps say of a write whose outcome is unknown; None (nothing known) if they say nothing."""
        reconcile = getattr(type(self.inner), "reconcile", None)
        return None if reconcile is None else await reconcile(self.inner, call)

    async def invoke(self, call):
        cid, started = call["call_id"], self.timeline._now()  # the id first: the tool may edit its own copy
        try:
            return await self.inner.invoke(call)
        except asyncio.CancelledError:
            self.timeline.cut.add((cid, len(self.timeline.calls.get(cid, ())) + 1))  # the runtime's wait ended it
            raise
        finally:
            self.timeline.calls.setdefault(cid, []).append((started, self.timeline._now()))


def _ms_digits(span):
    """Decimals a scale in milliseconds needs for a run of `span` seconds: none, unless the run was very short."""
    return 2 if span < 0.002 else 1 if span < 0.02 else 0


async def drawn_demo(text=True, svg=None):
    """The demo, each run printed as the demo prints it, then drawn: on the terminal, or into an SVG file."""
    drawings = []
    for title, make_fixtures in DEMO_RUNS:
        fixtures, timeline = make_fixtures(), Timeline(Limits())
        result = await run_agent(timeline.model(fake_model), fixtures=timeline.tools(fixtures), on_event=timeline.event)
        show_run(title, result, fixtures)
        drawings.append((title, timeline, result))
        _draw(drawings[-1:], text, None)
    _draw(drawings, False, svg)


def _drawing_options(options):
    """options, then the two that draw a run."""
    def both(parser):
        options(parser)
        parser.add_argument("--timeline", action="store_true", help="draw the run on a time axis after it")
        parser.add_argument("--svg", metavar="FILE", help="write the drawing to FILE as an SVG document")

    return both


@contextlib.contextmanager
def _svg_file(path, parser):
    """The file --svg names, opened for writing, or None; closed at the end, so that a full disk shows there."""
    if path is None:
        yield None
        return
    try:
        svg = open(path, "w", encoding="utf-8")
    except OSError as error:
        parser.error(f"argument --svg: can't open '{path}': {error.strerror}")
    try:
        yield svg
        svg.close()  # its last write happens here: a full disk shows now, not at exit
    finally:
        if not svg.closed:
            with contextlib.suppress(OSError):  # the error that brought us here is the one to report
                svg.close()


async def _drawn_demo(args, parser):
    if not args.timeline and args.svg is None:
        return await demo()
    with _svg_file(args.svg, parser) as svg:
        await drawn_demo(args.timeline, svg)


async def _drawn_scenario(args, parser):
    if not args.timeline and args.svg is None:
        return await _atlas_command(args, parser)
    if not args.name:
        parser.error("--timeline and --svg draw one scenario: give its NAME")
    _atlas_arguments(args, parser)  # its refusals come before the file is opened
    if next(how for title, _, how in ATLAS if title == args.name).get("drawn") is False:
        parser.error(f"cannot draw {args.name}: a Timeline draws a run it recorded whole, and this one resumes a "
                     "run from a store")
    with _svg_file(args.svg, parser) as svg:
        timeline = Timeline()
        result = await _atlas_command(args, parser, timeline)
        try:
            _draw([(args.name, timeline, result)], args.timeline, svg)
        except UnicodeEncodeError:  # (a ValueError too) the output cannot hold the drawing: run_command says so
            raise
        except ValueError as error:  # a run this process did not see whole, such as one resumed from a store
            parser.error(f"cannot draw {args.name}: {error}")


def _draw(runs, text, svg):
    """Print each (title, timeline, result) as text, and write them all to the file svg as one SVG document."""
    for title, timeline, result in runs if text else ():
        print(timeline.text(result), end="")
    if svg:  # a file main() opened, and closes
        svg.write(_svg_document(runs))


def _svg_document(runs):
    """One SVG document that draws each (title, timeline, result) in a band of its own, one under the other."""
    from xml.sax.saxutils import escape
    width, label, tail, row = 980, 250, 170, 20
    bars = width - label - tail
    body, y = [], 10
    for title, timeline, result in runs:
        rounds, marks, status = timeline.lanes(result)
        start, span = timeline._axis(rounds, marks)

        def x(t):
            return label + (t - start) / span * bars

        body.append(f'<text x="10" y="{y + 15}" class="title">{escape(_printable(title, 60))}: {escape(status)}</text>')
        y += 30
        for fraction in (0, 0.25, 0.5, 0.75, 1):
            tick = label + fraction * bars
            body.append(f'<line x1="{tick:.1f}" y1="{y}" x2="{tick:.1f}" y2="{y + 6}" class="axis"/>'
                        f'<text x="{tick:.1f}" y="{y - 3}" class="tick">'
                        f'{span * fraction * 1000:.{_ms_digits(span)}f} ms</text>')
        body.append(f'<line x1="{label}" y1="{y}" x2="{label + bars}" y2="{y}" class="axis"/>')
        y += 12
        if not rounds:
            body.append(f'<text x="20" y="{y + 14}" class="lane">no decision was asked</text>')
            y += row
        for number in sorted(rounds):
            body.append(f'<text x="10" y="{y + 14}" class="round">round {number}</text>'
                        f'<line x1="10" y1="{y + 2}" x2="{width - 10}" y2="{y + 2}" class="separator"/>')
            y += row
            first = y
            admitted = rounds[number][0][3] if rounds[number][0][1] == "decision" else None
            for name, tool, began, ended, outcome, tried in rounds[number]:
                kind = "decision" if tool == "decision" else "call"
                colour = _COLOURS["decision" if kind == "decision" else outcome] if (
                    kind == "decision" or outcome in _COLOURS) else _FAILED
                lane = "model" if kind == "decision" else _printable(f"{name} {tool}", 30)
                body.append(f'<text x="20" y="{y + 14}" class="lane">{escape(lane)}</text>')
                if began is None:  # it never started: a grey tick where its batch was admitted
                    tried, colour = [(admitted, None) if admitted is not None else (start, None)], "#868e96"
                elif len(tried) > 1:  # its backoffs: a thin line from its first attempt to its last
                    body.append(f'<line class="backoff" x1="{x(began):.1f}" y1="{y + row / 2}" x2="{x(ended):.1f}" '
                                f'y2="{y + row / 2}"/>')
                for (began, ended), said in zip(tried, timeline.outcomes(name, tried, outcome)):  # a bar per attempt
                    left, length = x(began), 2.0 if ended is None else max(x(ended) - x(began), 2.0)
                    shade = colour if said == outcome else _COLOURS.get(said, _FAILED)
                    title = f"{escape(lane)}: {escape(said)}"
                    body.append(f'<rect class="{kind}" x="{left:.1f}" y="{y + 4}" width="{length:.1f}" '
                                f'height="{row - 8}" fill="{shade}"><title>{title}</title></rect>')
                body.append(f'<text x="{label + bars + 8}" y="{y + 14}" class="outcome">{escape(outcome)}</text>')
                y += row
            for limit, when, where in marks:
                if where == number:
                    body.append(f'<line class="limit" x1="{x(when):.1f}" y1="{first}" x2="{x(when):.1f}" y2="{y}"/>'
                                f'<text x="{x(when) + 3:.1f}" y="{y + 12}" class="limit">{escape(limit)}</text>')
                    y += 14
        y += 20
    legend = [("decision", _COLOURS["decision"]), ("ok", _COLOURS["ok"]),
              ("temporary, tool_error", _COLOURS["temporary"]), ("tool_timeout", _COLOURS["tool_timeout"]),
              ("cancelled", _COLOURS["cancelled"]), ("deadline or a fault", _FAILED), ("never started", "#868e96")]
    left = 10
    for name, colour in legend:
        body.append(f'<rect x="{left}" y="{y}" width="12" height="12" fill="{colour}"/>'
                    f'<text x="{left + 16}" y="{y + 11}" class="legend">{escape(name)}</text>')
        left += 16 + 7.5 * len(name) + 18  # a monospace character is about 7.2 px at 12 px
    height = y + 30
    style = ("text{font-family:monospace;font-size:12px}.title{font-size:14px;font-weight:bold}.tick{font-size:10px;"
             "text-anchor:middle}.axis{stroke:#495057}.separator{stroke:#dee2e6}.limit{stroke:#c92a2a;"
             "stroke-dasharray:4 3;fill:#c92a2a}.backoff{stroke:#868e96}")
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}">\n<style>{style}</style>\n'
            + "\n".join(body) + "\n</svg>\n")


async def _drawn(args, parser):
    """The demo, or the scenario NAME, drawn: as text, or into the SVG file."""
    args.timeline, args.json = args.svg is None, False
    if args.name is None:
        return await _drawn_demo(args, parser)
    return await _drawn_scenario(args, parser)


def main(argv=None):
    """Draw the demo or a scenario: 0, or 1 with one line on standard error."""
    parser = argparse.ArgumentParser(description="Draw a run's decisions and calls on a time axis: the demo's, or a "
                                                 "scenario's of the atlas.")
    parser.add_argument("name", nargs="?", choices=[scenario[0] for scenario in ATLAS], metavar="NAME",
                        help="a scenario of the atlas (examples/scenarios.py); the demo's runs without one")
    parser.add_argument("--svg", metavar="FILE", help="write the drawing to FILE as an SVG document")
    return run_command(parser, _drawn, parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
