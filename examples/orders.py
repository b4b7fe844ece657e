"""The chapters' order desk, shared by the examples and the tests: the inventory's write (place_order), the order
catalog of three hundred tools, and the order placed as a durable job, each with the model and final check of its run.
"""

import asyncio
import copy
import os
import sys
from dataclasses import dataclass, field, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's root, for agent_loop

from agent_loop import (  # noqa: E402
    MAX_AMOUNT, SKUS, TOOLS, Catalog, Fixtures, TemporaryError, ToolError, ToolSpec, accepted, call, canonical,
    fake_model,
)


def closed(**properties):
    """A JSON Schema object of exactly these properties, each required, and no other."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _ok_observations(history):
    """The successful observations of every round, in order."""
    return [obs for record in history for obs in record["observations"] if obs["ok"]]


# The inventory's write: place the restock order the plan computed. It has a registry of its own; TOOLS stays the
# article's, where place_order is an unknown tool.
_ORDER_LINE = closed(sku={"type": "string", "enum": list(SKUS)}, qty={"type": "integer", "minimum": 1,
                                                                       "maximum": MAX_AMOUNT},
                     cents={"type": "integer", "minimum": 0})
ORDER_TOOLS = {**TOOLS, "place_order": ToolSpec(
    3, False, False, description="Place the restock order: the plan's items, once (a write).",
    parameters=closed(items={"type": "array", "minItems": 1, "maxItems": 4, "items": _ORDER_LINE}))}


@dataclass
class OrderDesk(Fixtures):
    """The inventory's tools and its write: place_order applies an order once per idempotency key, whatever calls
    it again, and reconcile says whether a key's order applied; once it has said no, that key never applies (a
    late call with it is refused), so that the no stays true. Faults: "temporary" (nothing placed), "timeout" (it
    hangs before it places anything) and "timeout_after_apply" (it places the order, then never answers)."""

    orders: dict = field(default_factory=dict)  # idempotency key -> the order placed
    effects: list = field(default_factory=list)  # each key once per time an order applied: a key twice is a bug
    voided: set = field(default_factory=set)  # keys reconcile said did not apply

    async def invoke(self, call):
        """Read, plan, or place the order."""
        if call["name"] != "place_order":
            return await super().invoke(call)
        faults = self.failures.get("place_order")
        fault = faults.pop(0) if faults else None
        key = call["idempotency_key"]
        self.started.append(call["call_id"])
        try:
            await asyncio.sleep(0)
            if fault == "temporary":
                raise TemporaryError("private detail: the desk was busy, nothing placed")
            if fault == "timeout":
                await asyncio.sleep(10)  # it hangs before it places anything
            if key in self.voided:
                raise ToolError("this order was reconciled as not placed")
            if key not in self.orders:
                self.orders[key] = {"order": f"PO-{len(self.orders) + 1}", "items": call["arguments"]["items"]}
                self.effects.append(key)
            if fault == "timeout_after_apply":
                await asyncio.sleep(10)  # placed, but the answer never comes
            return copy.deepcopy(self.orders[key])
        finally:
            self.finished.append(call["call_id"])

    async def reconcile(self, call):
        """Whether the order of this call's idempotency key was placed."""
        order = self.orders.get(call["idempotency_key"])
        if order is None:
            self.voided.add(call["idempotency_key"])  # said no: a call with this key still on its way is refused
        return {"applied": True, "data": copy.deepcopy(order)} if order else {"applied": False}


def order_accepted(answer, history):
    """The inventory's final check, and the order placed for the plan's items: a write counts only once it is known
    to have applied (an unknown outcome is no evidence)."""
    orders = [obs for obs in _ok_observations(history) if obs["name"] == "place_order"]
    return accepted(answer, history) and any(
        canonical(obs["arguments"]) == canonical({"items": answer["items"]}) for obs in orders)


async def order_model(history):
    """fake_model, then, once the plan is computed, the order of its items; then the plan as the answer."""
    plans = [obs["data"] for obs in _ok_observations(history) if obs["name"] == "compute_plan"]
    orders = [obs for obs in _ok_observations(history) if obs["name"] == "place_order"]
    if plans and not orders:
        items = plans[-1]["items"]
        return {"kind": "calls", "calls": [call(f"r{len(history) + 1}-order", "place_order", items=items)]}
    return await fake_model(history)


_ORDER_ID = closed(order_id={"type": "string", "pattern": "^[A-Z][0-9]{0,8}$"})


# The large tool set chapter's fixture: an order assistant grown to three hundred tools.

