"""A fake provider on 127.0.0.1 that speaks the Responses, Chat Completions and Messages wire formats, for the SDK
lane: it checks each request as the real API would, and answers as the test's brain says.
"""

import http.server
import json
import os
import sys
import threading
import time

from test_agent_loop import AMOUNT


# ======================================================================================================================
# The helpers the tests start: a fake provider for the SDK lane, a real MCP server, a throwaway PostgreSQL, and the
# child processes that crash (each runs as `python3 tests/children.py NAME ...`).
# ======================================================================================================================

class Malformed(Exception):
    """A request the real API would answer with HTTP 400."""


def require(condition, message):
    if not condition:
        raise Malformed(message)


def wire_arguments(value):
    """Arguments as a provider reads them: the JSON object that text encodes, else the value as it came."""
    if type(value) is str:
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if type(parsed) is dict else value
    return value


def wire_text(content):
    """A message's text: a string, or a list of text parts."""
    if type(content) is str:
        return content
    require(type(content) is list and all(type(part) is dict for part in content), "content must be text or parts")
    return "".join(part.get("text", "") for part in content)


class Conversation:
    """What a request says happened: the task, then rounds of calls, each answered by exactly one output."""

    def __init__(self, task):
        self.task, self.rounds, self.owner = task, [], {}

    def call(self, call_id, name, arguments, new_round):
        require(type(call_id) is str and call_id, "a tool call needs an id")
        require(call_id not in self.owner, f"tool call id {call_id} appears twice")
        require(type(name) is str and name, "a tool call needs a name")
        if new_round or not self.rounds:
            self.rounds.append({"calls": [], "outputs": {}})
        self.rounds[-1]["calls"].append({"id": call_id, "name": name, "arguments": wire_arguments(arguments)})
        self.owner[call_id] = self.rounds[-1]

    def output(self, call_id, text, is_error=None):
        require(call_id in self.owner, f"no tool call {call_id} for this output")
        require(call_id not in self.owner[call_id]["outputs"], f"a second output for {call_id}")
        require(type(text) is str, "a tool output must be a string")
        require(is_error is None or type(is_error) is bool, "is_error must be a boolean")
        self.owner[call_id]["outputs"][call_id] = {"text": text, "is_error": is_error}

    def unanswered(self):
        return [cid for cid, owner in self.owner.items() if cid not in owner["outputs"]]

    def results(self):
        """{tool name: [data of each successful output, in order]}, read back from the replayed outputs."""
        done = {}
        for record in self.rounds:
            for item in record["calls"]:
                result = json.loads(record["outputs"][item["id"]]["text"])
                if result["ok"]:
                    done.setdefault(item["name"], []).append(result["data"])
        return done


def offered_tools(body, key, schema_key):
    tools = body.get("tools", [])
    require(type(tools) is list, "tools must be a list")
    names = []
    for tool in tools:
        declared = tool.get("function") if key == "chat" else tool
        require(type(declared) is dict and type(declared.get("name")) is str, "a tool needs a name")
        require(key == "messages" or tool.get("type") == "function", "a tool's type must be function")
        require(type(declared.get(schema_key)) is dict and declared[schema_key].get("type") == "object",
                f"a tool's {schema_key} must be a schema of type object")
        names.append(declared["name"])
    return names


def read_responses(body):
    items = body.get("input")
    require(type(body.get("model")) is str, "model is required")
    require(type(items) is list and items and all(type(item) is dict for item in items), "input must be a list of items")
    require(items[0].get("role") == "user", "the first input item must be a user message")
    talk, previous = Conversation(wire_text(items[0].get("content"))), None
    for item in items[1:]:
        kind = item.get("type", "message")
        if kind == "function_call":
            require(set(item) == {"type", "call_id", "name", "arguments"}, "a function_call has unknown keys")
            require(type(item["arguments"]) is str, "function_call arguments must be a string")
            talk.call(item["call_id"], item["name"], item["arguments"], previous != "function_call")
        elif kind == "function_call_output":
            require(set(item) == {"type", "call_id", "output"}, "a function_call_output has unknown keys")
            talk.output(item["call_id"], item["output"])
        else:
            require(kind == "message" and item.get("role") in ("user", "assistant"), "an unknown input item")
            wire_text(item.get("content"))
        previous = kind
    require(not talk.unanswered(), "every function call needs its output")
    return talk, offered_tools(body, "responses", "parameters")


