"""PART 9: tools from an MCP server, from a fake session, and from a real server over stdio (the SDK lane).
"""

import asyncio
import dataclasses
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import unittest
import unittest.mock

import agent_loop
from agent_loop import call, canonical, run_agent, scripted
from test_agent_loop import (
    any_answer, calls, code_blocks, errors, final, HERE, never_accept, observations, readme_section, ROOMY,
    RuntimeTestCase, SLOW_ROOMY, wait_until,
)
from tests.support import child_command, installed


# PART 9: tools from an MCP server. A fake session speaks the protocol's dicts (camelCase) or hands out objects
# whose model_dump() gives the official SDK's snake_case; the SDK lane starts a real server over stdio.

def protocol_tool(name, properties, description="", **annotations):
    tool = {"name": name, "description": description,
            "inputSchema": {"type": "object", "properties": properties, "required": list(properties),
                            "title": f"{name}Arguments"}}
    if annotations:
        tool["annotations"] = annotations
    return tool


SKU = {"sku": {"title": "Sku", "type": "string"}}
LISTED = {"tools": [
    protocol_tool("read_stock", SKU, "Stock of one sku."),
    protocol_tool("lookup", {"code": {"title": "Code", "type": "string"}}, "Country of a code."),
    protocol_tool("write_note", {"text": {"type": "string"}}, "Appends a note.", readOnlyHint=True),
]}


def snake_case(value):
    """What the official SDK 2.x's model_dump() gives: the same fields, spelt in snake_case."""
    names = {"inputSchema": "input_schema", "outputSchema": "output_schema", "isError": "is_error",
             "structuredContent": "structured_content", "readOnlyHint": "read_only_hint"}
    if type(value) is dict:
        return {names.get(key, key): item if key in ("inputSchema", "outputSchema", "structuredContent")
                else snake_case(item)
                for key, item in value.items()}
    return [snake_case(item) for item in value] if type(value) is list else value


class Dumped:
    """An SDK result object: model_dump() gives its snake_case dict."""

    def __init__(self, value):
        self.value = value

    def model_dump(self):
        return snake_case(self.value)


def text_result(*texts, error=False, structured=None):
    result = {"content": [{"type": "text", "text": text} for text in texts], "isError": error}
    if structured is not None:
        result["structuredContent"] = structured
    return result


class FakeSession:
    """A client session: answers call_tool from a function per tool, and records each call and cancellation."""

    def __init__(self, answers):
        self.answers, self.asked, self.cancelled = answers, [], []

    async def list_tools(self):
        return LISTED

    async def call_tool(self, name, arguments):
        self.asked.append((name, arguments))
        try:
            return await self.answers[name](**arguments)
        except asyncio.CancelledError:
            self.cancelled.append(name)
            raise


async def stock(sku):
    return text_result(json.dumps({"sku": sku, "stock": 12}), structured={"sku": sku, "stock": 12})


async def country(code):
    if code != "FR":
        return text_result(f"unknown code {code!r}", error=True)
    return text_result("France", structured={"result": "France"})


def country_answer(answer, history):
    """The final check of the MCP task: the answer is what the last successful lookup said."""
    found = [obs["data"] for record in history for obs in record["observations"] if obs["ok"] and obs["name"] == "lookup"]
    return bool(found) and canonical(answer) == canonical(found[-1]["result"])


def borrowed(value):
    """The session's own object, handed over as it is."""
    return value


class RefreshingSession:
    """A session that keeps the result it returned and refreshes it in place for the next call: a result cache."""

    def __init__(self, shape, structured):
        self.shape, self.structured, self.kept = shape, structured, None

    async def call_tool(self, name, arguments):
        if self.kept is None:
            self.kept = text_result(json.dumps({"sku": "CUP", "stock": 4}), "CUP: 4",
                                    structured={"sku": "CUP", "stock": 4} if self.structured else None)
        else:  # the stock is 0 now: refresh what was returned before
            if self.structured:
                self.kept["structuredContent"]["stock"] = 0
            self.kept["content"][1]["text"] = "CUP: 0"
        return self.shape(self.kept)


class ReturningSession:
    """A session whose call_tool returns one fixed object, whatever it is asked."""

    def __init__(self, result):
        self.result = result

    async def call_tool(self, name, arguments):
        return self.result