def order_catalog():
    """The chapter's fixture: (catalog, grants, functions): 300 entries (orders_get, shipments_get, refunds_create,
    a write, reports_export, and 296 archives), an identity with every grant but refunds:write, and a function for
    each entry."""
    catalog = Catalog()
    catalog.add("orders_get", ToolSpec(1, True, True, parameters=_ORDER_ID, description=(
        "Get one order: its status, whether it is paid, and its total in cents.")),
        keywords=("订单", "查询", "状态", "支付", "order", "status"), permission="orders:read")
    catalog.add("shipments_get", ToolSpec(1, True, True, parameters=_ORDER_ID, description=(
        "Get the shipment of one order: its carrier and delivery status.")),
        keywords=("物流", "发货", "状态", "shipment"), permission="shipments:read")
    catalog.add("refunds_create", ToolSpec(3, False, False, parameters=_ORDER_ID, description=(
        "Refund one order in full (a write).")), keywords=("退款", "订单", "refund"), permission="refunds:write")
    catalog.add("reports_export", ToolSpec(2, True, True, parameters=closed(month={"type": "string", "pattern": (
        "^[0-9]{4}-[0-9]{2}$")}), description="Export one month's sales report."),
        keywords=("报表", "导出", "report"), permission="reports:read")
    for n in range(1, 297):
        catalog.add(f"archive_{n:03}_get", ToolSpec(1, True, True, parameters=_ORDER_ID, description=(
            f"Read one record of archive {n:03}, cold storage of closed orders.")),
            keywords=("归档", f"archive{n:03}"), permission="archive:read")

    def orders_get(order_id):
        return {"order_id": order_id, "status": "paid", "paid": True, "total_cents": 6000}

    def shipments_get(order_id):
        return {"order_id": order_id, "carrier": "post", "status": "delivered"}

    def refunds_create(order_id, idempotency_key):
        return {"order_id": order_id, "refunded": True}

    def reports_export(month):
        return {"month": month, "rows": 3, "total_cents": 6000}

    def archive_get(order_id):
        return {"order_id": order_id, "archived": True}

    functions = {name: archive_get for name in catalog.entries if name.startswith("archive_")}
    grants = {"orders:read", "shipments:read", "reports:read", "archive:read"}
    return catalog, grants, {**functions, "orders_get": orders_get, "shipments_get": shipments_get,
                             "refunds_create": refunds_create, "reports_export": reports_export}


def _catalog_model(before_the_call=lambda: None):
    """Search for the order's status, load the candidates, ask orders_get about order A (again, if a call of it
    failed), answer with whether it is paid; before_the_call runs as the model asks for the call (a grant revoked, a
    version raised)."""
    async def model(history):
        if not history:
            return {"kind": "calls", "calls": [call("r1-search", "search_tools", query="查询 订单 状态")]}
        if len(history) == 1:
            names = [found["name"] for found in history[0]["observations"][0]["data"]["candidates"]]
            return {"kind": "calls", "calls": [call("r2-load", "load_tools", names=names)]}
        said = [obs["data"] for record in history for obs in record["observations"]
                if obs["name"] == "orders_get" and obs["ok"]]
        if not said:
            before_the_call()
            return {"kind": "calls", "calls": [call(f"r{len(history) + 1}-order", "orders_get", order_id="A")]}
        return {"kind": "final", "answer": {"order_id": "A", "paid": said[-1]["paid"]}}

    return model


def _raised_version(catalog, granted=None):
    """orders_get, the same, at the next version: the definition a run loaded is stale from now on."""
    entry = catalog.entries["orders_get"]
    catalog.add("orders_get", entry.spec, entry.keywords, entry.permission, entry.definition["version"] + 1)


def _catalog_accepted(answer, history):
    """The answer is what orders_get said of order A."""
    said = [obs["data"] for record in history for obs in record["observations"] if obs["ok"] and obs["name"] ==
            "orders_get" and obs["arguments"] == {"order_id": "A"}]
    return bool(said) and answer == {"order_id": "A", "paid": said[-1]["paid"]}


# The inventory's order as a job: submitted by the run, placed by a job worker, its receipt the run's answer.
JOB_ORDER_TOOLS = {**ORDER_TOOLS, "place_order": replace(ORDER_TOOLS["place_order"], job=True)}


def place_order_job(items, progress):
    """The order's job, for work_jobs: each line placed in turn, its progress saved; the order's receipt."""
    for done in range(1, len(items) + 1):
        progress(done, len(items))
    return {"order": "PO-1", "lines": len(items), "total_cents": sum(item["cents"] for item in items)}


async def receipt_model(history):
    """order_model, answering with the order's receipt once the order has been placed."""
    orders = [obs["data"] for obs in _ok_observations(history) if obs["name"] == "place_order"]
    return {"kind": "final", "answer": copy.deepcopy(orders[-1])} if orders else await order_model(history)


def receipt_accepted(answer, history):
    """The answer is the receipt of an order of exactly the plan's items, the plan recomputed from the evidence."""
    plans = [obs["data"] for obs in _ok_observations(history) if obs["name"] == "compute_plan"]
    return bool(plans) and accepted(plans[-1], history) and any(
        canonical(obs["arguments"]) == canonical({"items": plans[-1]["items"]}) and canonical(obs["data"]) ==
        canonical(answer) for obs in _ok_observations(history) if obs["name"] == "place_order")
