"""The result-ownership experiment: who owns the object a tool returns, and what happens when the tool keeps it.

    python3 -B result_ownership.py      # prints the observations of the three modes as JSON

The model is handed a fresh copy of history, yet an old observation in the runtime's
own history changes. The runtime stores a tool's result as returned; a tool
that keeps that object (a cache) and updates it in place later changes history
with it. A delivery boundary between tool and runtime decides who owns the
result: `borrowed` hands the tool's object over, `shallow_copy` copies the
outer dict only, `deep_copy` copies all of it before history is written.
The runtime (agent_loop.py) is imported and used unchanged.
"""

import asyncio
import copy
import json

from agent_loop import DATA, Fixtures, Limits, call, canonical, run_agent

MODES = ("borrowed", "shallow_copy", "deep_copy")

ROWS = [
    {"sku": "CUP", "stock": 4, "target": 10, "unit_cents": 1200},
    {"sku": "PEN", "stock": 12, "target": 8, "unit_cents": 300},
    {"sku": "BAG", "stock": 2, "target": 5, "unit_cents": 2500},
    {"sku": "BOOK", "stock": 0, "target": 4, "unit_cents": 1800},
]
ANSWER = {
    "snapshot": "inventory-v1",
    "items": [
        {"sku": "BAG", "qty": 3, "cents": 7500},
        {"sku": "BOOK", "qty": 4, "cents": 7200},
        {"sku": "CUP", "qty": 6, "cents": 7200},
    ],
    "total_cents": 21900,
}
# One call per round, chosen by len(history); the last decision repeats. Nothing is read back
# from history, so the only thing this experiment observes is the delivery boundary.
SCRIPT = (
    {"kind": "calls", "calls": [call("read-north", partition="north")]},
    {"kind": "calls", "calls": [call("read-south", partition="south")]},
    {"kind": "calls", "calls": [call("plan", "compute_plan", rows=ROWS)]},
    {"kind": "final", "answer": ANSWER},
)
# Time limits far above what instant tools need; the outcome does not depend on time.
LIMITS = Limits(tool_seconds=5, model_seconds=5, total_seconds=30)


async def scripted_model(history):
    """Return the scripted decision for this round."""
    return copy.deepcopy(SCRIPT[min(len(history), len(SCRIPT) - 1)])


def describe(requested, data):
    """A plain-value description of one read: what was asked for and what the data says."""
    return {
        "requested_partition": requested,
        "observed_partition": data["partition"],
        "skus": [row["sku"] for row in data["rows"]],
        "stocks": [row["stock"] for row in data["rows"]],
    }


class ReusedCache(Fixtures):
    """A tool that keeps one result object and updates it in place on every read: a result cache."""

    def __init__(self):
        super().__init__(delays={})
        self.cache = {"snapshot": None, "partition": None, "rows": [{}, {}]}
        self.returned = []   # every object returned, to compare identity with `is`
        self.delivered = []  # what each read said at the moment it was returned

    async def invoke(self, call):
        """Return the cache, refreshed in place with the fresh result; other tools run as usual."""
        fresh = await super().invoke(call)
        if call["name"] != "read_partition":
            return fresh
        self.cache["snapshot"] = fresh["snapshot"]
        self.cache["partition"] = fresh["partition"]
        for kept, row in zip(self.cache["rows"], fresh["rows"]):  # the same two row dicts, refilled
            kept.clear()
            kept.update(row)
        self.returned.append(self.cache)
        self.delivered.append(describe(call["arguments"]["partition"], self.cache))
        return self.cache


class DeliveryBoundary:
    """Wraps a tool's invoke and decides, per mode, what the runtime receives: the tool's object or a copy."""

    def __init__(self, tool, mode):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        self.tool, self.mode = tool, mode

    async def invoke(self, call):
        """Deliver the tool's result as the mode says."""
        result = await self.tool.invoke(call)
        if self.mode == "shallow_copy":
            return dict(result)
        if self.mode == "deep_copy":
            return copy.deepcopy(result)
        return result


class ExperimentError(Exception):
    """The experiment's own preconditions did not hold, so its observations mean nothing."""


async def run_mode(mode, make_tool=ReusedCache):
    """Run the unchanged run_agent through one delivery mode and report what history kept."""
    cache = make_tool()
    result = await run_agent(scripted_model, fixtures=DeliveryBoundary(cache, mode), limits=LIMITS)
    if cache.active != 0:
        raise ExperimentError(f"{mode}: a tool is still active")
    if cache.peak != 1:
        raise ExperimentError(f"{mode}: tools overlapped (peak {cache.peak})")
    observations = [obs for record in result["history"] for obs in record["observations"] if obs["ok"]]
    reads = [obs for obs in observations if obs["name"] == "read_partition"]
    plans = [obs for obs in observations if obs["name"] == "compute_plan"]
    return {
        "same_object_returned": len(cache.returned) == 2 and cache.returned[0] is cache.returned[1],
        "delivered_values": cache.delivered,
        "history_after": [describe(obs["arguments"]["partition"], obs["data"]) for obs in reads],
        "computed_total_cents": plans[-1]["data"]["total_cents"] if plans else None,
        "status": result["status"],
        "answer": result["answer"],
    }


async def run_experiment(make_tool=ReusedCache):
    """Run every mode in order, each with a fresh tool; return {mode: report}. Raise ExperimentError if DATA changed."""
    before = canonical(DATA)
    reports = {mode: await run_mode(mode, make_tool) for mode in MODES}
    if canonical(DATA) != before:
        raise ExperimentError("DATA changed during the experiment")
    return reports


def main():
    """Print the observations of the three modes as JSON."""
    print(json.dumps(asyncio.run(run_experiment()), ensure_ascii=False, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