class McpTests(RuntimeTestCase):
    """PART 9: MCP tools: only the tools you name are registered, their results become plain data, and calls are bounded."""

    def test_only_the_tools_you_name_are_registered_whatever_the_server_hints(self):
        for how, listed in (("the protocol's dict", LISTED), ("the SDK's dump", snake_case(LISTED)),
                            ("the SDK's object", Dumped(LISTED))):
            with self.subTest(how=how):
                registry = agent_loop.mcp_registry(listed, read_only=("read_stock", "lookup"), parallel_safe=("lookup",),
                                                   cost=2)
                self.assertEqual(list(registry), ["read_stock", "lookup"])  # write_note's readOnlyHint grants nothing
                read = registry["read_stock"]
                self.assertEqual((read.cost, read.read_only, read.parallel_safe, read.description),
                                 (2, True, False, "Stock of one sku."))
                self.assertEqual(read.parameters, LISTED["tools"][0]["inputSchema"])
                self.assertTrue(registry["lookup"].parallel_safe)

    def test_what_the_registry_cannot_honour_is_a_value_error(self):
        nested = {"tools": [{"name": "find", "inputSchema": {"type": "object", "$defs": {}, "properties": {
            "item": {"$ref": "#/$defs/Item"}}}}]}
        cases = [
            (LISTED, {"read_only": ("read_stock", "drop_table")}, "drop_table: the server does not list it"),
            (LISTED, {"read_only": ("read_stock",), "parallel_safe": ("lookup",)},
             "lookup: only a tool named in read_only can be parallel_safe"),
            (LISTED, {"read_only": "read_stock"}, "read_only and parallel_safe must be collections of tool names"),
            (nested, {"read_only": ("find",)}, "find: parameters: unsupported keyword $defs"),
        ]
        for listed, options, message in cases:
            with self.subTest(message=message):
                with self.assertRaises(ValueError) as raised:
                    agent_loop.mcp_registry(listed, **options)
                self.assertEqual(str(raised.exception), message)

    async def test_a_result_becomes_plain_data(self):
        results = [  # (what call_tool returned, what the runtime gets)
            (text_result('{"sku": "A-1", "stock": 12}', structured={"sku": "A-1", "stock": 12}), {"sku": "A-1", "stock": 12}),
            (text_result('{\n  "sku": "A-1"\n}'), {"sku": "A-1"}),  # a dict without an output schema: one JSON text
            (text_result("France"), "France"),
            (text_result("A-1", "B-2"), [{"type": "text", "text": "A-1"}, {"type": "text", "text": "B-2"}]),
        ]
        for result, data in results:
            for shape in (result, Dumped(result)):
                with self.subTest(result=result, shape=type(shape).__name__):
                    async def answer(**args):
                        return shape

                    tools = agent_loop.McpTools(FakeSession({"read_stock": answer}))
                    self.assertEqual(await tools.invoke(call("a", "read_stock", sku="A-1")), data)

    async def test_a_task_over_mcp_tools_completes_and_an_is_error_result_is_the_models_to_retry(self):
        session = FakeSession({"read_stock": stock, "lookup": country})
        registry = agent_loop.mcp_registry(await session.list_tools(), read_only=("read_stock", "lookup"))
        model = scripted(calls(call("s", "read_stock", sku="A-1"), call("x", "lookup", code="XX")),
                         calls(call("f", "lookup", code="FR")), final("France"))
        result = await run_agent(model, fixtures=agent_loop.McpTools(session), registry=registry, accept=country_answer,
                                 limits=ROOMY)
        self.assertEqual((result["status"], result["answer"]), ("completed", "France"))
        failed = observations(result)[1]
        self.assertEqual((failed["error"], failed["retryable"], failed["message"]),
                         ("tool_error", True, "unknown code 'XX'"))
        self.assertEqual(session.asked, [("read_stock", {"sku": "A-1"}), ("lookup", {"code": "XX"}), ("lookup", {"code": "FR"})])
        self.assertIn("unknown code", agent_loop.chat_messages(result["history"])[2]["content"])  # the model is told

    async def test_a_call_that_raises_returns_no_data_or_hangs_is_bounded_like_any_tool(self):
        async def raises(sku):
            raise ConnectionError("private: the session died")

        async def odd(sku):
            return {"content": [], "structuredContent": {"stock": float("nan")}}

        async def hangs(sku):
            await asyncio.sleep(30)

        # A read that lost its connection may be tried again: temporary (PART 4's tail).
        for answer, error in ((raises, "temporary"), (odd, "tool_exception"), (hangs, "tool_timeout")):
            with self.subTest(error=error):
                session = FakeSession({"read_stock": answer})
                registry = agent_loop.mcp_registry(LISTED, read_only=("read_stock",))
                result = await run_agent(scripted(calls(call("s", "read_stock", sku="A-1"))), registry=registry,
                                         fixtures=agent_loop.McpTools(session), accept=never_accept,
                                         limits=dataclasses.replace(ROOMY, rounds=1, tool_seconds=0.1))
                self.assertEqual(errors(result), [error])
                self.assertEqual(session.cancelled, ["read_stock"] if error == "tool_timeout" else [])
                self.assertNoPrivateText(result)

    async def test_text_that_is_not_plain_json_stays_text_and_an_is_error_text_is_bounded(self):
        for text in ("123456789012345678901234", "NaN", "[" * 40 + "]" * 40):
            async def answer(sku, text=text):
                return text_result(text)

            with self.subTest(text=text[:20]):
                tools = agent_loop.McpTools(FakeSession({"read_stock": answer}))
                self.assertEqual(await tools.invoke(call("a", "read_stock", sku="A-1")), text)

        async def long_error(sku):
            return text_result("x" * 100_000, error=True)

        with self.assertRaises(agent_loop.ToolError) as raised:
            await agent_loop.McpTools(FakeSession({"read_stock": long_error})).invoke(call("a", "read_stock", sku="A-1"))
        self.assertEqual(len(raised.exception.message), 1_000)

    def test_a_listing_with_more_pages_says_so_and_vendor_keywords_are_notes(self):
        listed = {"tools": [protocol_tool("read_stock", SKU)], "nextCursor": "page-2"}
        with self.assertRaises(ValueError) as raised:
            agent_loop.mcp_registry(listed, read_only=("lookup",))
        self.assertEqual(str(raised.exception),
                         "lookup: the server does not list it on this page of its listing (pass the tools of every page)")
        tool = protocol_tool("read_stock", {"sku": {"type": "string", "x-mcp-header": "X-Sku"}})
        registry = agent_loop.mcp_registry({"tools": [tool]}, read_only=("read_stock",))
        self.assertEqual(list(registry), ["read_stock"])

    async def test_arguments_are_checked_against_the_servers_schema_before_any_call(self):
        session = FakeSession({"read_stock": stock})
        registry = agent_loop.mcp_registry(LISTED, read_only=("read_stock",))
        result = await run_agent(scripted(calls(call("s", "read_stock", sku=7))), registry=registry,
                                 fixtures=agent_loop.McpTools(session), accept=never_accept, limits=ROOMY)
        self.assertEqual((result["status"], result["trace"][-1]["reason"], session.asked),
                         ("invalid_arguments", "sku: expected string", []))

    async def test_a_session_that_refreshes_its_result_in_place_cannot_rewrite_history(self):
        registry = agent_loop.mcp_registry(LISTED, read_only=("read_stock",))
        model = scripted(calls(call("r1", "read_stock", sku="CUP")), calls(call("r2", "read_stock", sku="CUP")),
                         final("read twice"))
        for shape in (borrowed, Dumped):
            for structured in (True, False):
                with self.subTest(shape=shape.__name__, structured=structured):
                    session = RefreshingSession(shape, structured)
                    result = await run_agent(model, fixtures=agent_loop.McpTools(session), registry=registry, accept=any_answer,
                                             limits=ROOMY)
                    first, second = [obs["data"] for obs in observations(result)]
                    if structured:
                        self.assertEqual((first, second), ({"sku": "CUP", "stock": 4}, {"sku": "CUP", "stock": 0}))
                    else:  # two blocks: the list of blocks, as delivered
                        self.assertEqual((first[1]["text"], second[1]["text"]), ("CUP: 4", "CUP: 0"))
                    self.assertEqual(result["status"], "completed")

    async def test_a_result_that_is_not_a_call_tool_result_ends_the_call_tool_exception(self):
        malformed = [  # what call_tool returned
            None,
            "stock: 4",
            {"jsonrpc": "2.0", "id": 1, "error": {"code": -32603, "message": "internal error"}},  # an error envelope
            {"structuredContent": {"stock": 4}},  # no content list
            {"content": "stock: 4"},
            {"content": [{"text": "stock: 4"}]},  # a block without its type
            {"content": ["stock: 4"]},
            {"content": [], "isError": "true"},  # isError is a boolean
        ]
        registry = agent_loop.mcp_registry(LISTED, read_only=("read_stock",))
        model = scripted(calls(call("s", "read_stock", sku="CUP")), final("nothing was read"))
        for returned in malformed:
            for shape in ((returned,) if type(returned) is not dict else (returned, Dumped(returned))):
                with self.subTest(returned=returned, shape=type(shape).__name__):
                    result = await run_agent(model, fixtures=agent_loop.McpTools(ReturningSession(shape)), registry=registry,
                                             accept=any_answer, limits=ROOMY)
                    self.assertEqual((result["status"], errors(result), result["used"]["rounds"]),
                                     ("tool_exception", ["tool_exception"], 1))
                    self.assertEqual(result["trace"][-1]["reason"],
                                     "the result is not an MCP CallToolResult: a content list of typed blocks")
                    self.assertNotIn("error_type", result["trace"][-1])
                    with self.assertRaises(agent_loop.McpResultError):
                        await agent_loop.McpTools(ReturningSession(shape)).invoke(call("s", "read_stock", sku="CUP"))

    async def test_a_result_whose_dump_fails_is_no_call_tool_result(self):
        class Broken:
            def __init__(self, raises):
                self.raises = raises

            def model_dump(self):
                if self.raises:
                    raise RuntimeError("private detail of a broken dump")
                return None

        registry = agent_loop.mcp_registry(LISTED, read_only=("read_stock",))
        for raises in (True, False):
            with self.subTest(raises=raises):
                result = await run_agent(scripted(calls(call("s", "read_stock", sku="CUP"))), registry=registry,
                                         fixtures=agent_loop.McpTools(ReturningSession(Broken(raises))),
                                         accept=never_accept, limits=ROOMY)
                self.assertEqual((result["status"], result["trace"][-1]["reason"]),
                                 ("tool_exception", "the result is not an MCP CallToolResult: a content list of typed blocks"))
                self.assertNoPrivateText(result)

    async def test_a_well_formed_result_still_delivers_its_data(self):
        cases = [  # (what call_tool returned, what the runtime gets)
            ({"content": [], "isError": None, "structuredContent": {"stock": 4}}, {"stock": 4}),
            ({"content": [{"type": "text", "text": "4"}]}, 4),  # no isError: the call succeeded
            ({"content": [{"type": "image", "data": "aGk=", "mimeType": "image/png"}], "isError": False},
             [{"type": "image", "data": "aGk=", "mimeType": "image/png"}]),
        ]
        for returned, data in cases:
            for shape in (returned, Dumped(returned)):
                with self.subTest(returned=returned, shape=type(shape).__name__):
                    tools = agent_loop.McpTools(ReturningSession(shape))
                    self.assertEqual(await tools.invoke(call("s", "read_stock", sku="CUP")), data)

