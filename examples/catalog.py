"""The large tool set chapter's numbers: 300 entries, found, loaded on demand, the bytes each bridge sends, and the
gate's five boundaries.

    python3 examples/catalog.py
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's root, for agent_loop

from agent_loop import (  # noqa: E402
    FunctionTools, run_command, chat_messages, chat_model, chat_tools, messages_input, messages_model, messages_tools,
    responses_input, responses_model, responses_tools, run_agent,
)
from examples.orders import _catalog_accepted, _catalog_model, _raised_version, order_catalog  # noqa: E402


# The large tool set chapter's numbers: 300 entries, found, loaded on demand, and the gate's five boundaries

async def _catalog_run(catalog, grants, functions, before_the_call=lambda: None):
    """A run of the chapter's catalog, and the arguments of each time orders_get started."""
    started = []

    def orders_get(**arguments):
        started.append(arguments)
        return functions["orders_get"](**arguments)

    result = await run_agent(_catalog_model(before_the_call), registry={}, accept=_catalog_accepted, catalog=catalog,
                             grants=grants, fixtures=FunctionTools({**functions, "orders_get": orders_get}))
    return result, started


def _sent(value):
    """The bytes of value as a bridge sends it: UTF-8 JSON, keys sorted, no spaces, text as it is."""
    return len(json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())


async def _after_the_load(make, key, catalog, grants, history, **options):
    """The catalog's part of the request a bridge sends after the load, as it sends it: its tools (the catalog's, the
    registry being empty) and its replayed turns (the opening task's left out)."""
    requests = []
    model = make(lambda **request: requests.append(request) or {}, "t", registry={}, catalog=catalog, grants=grants,
                 **options)
    await model(history)  # its reply, nothing, is no decision: only the request is wanted
    return _sent(requests[0]["tools"]) + _sent(requests[0][key][1:])  # [1:]: past the task "t", one user message


async def catalog_numbers():
    """Print the chapter's numbers: what is registered, discoverable and loaded; the bytes each bridge sends for
    them beside the full path; then the five boundaries, each its own outcome."""
    catalog, grants, functions = order_catalog()
    discoverable = [name for name, entry in catalog.entries.items() if entry.permission in grants]
    result, _ = await _catalog_run(catalog, grants, functions)
    search, load = (record["observations"][0] for record in result["history"][:2])
    print(f"registered {len(catalog.entries)}, discoverable {len(discoverable)} (every grant but refunds:write), "
          f"loaded {len(load['data']['tools'])} for the query \"{search['arguments']['query']}\": "
          + ", ".join(f"{found['name']}" for found in search["data"]["candidates"]))
    print(f"the run: {result['status']}, order A paid: {str(result['answer']['paid']).lower()}, used {result['used']}")
    full = {name: catalog.entries[name].spec for name in discoverable}
    resident = catalog.offered([], grants)  # what a run that loaded nothing is offered: the catalog's own two tools
    loaded = {name: catalog.entries[name].spec for name in catalog.offered(result["history"], grants)
              if name not in resident}
    bridges = (("Responses", responses_tools, responses_input), ("Chat", chat_tools, chat_messages),
               ("Messages", messages_tools, messages_input))
    rows = (("resident: the catalog's two tools, every request", lambda tools, replay: _sent(tools(resident))),
            ("the search, replayed: its call and the summaries", lambda tools, replay: _sent(replay(
                result["history"][:1]))),
            ("the load, replayed: its call and the definitions", lambda tools, replay: _sent(replay(
                result["history"][1:2]))),
            ("the loaded two, every request after the load", lambda tools, replay: _sent(tools(loaded))))
    figures = [[measure(tools, replay) for _, tools, replay in bridges] for _, measure in rows]
    print(f"\nbytes, as each bridge sends them (UTF-8 JSON){'':<14}{'Responses':>10}{'Chat':>10}{'Messages':>10}")
    for (title, _), row in zip(rows, figures):
        print(f"  {title:<58}" + "".join(f"{figure:>10,}" for figure in row))
    title = "one request after the load, the catalog's part in all"
    sent = (responses_model, "input", {}), (chat_model, "messages", {}), (messages_model, "messages", {"max_tokens": 1})
    print(f"  {title:<58}" + "".join(f"{figure:>10,}" for figure in [await _after_the_load(
        make, key, catalog, grants, result["history"][:2], **options) for make, key, options in sent]))
    print(f"  {f'the full path: all {len(full)} discoverable, every request':<58}"
          + "".join(f"{_sent(tools(full)):>10,}" for _, tools, _ in bridges))
    print("\nthe boundaries, each its own outcome:")
    print(f"  no match        search \"火星 着陆\": {catalog.search('火星 着陆', grants)}")
    tie = catalog.search("状态", grants)
    print(f"  a tie           search \"状态\": {', '.join(found['name'] for found in tie)}, one hit each: both "
          f"returned, by name")
    size = load["data"]["bytes"]
    over = catalog.load(["orders_get", "shipments_get"], grants, size - 1)
    fits = catalog.load(["orders_get", "shipments_get"], grants, size)
    print(f"  over budget     load both within {size} bytes: {len(fits['tools'])} loaded; within {size - 1}: "
          f"{over['error']}, none loaded")
    granted = set(grants)
    revoked, started = await _catalog_run(catalog, lambda: granted, functions, lambda: granted.discard("orders:read"))
    print(f"  grant revoked   orders:read revoked after the load: the run ends {revoked['status']}, orders_get "
          f"started {len(started)} times")
    raised, started = await _catalog_run(catalog, grants, functions, lambda: _raised_version(catalog, grants))
    print(f"  version raised  orders_get at version 2 after the load: the run ends {raised['status']}, orders_get "
          f"started {len(started)} times")


def main(argv=None):
    """Print the chapter's numbers: 0, or 1 with one line on standard error."""
    parser = argparse.ArgumentParser(description="300 tools: what is found, loaded and sent, beside the full path; "
                                                 "the gate's boundaries.")
    return run_command(parser, lambda *_: catalog_numbers(), parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