def read_chat(body):
    messages = body.get("messages")
    require(type(body.get("model")) is str, "model is required")
    require(type(messages) is list and messages and all(type(m) is dict for m in messages), "messages must be a list")
    require(messages[0].get("role") == "user", "the first message must be the user's")
    talk, waiting = Conversation(wire_text(messages[0].get("content"))), set()
    for m in messages[1:]:
        role = m.get("role")
        require(role == "tool" or not waiting, "tool_calls must be answered by tool messages before anything else")
        if role == "tool":
            require(set(m) == {"role", "tool_call_id", "content"} and m["tool_call_id"] in waiting,
                    "a tool message must answer a waiting tool call")
            waiting.discard(m["tool_call_id"])
            talk.output(m["tool_call_id"], m["content"])
        else:
            require(role in ("user", "assistant"), "an unknown role")
            tool_calls = m.get("tool_calls") or []
            require(m.get("content") is not None or tool_calls, "a message needs content")
            for index, tool_call in enumerate(tool_calls):
                function = tool_call.get("function") or {}
                require(tool_call.get("type") == "function" and type(function.get("arguments")) is str,
                        "a tool call's arguments must be a string")
                talk.call(tool_call.get("id"), function.get("name"), function["arguments"], index == 0)
                waiting.add(tool_call["id"])
    require(not waiting, "every tool call needs its tool message")
    return talk, offered_tools(body, "chat", "parameters")


def read_messages(body):
    messages = body.get("messages")
    require(type(body.get("model")) is str, "model is required")
    require(type(body.get("max_tokens")) is int, "max_tokens is required")
    require(type(messages) is list and messages and all(type(m) is dict for m in messages), "messages must be a list")
    talk, expected = Conversation(wire_text(messages[0].get("content"))), []
    for index, m in enumerate(messages):
        require(m.get("role") == ("user", "assistant")[index % 2], "roles must alternate, starting with user")
        blocks = m["content"] if type(m.get("content")) is list else [{"type": "text", "text": wire_text(m.get("content"))}]
        if m["role"] == "user":
            results = [block for block in blocks if block.get("type") == "tool_result"]
            require(blocks[:len(results)] == results, "tool_result blocks must come first")
            require(sorted(block.get("tool_use_id") for block in results) == sorted(expected),
                    "each tool_use needs a tool_result in the next message, and no other")
            for block in results:
                require(set(block) <= {"type", "tool_use_id", "content", "is_error"}, "a tool_result has unknown keys")
                talk.output(block["tool_use_id"], block.get("content"), block.get("is_error"))
            expected = []
        else:
            uses = [block for block in blocks if block.get("type") == "tool_use"]
            for number, block in enumerate(uses):
                require(set(block) == {"type", "id", "name", "input"}, "a tool_use has unknown keys")
                require(type(block["input"]) is dict, "a tool_use input must be an object")
                talk.call(block["id"], block["name"], block["input"], number == 0)
            expected = [block["id"] for block in uses]
    require(not expected, "the last tool_use blocks were never answered")
    return talk, offered_tools(body, "messages", "input_schema")


def new_id(prefix):
    return prefix + os.urandom(8).hex()


def reply_responses(body, action):
    cut = bool(action.get("cut_off"))
    output = []
    if "refusal" in action:
        output.append({"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "completed",
                       "content": [{"type": "refusal", "refusal": action["refusal"]}]})
    elif "text" in action:
        output.append({"id": new_id("msg_"), "type": "message", "role": "assistant",
                       "status": "incomplete" if cut else "completed",
                       "content": [{"type": "output_text", "text": action["text"], "annotations": [], "logprobs": []}]})
    for call_id, name, arguments in action.get("calls", ()):
        output.append({"id": new_id("fc_"), "type": "function_call", "status": "completed", "name": name,
                       "call_id": call_id or new_id("call_"),
                       "arguments": arguments if type(arguments) is str else json.dumps(arguments)})
    now = int(time.time())
    return {"id": new_id("resp_"), "object": "response", "created_at": now, "model": body["model"], "output": output,
            "status": "incomplete" if cut else "completed", "completed_at": None if cut else now, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": body.get("tools", []),
            "text": {"format": {"type": "text"}, "verbosity": "medium"},
            "usage": action.get("usage", {
                "input_tokens": 10, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15})}


def reply_chat(body, action):
    tool_calls = [{"id": call_id or new_id("call_"), "type": "function",
                   "function": {"name": name, "arguments": arguments if type(arguments) is str else json.dumps(arguments)}}
                  for call_id, name, arguments in action.get("calls", ())]
    message = {"role": "assistant", "content": action.get("text"), "refusal": action.get("refusal"), "annotations": []}
    if tool_calls:
        message["tool_calls"] = tool_calls
    finish = "length" if action.get("cut_off") else "tool_calls" if tool_calls else "stop"
    return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()), "model": body["model"],
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": action.get("usage", {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15})}