class McpServerTests(RuntimeTestCase):
    """PART 9: a real MCP server over stdio under the runtime; skipped, saying why, without the official mcp package."""

    async def asyncSetUp(self):
        if not installed("mcp"):
            self.skipTest("the official mcp package is not installed (.ci/run installs it in its SDK lane)")
        mcp = importlib.import_module("mcp")
        self.session, self.stdio = mcp.ClientSession, importlib.import_module("mcp.client.stdio").stdio_client
        self.allowBlockingSteps()
        folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, folder)
        self.files = {name: os.path.join(folder, name) for name in ("MCP_PIDFILE", "MCP_STARTED", "MCP_NOTES")}
        self.server = mcp.StdioServerParameters(command=sys.executable, args=child_command("mcp_server")[1:], env=self.files)
        self.log = open(os.path.join(folder, "server.log"), "w")  # what the server says on stderr stays out of ours
        self.addCleanup(self.log.close)

    async def test_a_real_servers_tools_run_under_the_runtime_and_its_hints_grant_nothing(self):
        async with self.stdio(self.server, self.log) as (read, write), self.session(read, write) as session:
            await session.initialize()
            listed = await session.list_tools()
            hinted = {tool.name for tool in listed.tools if tool.annotations and tool.annotations.read_only_hint}
            self.assertEqual(hinted, {"write_note"})
            registry = agent_loop.mcp_registry(listed, read_only=("read_stock", "lookup", "slow"))
            self.assertNotIn("write_note", registry)
            tools = agent_loop.McpTools(session)

            model = scripted(calls(call("s", "read_stock", sku="A-1"), call("x", "lookup", code="XX")),
                             calls(call("f", "lookup", code="FR")), final("France"))
            result = await run_agent(model, fixtures=tools, registry=registry, accept=country_answer, limits=SLOW_ROOMY)
            self.assertEqual((result["status"], result["answer"]), ("completed", "France"))
            read, refused = observations(result)[:2]
            self.assertEqual(read["data"], {"stock": 12})
            self.assertEqual((refused["error"], refused["retryable"]), ("tool_error", True))
            self.assertIn("unknown code 'XX'", refused["message"])

            result = await run_agent(scripted(calls(call("w", "write_note", text="x"))), fixtures=tools, registry=registry,
                                     accept=never_accept, limits=SLOW_ROOMY)
            self.assertEqual(result["status"], "unknown_tool")
            self.assertFalse(os.path.exists(self.files["MCP_NOTES"]))

            limits = dataclasses.replace(SLOW_ROOMY, rounds=1, tool_seconds=0.5)
            result = await run_agent(scripted(calls(call("z", "slow", seconds=30))), fixtures=tools, registry=registry,
                                     accept=never_accept, limits=limits)
            self.assertEqual(errors(result), ["tool_timeout"])
            self.assertEqual((await tools.invoke(call("again", "read_stock", sku="B-2"))), {"stock": 0})  # still usable

    async def test_the_readmes_mcp_example_runs_as_written(self):
        (example,) = code_blocks(readme_section("Tools from an MCP server"), "python")
        folder = os.path.dirname(self.files["MCP_NOTES"])
        with open(os.path.join(folder, "your_server.py"), "w") as server:
            server.write(f"import sys\nsys.path.insert(0, {HERE!r})\nfrom tests.servers import mcp_server\nmcp_server()\n")
        namespace = {}
        exec(compile(example, "README.md", "exec"), namespace)
        model = scripted(calls(call("x", "lookup", code="XX")), calls(call("f", "lookup", code="FR")), final("France"))
        here = os.getcwd()
        path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")  # python3: this Python
        os.chdir(folder)
        try:
            with unittest.mock.patch.dict(os.environ, {"PATH": path}):
                result = await namespace["run_with_the_server"](model, country_answer)
        finally:
            os.chdir(here)
        self.assertEqual((result["status"], errors(result)), ("completed", ["tool_error"]))

    async def test_a_server_killed_in_the_middle_of_a_call_ends_it_tool_exception(self):
        async with self.stdio(self.server, self.log) as (read, write), self.session(read, write) as session:
            await session.initialize()
            registry = agent_loop.mcp_registry(await session.list_tools(), read_only=("slow",))

            async def kill_once_started():
                await wait_until(lambda: os.path.exists(self.files["MCP_STARTED"]), 30)
                with open(self.files["MCP_PIDFILE"]) as pidfile:
                    os.kill(int(pidfile.read()), signal.SIGKILL)

            killer = asyncio.create_task(kill_once_started())
            result = await run_agent(scripted(calls(call("z", "slow", seconds=60))), fixtures=agent_loop.McpTools(session),
                                     registry=registry, accept=never_accept, limits=dataclasses.replace(SLOW_ROOMY, rounds=1))
            await killer
            self.assertEqual((result["status"], errors(result)), ("tool_exception", ["tool_exception"]))
            self.assertEqual(result["trace"][-1]["error_type"], "MCPError")
