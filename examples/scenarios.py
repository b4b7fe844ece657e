"""The scenario atlas: one small, deterministic run per stop status, the later parts' too, and why it stopped.

    python3 examples/scenarios.py            # the table: a row per scenario
    python3 examples/scenarios.py --json     # the same, as a JSON list
    python3 examples/scenarios.py NAME       # one scenario's trace events as they happen, then its status and answer
"""

import argparse
import asyncio
import copy
import inspect
import json
import os
import sqlite3
import sys
import tempfile
from dataclasses import dataclass, replace
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's root, for agent_loop

from agent_loop import (  # noqa: E402
    DATA, NOTE, TOOLS, Fixtures, Limits, SqliteStore, run_command, call, fake_model, make_plan, run_agent, scripted,
    work_jobs,
)
from examples.orders import (  # noqa: E402
    JOB_ORDER_TOOLS, ORDER_TOOLS, OrderDesk, _catalog_accepted, _catalog_model, _raised_version, order_accepted,
    order_catalog, order_model, place_order_job, receipt_accepted, receipt_model,
)


# The scenario atlas: one small, deterministic run per stop status, the later parts' too

async def _hanging_model(history):
    await asyncio.sleep(10)


async def _failing_model(history):
    raise RuntimeError("private detail of a model failure")


async def _counted_model(history):
    """fake_model, each of its replies reporting 400 input and 60 output tokens, as a real model's would."""
    return {**await fake_model(history), "usage": {"input_tokens": 400, "output_tokens": 60}}


async def _obeying_note(history):
    """fake_model, except that it follows the injected note once it has read it."""
    if any(obs["ok"] and obs["data"].get("note") == NOTE for record in history for obs in record["observations"]):
        return {"kind": "calls", "calls": [call("order", "place_order", sku="CUP", qty=100)]}
    return await fake_model(history)


_SERIAL = {"read_partition": {"parallel_safe": False}}
_HANG = {"north": ["timeout"], "south": ["timeout"]}
_NORTH = call("a", partition="north")


class _Held(Fixtures):
    """Fixtures whose calls wait until `release` is set: a process that a crash or a takeover meets mid-batch."""

    def __init__(self):
        super().__init__(delays={})
        self.release, self.arrived = asyncio.Event(), []

    async def invoke(self, call):
        self.arrived.append(call["call_id"])
        await self.release.wait()
        return await super().invoke(call)


async def _batch_started(fixtures, calls=2, seconds=30):
    end = asyncio.get_running_loop().time() + seconds
    while len(fixtures.arrived) < calls and asyncio.get_running_loop().time() < end:
        await asyncio.sleep(0.001)


def _recorded(timeline, model, tools, on_event):
    """The model, tools and watcher of a run, wrapped by timeline if one is given."""
    if timeline is None:
        return model, tools, on_event
    return timeline.model(model), timeline.tools(tools), timeline.watching(on_event)


async def _taken_over(on_event=None, timeline=None):
    """A second process resumes the run while the first one's reads run: the first is fenced at its next save."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "runs.db")
        with SqliteStore(path) as first, SqliteStore(path) as second:
            fixtures = _Held()
            model, tools, watcher = _recorded(timeline, fake_model, fixtures, on_event)
            running = asyncio.create_task(run_agent(model, store=first, run_id="job", fixtures=tools, on_event=watcher))
            await _batch_started(fixtures)
            await run_agent(store=second, run_id="job")  # the other process: it takes the run over, and ends it
            fixtures.release.set()
            return await running, fixtures


async def _crashed_and_resumed(on_event=None, timeline=None):
    """A process dies while both reads run; a new one resumes the run and completes it."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "runs.db")
        with SqliteStore(path) as store:
            held = _Held()
            running = asyncio.create_task(run_agent(store=store, run_id="job", fixtures=held))
            await _batch_started(held)
            running.cancel()  # the crash: whatever came after the batch was admitted is not saved
            await asyncio.gather(running, return_exceptions=True)
        with SqliteStore(path) as store:
            fixtures = _CancelAfter()
            model, tools, watcher = _recorded(timeline, fake_model, fixtures, on_event)
            return await run_agent(model, store=store, run_id="job", fixtures=tools, on_event=watcher), fixtures


class _FullDisk(SqliteStore):
    """A store whose disk fills up as the first batch is admitted."""

    def save(self, run_id, generation, state, records, events, end=None):
        if records:
            raise sqlite3.OperationalError("database or disk is full")
        return super().save(run_id, generation, state, records, events, end)


