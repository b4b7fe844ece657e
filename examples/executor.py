"""The executor chapter's demo: five tools, each attempt under its own limit, retries, a cap on calls in flight.

    python3 examples/executor.py                     # each call's outcome, attempts and time
    python3 examples/executor.py --timeline          # then the run drawn on a time axis
    python3 examples/executor.py --svg FILE          # the drawing written to FILE as an SVG document
"""

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's root, for agent_loop

from agent_loop import (  # noqa: E402
    FunctionTools, Limits, SqliteStore, TemporaryError, ToolSpec, run_command, call, run_agent,
)
from examples.orders import closed  # noqa: E402
from examples.timeline import Timeline, _draw, _drawing_options, _svg_file  # noqa: E402


# The executor chapter's demo: five tools, each attempt under its own limit, retries, a cap on calls in flight

_KEY = closed(key={"type": "string", "maxLength": 40})
EXECUTOR_TOOLS = {  # the chapter's five; its single batch of five is two here: a batch that holds a write is serial
    "fetch_page": ToolSpec(1, True, True, parameters=_KEY, description="an async read of 200 ms"),
    "read_file": ToolSpec(1, True, True, parameters=_KEY, description="a plain function of 200 ms, in a thread"),
    "flaky_quote": ToolSpec(1, True, True, parameters=_KEY, retries=3, backoff=(0.05, 0.5),
                            description="fails twice, then answers; retries=3"),
    "stuck_feed": ToolSpec(1, True, True, parameters=_KEY, seconds=0.25,
                           description="hangs for 5 s; its own limit, seconds=0.25"),
    "save_report": ToolSpec(2, False, False, parameters=_KEY, description="a write that fails once"),
}
EXECUTOR_LIMITS = Limits(calls=8, tool_seconds=1.0, total_seconds=10.0, concurrency=4)


def executor_tools():
    """FunctionTools for EXECUTOR_TOOLS, and the idempotency keys the write ran with, once per time it ran."""
    quotes, ran = [], []

    async def fetch_page(key):
        await asyncio.sleep(0.2)
        return {"page": key}

    def read_file(key):  # a plain function: it runs in a thread of its own
        time.sleep(0.2)
        return {"file": key}

    async def flaky_quote(key):
        quotes.append(key)
        if len(quotes) <= 2:
            raise TemporaryError("the quote service is busy")
        return {"quote": 42}

    async def stuck_feed(key):
        await asyncio.sleep(5)
        return {"feed": key}

    async def save_report(key, idempotency_key):
        ran.append(idempotency_key)
        if len(ran) == 1:
            raise TemporaryError("the report store is busy")
        return {"saved": key}

    return FunctionTools({function.__name__: function for function in (
        fetch_page, read_file, flaky_quote, stuck_feed, save_report)}), ran


def _outcomes(history):
    """Each call's name and how it ended, in the order they were asked for."""
    return {obs["name"]: "ok" if obs["ok"] else obs["error"] for record in history for obs in record["observations"]}


async def executor_model(history):
    """The four reads in one batch, then the write, then each call's outcome as the answer."""
    if not history:
        return {"kind": "calls", "calls": [call(f"r1-{name}", name, key=name) for name in list(EXECUTOR_TOOLS)[:4]]}
    if len(history) == 1:
        return {"kind": "calls", "calls": [call("r2-save_report", "save_report", key="report")]}
    return {"kind": "final", "answer": _outcomes(history)}


def executor_accepted(answer, history):
    """The answer is each call's outcome, as the history recomputes it."""
    return answer == _outcomes(history)


async def executor(timeline=None):
    """Run the chapter's five tools on an in-memory store, the write approved; print each call's outcome, attempts
    and time, the read batch's wall time against the sum of its calls' times, and how many times the write ran."""
    timeline, (tools, ran) = timeline or Timeline(EXECUTOR_LIMITS, EXECUTOR_TOOLS), executor_tools()
    with SqliteStore(":memory:") as store:
        result = await run_agent(timeline.model(executor_model), registry=EXECUTOR_TOOLS, limits=EXECUTOR_LIMITS,
                                 fixtures=timeline.tools(tools), accept=executor_accepted, on_event=timeline.event,
                                 store=store, run_id="executor", approve=lambda write: "approve")
    print(f"the executor: five tools, Limits(concurrency={EXECUTOR_LIMITS.concurrency})")
    for record, title in zip(result["history"], ("four reads in one batch", "the write, approved")):
        print(f"round {record['round']}, {title}:")
        for obs in record["observations"]:
            tried = timeline.calls.get(obs["call_id"], [])
            attempts = obs.get("attempts", 1)
            took = (tried[-1][1] - tried[0][0]) * 1000 if tried else 0.0
            print(f"  {obs['name']:<12} {EXECUTOR_TOOLS[obs['name']].description:<43} "
                  f"{'ok' if obs['ok'] else obs['error']:<13} {attempts} attempt{'s' if attempts > 1 else ' '} "
                  f"{took:5.0f} ms")
        if record["round"] == 1:
            spans = [timeline.calls[obs["call_id"]] for obs in record["observations"]]
            wall = max(tried[-1][1] for tried in spans) - min(tried[0][0] for tried in spans)
            summed = sum(tried[-1][1] - tried[0][0] for tried in spans)
            print(f"  the batch's wall time {wall * 1000:.0f} ms; its calls' times summed {summed * 1000:.0f} ms: "
                  f"{summed / wall:.2f}x")
    retried = {**EXECUTOR_TOOLS, "save_report": dataclasses.replace(EXECUTOR_TOOLS["save_report"], retries=3)}
    try:  # the chapter's executor ignores max_retries on a write; run_agent refuses it before the model is asked
        await run_agent(executor_model, registry=retried, fixtures=tools, accept=executor_accepted)
    except ValueError:
        print(f"  save_report ran {len(ran)} time{'s' if len(ran) != 1 else ''}, never again: retries=3 on a write is "
              "a ValueError")
    print(f"{result['status']}: {json.dumps(result['answer'])}")
    return timeline, result


async def _executor_command(args, parser):
    with _svg_file(args.svg, parser) as svg:
        timeline, result = await executor()
        _draw([("executor", timeline, result)], args.timeline, svg)


def main(argv=None):
    """Run the chapter's five tools: 0, or 1 with one line on standard error."""
    parser = argparse.ArgumentParser(description="The chapter's five tools: own time limits, retries, a cap on calls "
                                                 "in flight.")
    _drawing_options(lambda parser: None)(parser)
    return run_command(parser, _executor_command, parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