def reply_messages(body, action):
    text = action.get("refusal", action.get("text"))
    content = [{"type": "text", "text": text}] if text is not None else []
    content += [{"type": "tool_use", "id": call_id or new_id("toolu_"), "name": name, "input": wire_arguments(arguments)}
                for call_id, name, arguments in action.get("calls", ())]
    stop = ("refusal" if "refusal" in action else "max_tokens" if action.get("cut_off")
            else "tool_use" if action.get("calls") else "end_turn")
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": body["model"], "content": content,
            "stop_reason": stop, "stop_sequence": None,
            "usage": action.get("usage", {"input_tokens": 10, "output_tokens": 5, "cache_creation_input_tokens": 0,
                                          "cache_read_input_tokens": 0})}


PROVIDER_PATHS = {"/v1/responses": ("responses", read_responses, reply_responses),
                  "/v1/chat/completions": ("chat", read_chat, reply_chat),
                  "/v1/messages": ("messages", read_messages, reply_messages)}


def error_body(api, status, text):
    if api == "messages":
        kind = "invalid_request_error" if status < 500 else "api_error"
        return {"type": "error", "error": {"type": kind, "message": text}}
    return {"error": {"message": text, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": None, "code": None}}


class ProviderHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except OSError:  # the client stopped waiting
            pass

    def do_POST(self):
        fake = self.server.fake
        api, read, reply = PROVIDER_PATHS[self.path]
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        try:
            talk, tools = read(body)
        except (Malformed, AttributeError, KeyError, TypeError) as error:
            fake.record(api, body, 400)
            return self.send(400, error_body(api, 400, str(error)))
        action = fake.brain(api, talk, tools)
        while "sleep" in action:
            time.sleep(action["sleep"])
            action = action["then"]
        status = action.get("status", 200)
        fake.record(api, body, status)
        self.send(status, reply(body, action) if status == 200 else error_body(api, status, "a fake failure"))


class QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        if not issubclass(sys.exc_info()[0], OSError):  # a client that hung up is no news; anything else is
            super().handle_error(request, client_address)


class FakeProvider:
    """The three APIs on 127.0.0.1: each valid request is answered by brain(api, conversation, tool names), which
    returns an action: {"calls": [(id or None, name, arguments)]}, {"text": ...}, {"refusal": ...},
    {"cut_off": True, "text": ...}, {"status": 500}, or {"sleep": seconds, "then": action}; "usage", the reply's own,
    as the API spells it."""

    def __init__(self, brain):
        self.brain, self.seen, self.lock = brain, [], threading.Lock()
        self.server = None

    @property
    def url(self):
        """The provider's address. Its server starts when the address is first asked for: a test that skips
        because its SDK is missing starts nothing."""
        if self.server is None:
            self.server = QuietServer(("127.0.0.1", 0), ProviderHandler)
            self.server.fake = self
            # A short poll: shutdown() waits for the serving loop to look, 0.5 s at the default.
            threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True).start()
        return "http://127.0.0.1:%d" % self.server.server_address[1]

    def record(self, api, body, status):
        with self.lock:
            self.seen.append((api, body, status))

    def statuses(self):
        return [status for _, _, status in self.seen]

    def close(self):
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def inventory_brain(api, talk, tools):
    """The inventory task, decided from the outputs the request replays: read both, plan from the rows, answer."""
    done = talk.results()
    reads = {data["partition"]: data["rows"] for data in done.get("read_partition", [])}
    missing = [partition for partition in ("north", "south") if partition not in reads]
    if missing:
        return {"calls": [(None, "read_partition", {"partition": partition}) for partition in missing]}
    if "compute_plan" not in done:
        return {"calls": [(None, "compute_plan", {"rows": reads["north"] + reads["south"]})]}
    return {"text": json.dumps(done["compute_plan"][-1])}


def conversion_brain(api, talk, tools):
    """The conversion task of the own-prototype tests, decided from the replayed outputs."""
    done = talk.results()
    if "get_rate" not in done:
        return {"calls": [(None, "get_rate", {"base": "EUR", "quote": "USD"})]}
    rate = done["get_rate"][-1]["rate_micros"]
    if "convert" not in done:
        return {"calls": [(None, "convert", {"amount_cents": AMOUNT, "rate_micros": rate})]}
    converted = done["convert"][-1]
    return {"text": json.dumps({key: converted[key] for key in ("amount_cents", "rate_micros", "converted_cents")})}