async def _disk_full(on_event=None, timeline=None):
    """The store cannot save the admitted batch: the run stops before any tool starts."""
    with _FullDisk(":memory:") as store:
        fixtures = _CancelAfter()
        model, tools, watcher = _recorded(timeline, fake_model, fixtures, on_event)
        return await run_agent(model, store=store, run_id="job", fixtures=tools, on_event=watcher), fixtures


class _Unsure(OrderDesk):
    """A desk that can never say whether an order applied."""

    async def reconcile(self, call):
        return {"applied": "perhaps"}


async def _order_run(store, fixtures, on_event=None, timeline=None, registry=ORDER_TOOLS, **options):
    model, tools, watcher = _recorded(timeline, order_model, fixtures, on_event)
    return await run_agent(model, registry=registry, accept=order_accepted, fixtures=tools, store=store,
                           run_id="order", on_event=watcher, **options)


async def _asked_about(on_event=None, timeline=None):
    """The policy asks about the order: the run pauses before it starts."""
    with SqliteStore(":memory:") as store:
        fixtures = OrderDesk(delays={})
        return await _order_run(store, fixtures, on_event, timeline, approve=lambda write: "ask"), fixtures


async def _decided_too_late(on_event=None, timeline=None):
    """The order waits for a decision, which comes after approval_seconds: nothing of its batch starts."""
    with SqliteStore(":memory:") as store:
        limits = replace(Limits(), approval_seconds=0.05)
        await _order_run(store, OrderDesk(delays={}), approve=lambda write: "ask", limits=limits)
        await asyncio.sleep(0.1)
        fixtures = OrderDesk(delays={})
        result = await _order_run(store, fixtures, on_event, timeline, approvals={"r3-order": "approve"},
                                  limits=limits)
        return result, fixtures


async def _unsure(on_event=None, timeline=None):
    """The order timed out after it was placed, and reconcile could not tell: the run pauses, nothing after it."""
    with SqliteStore(":memory:") as store:
        fixtures = _Unsure(delays={}, failures={"place_order": ["timeout_after_apply"]})
        return await _order_run(store, fixtures, on_event, timeline, approve=lambda write: "approve"), fixtures


async def _receipt_too_large(on_event=None, timeline=None):
    """The order is placed, and its receipt is larger than place_order's own result_bytes: the run stops."""
    with SqliteStore(":memory:") as store:
        fixtures = OrderDesk(delays={})
        registry = {**ORDER_TOOLS, "place_order": replace(ORDER_TOOLS["place_order"], result_bytes=64)}
        return await _order_run(store, fixtures, on_event, timeline, approve=lambda write: "approve",
                                registry=registry), fixtures


async def _order_job(on_event=None, timeline=None, finished=True):
    """The order as a job: the run submits it and pauses; then (finished) a worker places it, and the run, called
    again, answers with its receipt. Each step's events go to on_event."""
    with SqliteStore(":memory:") as store:
        fixtures = Fixtures(delays={})
        model, tools, watcher = _recorded(timeline, receipt_model, fixtures, on_event)
        options = dict(registry=JOB_ORDER_TOOLS, accept=receipt_accepted, fixtures=tools, store=store, run_id="order",
                       on_event=watcher)
        result = await run_agent(model, approve=lambda write: "approve", **options)
        if finished:
            await work_jobs(store, {"place_order": place_order_job})
            if on_event is not None:  # what the worker did, as the job's events say
                job = result["pending"][0]["job"]
                for event in store.events("order", job):
                    seen = on_event({"job": {**event, "id": job}})
                    if inspect.isawaitable(seen):  # on_event may be plain or async, as run_agent's may
                        await seen
            result = await run_agent(model, **options)
        return result, fixtures


class _Lookups(Fixtures):
    """Fixtures that answer with plain functions (the catalog's reads): each call recorded, as Fixtures records it."""

    def __init__(self, functions):
        super().__init__(delays={})
        self.functions = functions

    async def invoke(self, call):
        self.started.append(call["call_id"])
        self.active += 1
        try:
            await asyncio.sleep(0)
            return self.functions[call["name"]](**call["arguments"])
        finally:
            self.active -= 1
            self.finished.append(call["call_id"])


async def _loaded_then(change, on_event=None, timeline=None):
    """The chapter's catalog run: orders_get found and loaded, then change(catalog, granted) before its call."""
    catalog, grants, functions = order_catalog()
    granted, fixtures = set(grants), _Lookups(functions)
    model, tools, watcher = _recorded(timeline, _catalog_model(lambda: change(catalog, granted)), fixtures, on_event)
    return await run_agent(model, registry={}, fixtures=tools, accept=_catalog_accepted, catalog=catalog,
                           grants=lambda: granted, on_event=watcher), fixtures


# (name, what happened, how to run it). Each run uses the module's own Fixtures, fake_model and
# Limits; the keys: model, limits (fields of Limits), failures, inject, registry (fields of
# ToolSpec per tool), cancel_after (set the cancel event once that many tools have started).
ATLAS = (
    ("completed", "both reads in one parallel batch, then the plan; the answer passed the final check", {}),
    ("round_limit", "two rounds read and planned; no round was left for the answer", {"limits": {"rounds": 2}}),
    ("call_limit", "the first batch holds two reads but one call was allowed: nothing ran", {"limits": {"calls": 1}}),
    ("credit_limit", "the plan was computed, then 14 + 3 credits for the answer passed 16",
     {"limits": {"credits": 16}}),
    ("deadline", "both reads hung; the 0.3 s run deadline cut them off (tool_timeout) and ended the run",
     {"failures": _HANG, "limits": {"total_seconds": 0.3, "tool_seconds": 1}}),
    ("cancelled", "the cancel event was set while both reads ran; both were cancelled and kept as observations",
     {"failures": _HANG, "limits": {"tool_seconds": 5}, "cancel_after": 2}),
    ("model_timeout", "the model did not decide within 0.05 s",
     {"model": _hanging_model, "limits": {"model_seconds": 0.05}}),
    ("model_exception", "the model raised; its message is not kept", {"model": _failing_model}),
    ("invalid_decision", "the model returned text instead of a decision", {"model": scripted("the total is 21900")}),
    ("invalid_final", "a correct answer guessed before any evidence was read",
     {"model": scripted({"kind": "final", "answer": make_plan(DATA["north"] + DATA["south"])})}),
    ("invalid_batch", "an empty batch of calls", {"model": scripted({"kind": "calls", "calls": []})}),
    ("invalid_call", "a call that is a string, not a dict",
     {"model": scripted({"kind": "calls", "calls": ["read north"]})}),
    ("invalid_call_id", "an empty call id",
     {"model": scripted({"kind": "calls", "calls": [call("", partition="north")]})}),
    ("duplicate_call_id", "two calls with the id 'a' in one batch: nothing ran",
     {"model": scripted({"kind": "calls", "calls": [_NORTH, call("a", partition="south")]})}),
    ("unknown_tool", "the injected note asked for place_order; text in data grants no tool",
     {"model": _obeying_note, "inject": True}),
    ("permission_denied", "north refused permission; in a serial batch south was then batch_aborted",
     {"failures": {"north": ["permission"]}, "registry": _SERIAL}),
    ("invalid_arguments", "a path-like partition, '../north'",
     {"model": scripted({"kind": "calls", "calls": [call("a", partition="../north")]})}),
    ("repeat_limit", "north failed temporarily twice; a third identical read was refused",
     {"failures": {"north": ["temporary", "temporary"]}}),
    ("tool_exception", "north had an internal fault; its message is not kept", {"failures": {"north": ["bug"]}}),
    ("token_limit", "each reply used 460 tokens; the third, the answer, took the run past tokens=1000 unread",
     {"model": _counted_model, "limits": {"tokens": 1000}}),
    ("invalid_result", "each read returned two rows, where its result_schema allows one: neither was kept",
     {"registry": {"read_partition": {"result_schema": {"type": "object", "properties": {
         "rows": {"type": "array", "maxItems": 1}}}}}}),
    # The later parts' statuses, and runs that resumed (PART 10, 11, 13 and 15).
    ("superseded", "another process resumed the run while its reads ran: its next save was refused, nothing more "
                   "started", {"run": _taken_over, "drawn": False}),
    ("store_failed", "the store's disk was full as the first batch was admitted: no tool started",
     {"run": _disk_full}),
    ("resumed", "the run was cut as a crash cuts it while both reads ran, and resumed: both interrupted, read "
                "again, completed", {"run": _crashed_and_resumed, "drawn": False}),
    ("awaiting_approval", "the approval policy asked about the order: the run paused before it started",
     {"run": _asked_about}),
    ("approval_expired", "the order's approval came after approval_seconds: it never started",
     {"run": _decided_too_late, "drawn": False}),
    ("unknown_outcome", "the order timed out after it applied and reconcile could not tell: the run paused",
     {"run": _unsure}),
    ("denied", "orders_get was found and loaded, then its grant revoked: its call was refused at the gate",
     {"run": partial(_loaded_then, lambda catalog, granted: granted.discard("orders:read"))}),
    ("stale_definition", "orders_get was found and loaded, then raised to version 2: its call was refused",
     {"run": partial(_loaded_then, _raised_version)}),
    ("result_too_large", "the order was placed and its receipt passed place_order's result_bytes of 64: the run "
                         "stopped, rather than have the model place it again", {"run": _receipt_too_large}),
    ("awaiting_job", "the order was a job: the run submitted it, and paused without a lease until it ends",
     {"run": partial(_order_job, finished=False)}),
    ("job_done", "the order job was placed by a worker, and the run, called again, answered with its receipt",
     {"run": _order_job}),
)


@dataclass
class _CancelAfter(Fixtures):
    cancel: asyncio.Event = None
    after: int = 0

    async def invoke(self, call):
        if len(self.started) + 1 == self.after:
            asyncio.get_running_loop().call_soon(self.cancel.set)  # once this call has started too
        return await super().invoke(call)


async def run_scenario(name, on_event=None, timeline=None):
    """Run one scenario of the atlas, drawn by timeline if one is given; return (result, fixtures)."""
    how = next(how for title, _, how in ATLAS if title == name)
    if "run" in how:  # a scenario of a later part, that runs itself
        return await how["run"](on_event, timeline)
    cancel = asyncio.Event()
    fixtures = _CancelAfter(failures=copy.deepcopy(how.get("failures", {})), inject=how.get("inject", False),
                            cancel=cancel, after=how.get("cancel_after", 0))
    registry = {tool: replace(spec, **how.get("registry", {}).get(tool, {})) for tool, spec in TOOLS.items()}
    limits = replace(Limits(), **how.get("limits", {}))
    model, tools = how.get("model", fake_model), fixtures
    if timeline is not None:
        timeline.limits = timeline.limits or limits
        model, tools, on_event = timeline.model(model), timeline.tools(fixtures), timeline.watching(on_event)
    result = await run_agent(model, limits=limits, fixtures=tools, cancel=cancel, registry=registry,
                             on_event=on_event)
    return result, fixtures


def _errors(result):
    return [obs["error"] for record in result["history"] for obs in record["observations"] if not obs["ok"]]


async def scenarios(name=None, as_json=False, timeline=None):
    """Print the atlas as a table (or JSON), or one scenario's events as they happen, then its status and answer;
    return that scenario's result (recorded by timeline, if given)."""
    if name is not None:
        print(f"{name}: each trace event as it happens")
        result, fixtures = await run_scenario(
            name, lambda event: print(json.dumps(event, ensure_ascii=False, indent=2, sort_keys=True)), timeline)
        print(name, result["status"], result["used"])
        print("finish order:", fixtures.finished)
        print(json.dumps(result["answer"], ensure_ascii=False, indent=2))
        return result
    rows = []
    for title, why, _ in ATLAS:
        result, _ = await run_scenario(title)
        rows.append({"name": title, "status": result["status"], "used": result["used"],
                     "errors": _errors(result), "why": why})
    if as_json:
        print(json.dumps(rows, ensure_ascii=False, indent=2))
        return None
    print(f"{'scenario':<18} {'status':<18} {'rounds':>6} {'calls':>5} {'credits':>7}  what happened")
    for row in rows:
        used = row["used"]
        print(f"{row['name']:<18} {row['status']:<18} {used['rounds']:>6} {used['calls']:>5} {used['credits']:>7}"
              f"  {row['why']}")
    return None


def _atlas_options(parser):
    parser.add_argument("name", nargs="?", choices=[scenario[0] for scenario in ATLAS], metavar="NAME",
                        help="print this scenario's trace events as they happen, then its status and answer")
    parser.add_argument("--json", action="store_true", help="print the table as a JSON list")


def _atlas_arguments(args, parser):
    if args.json and args.name:
        parser.error("--json prints the table of every scenario: give no NAME")


async def _atlas_command(args, parser, timeline=None):
    _atlas_arguments(args, parser)
    return await scenarios(args.name, args.json, timeline)


def main(argv=None):
    """Print the atlas, or one scenario's events: 0, or 1 with one line on standard error."""
    parser = argparse.ArgumentParser(description="One small, deterministic run per stop status, the later parts' "
                                                 "too, and why it stopped.")
    _atlas_options(parser)
    return run_command(parser, _atlas_command, parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
