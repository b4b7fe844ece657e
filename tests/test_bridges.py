"""PART 8: the OpenAI Responses, OpenAI Chat Completions and Anthropic Messages bridges, with literal replies shaped
like the providers' documented ones, and through the official SDKs against a fake provider (the SDK lane).
"""

import asyncio
import copy
import dataclasses
import functools
import importlib
import json
import os
import random
import subprocess
import sys
import textwrap
import threading

import agent_loop
from agent_loop import call, DATA, fake_model, Fixtures, Limits, run_agent, TOOLS, ToolSpec
from test_agent_loop import (
    ALL_ROWS, calls, code_blocks, conversion_accepted, CONVERSION_TOOLS, final, HERE, INVENTORY_DECLARATIONS, PLAN,
    RateDesk, readme_section, ROOMY, RuntimeTestCase, schema, SEED,
)
from tests.support import (
    anthropic_reply, BRIDGES, chat_reply, fc, installed, later, message, output_text, Recorder, responses_reply,
    text_block, tool_call, tool_use,
)
from tests.providers import conversion_brain, FakeProvider, inventory_brain


def garbage_replies(rng, count):
    """Replies shaped like the providers' with plain data of the wrong type in random places."""
    shapes = [responses_reply(message(output_text("x")), fc("c", "read_partition", {"partition": "north"})),
              chat_reply("x", [tool_call("c", "read_partition", {"partition": "north"})], "tool_calls"),
              anthropic_reply(text_block("x"), tool_use("c", "read_partition", {"partition": "north"}), stop_reason="tool_use")]
    junk = [None, 0, 7.5, True, "", "text", [], [1, "a"], {}, {"type": "function_call"}, [{"type": None}]]

    def spoil(value, depth=0):
        if type(value) is dict and value and rng.random() < 0.8:
            key = rng.choice(list(value))
            return {**value, key: spoil(value[key], depth + 1) if rng.random() < 0.6 else rng.choice(junk)}
        if type(value) is list and value and rng.random() < 0.8:
            index = rng.randrange(len(value))
            return value[:index] + [spoil(value[index], depth + 1)] + value[index + 1:]
        return rng.choice(junk)

    return [spoil(rng.choice(shapes)) for _ in range(count)]


def closed(**property_schema):
    """An object schema with one required property, a, of property_schema: closed, as strict mode requires."""
    return {"type": "object", "properties": {"a": property_schema}, "required": ["a"], "additionalProperties": False}


class ProviderBridgeTests(RuntimeTestCase):
    """PART 8: the three bridges on literal replies: tools offered, replies read, history replayed, what never answers."""

    def test_the_tools_offered_are_exactly_the_inventorys_strict_declarations(self):
        responses = [{"type": "function", "name": name, "description": tool["description"],
                      "parameters": tool["parameters"], "strict": True} for name, tool in INVENTORY_DECLARATIONS.items()]
        chat = [{"type": "function", "function": {"name": name, "description": tool["description"],
                                                  "parameters": tool["parameters"], "strict": True}}
                for name, tool in INVENTORY_DECLARATIONS.items()]
        self.assertEqual(agent_loop.responses_tools(), responses)
        self.assertEqual(agent_loop.chat_tools(), chat)
        offered = agent_loop.responses_tools()
        offered[0]["parameters"]["properties"].clear()  # a caller's edit does not reach the declarations
        self.assertEqual(agent_loop.responses_tools(), responses)

    async def test_an_sdk_reply_is_read_through_its_model_dump(self):
        class SdkReply:
            """What the official SDKs return: an object whose model_dump() is the documented dict."""

            def __init__(self, reply):
                self.reply = reply

            def model_dump(self):
                return copy.deepcopy(self.reply)

        for make_model, replies in (
            (agent_loop.responses_model, [responses_reply(fc("n", "read_partition", {"partition": "north"}),
                                                          fc("s", "read_partition", {"partition": "south"})),
                                          responses_reply(fc("p", "compute_plan", {"rows": ALL_ROWS})),
                                          responses_reply(message(output_text(json.dumps(PLAN))))]),
            (agent_loop.chat_model, [chat_reply(None, [tool_call("n", "read_partition", {"partition": "north"}),
                                                       tool_call("s", "read_partition", {"partition": "south"})]),
                                     chat_reply(None, [tool_call("p", "compute_plan", {"rows": ALL_ROWS})]),
                                     chat_reply(json.dumps(PLAN))]),
        ):
            with self.subTest(bridge=make_model.__name__):
                model = make_model(Recorder(*[SdkReply(reply) for reply in replies]), "task")
                result = await run_agent(model, limits=ROOMY)
                self.assertEqual((result["status"], result["used"]), ("completed", {"rounds": 3, "calls": 3, "credits": 17}))

    def test_an_unknown_incomplete_reason_says_incomplete(self):
        for reason in ("some_future_reason", None):
            with self.subTest(reason=reason):
                reply = responses_reply(message(output_text(json.dumps(PLAN))), status="incomplete", reason=reason)
                self.assertEqual(agent_loop.from_responses(reply), {"kind": "incomplete"})

    def test_the_chat_replay_is_the_documented_message_list(self):
        north, south = call("n", partition="north"), call("s", partition="south")
        history = [{"round": 1, "calls": [north, south], "observations": [
            {**north, "ok": True, "data": {"rows": []}},
            {**south, "ok": False, "error": "temporary", "retryable": True}]}]
        self.assertEqual(agent_loop.chat_messages(history), [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "n", "type": "function", "function": {"name": "read_partition", "arguments": '{"partition": "north"}'}},
                {"id": "s", "type": "function", "function": {"name": "read_partition", "arguments": '{"partition": "south"}'}}]},
            {"role": "tool", "tool_call_id": "n", "content": '{"ok": true, "data": {"rows": []}}'},
            {"role": "tool", "tool_call_id": "s", "content": '{"ok": false, "error": "temporary", "retryable": true}'},
        ])
        self.assertEqual(agent_loop.responses_input(history), [
            {"type": "function_call", "call_id": "n", "name": "read_partition", "arguments": '{"partition": "north"}'},
            {"type": "function_call", "call_id": "s", "name": "read_partition", "arguments": '{"partition": "south"}'},
            {"type": "function_call_output", "call_id": "n", "output": '{"ok": true, "data": {"rows": []}}'},
            {"type": "function_call_output", "call_id": "s", "output": '{"ok": false, "error": "temporary", "retryable": true}'},
        ])

    def test_the_call_id_is_responses_call_id_and_chats_tool_call_id(self):
        decision = agent_loop.from_responses(responses_reply(fc("call_7", "read_partition", {"partition": "north"}, item_id="fc_99")))
        self.assertEqual(decision, calls(call("call_7", partition="north")))
        decision = agent_loop.from_chat(chat_reply(tool_calls=[tool_call("call_8", "read_partition", {"partition": "south"})],
                                                   finish_reason="tool_calls"))
        self.assertEqual(decision, calls(call("call_8", partition="south")))

    async def test_arguments_that_are_not_a_json_object_stay_raw_and_nothing_runs(self):
        for text in ('{"partition": "north"', '["north"]', '"north"', "null", "", '{"partition":"north","partition":"south"}'):
            for model in (agent_loop.responses_model(Recorder(responses_reply(fc("c1", "read_partition", text))), "task"),
                          agent_loop.chat_model(Recorder(chat_reply(tool_calls=[tool_call("c1", "read_partition", text)])), "task")):
                with self.subTest(text=text):
                    self.assertEqual((await model([]))["calls"][0]["arguments"], text)  # kept as the raw text
                    fixtures = Fixtures()
                    result = await run_agent(model, fixtures=fixtures, limits=ROOMY)
                    self.assertEqual((result["status"], result["used"]["calls"], fixtures.started), ("invalid_arguments", 0, []))

    def test_any_function_call_makes_a_calls_decision_even_with_text_beside_it(self):
        north = call("c1", partition="north")
        reply = responses_reply(message(output_text("Let me look.")), fc("c1", "read_partition", {"partition": "north"}))
        self.assertEqual(agent_loop.from_responses(reply), calls(north))
        reply = chat_reply("Let me look.", [tool_call("c1", "read_partition", {"partition": "north"})], finish_reason="stop")
        self.assertEqual(agent_loop.from_chat(reply), calls(north))

    def test_text_without_calls_is_final_parsed_as_json_when_it_is_json(self):
        for text, answer in ((json.dumps(PLAN), PLAN), ("The total is 21900 cents.", "The total is 21900 cents."), ("7", 7)):
            with self.subTest(text=text):
                self.assertEqual(agent_loop.from_responses(responses_reply(message(output_text(text)))), final(answer))
                self.assertEqual(agent_loop.from_chat(chat_reply(text)), final(answer))

    async def test_refusals_and_cut_off_or_empty_replies_never_answer(self):
        north = {"partition": "north"}
        cases = [
            (agent_loop.responses_model, responses_reply(message({"type": "refusal", "refusal": "I can't help with that."})), "refusal"),
            (agent_loop.responses_model, responses_reply(message(output_text(json.dumps(PLAN))), status="incomplete",
                                                         reason="max_output_tokens"), "truncated"),
            (agent_loop.responses_model, responses_reply(status="incomplete", reason="content_filter"), "content_filter"),
            (agent_loop.responses_model, responses_reply(fc("c1", "read_partition", north), status="failed"), "failed"),
            (agent_loop.responses_model, responses_reply(), "empty"),
            (agent_loop.responses_model, responses_reply(message(output_text("  "))), "empty"),
            (agent_loop.chat_model, chat_reply(refusal="I can't help with that."), "refusal"),
            (agent_loop.chat_model, chat_reply(json.dumps(PLAN)[:40], finish_reason="length"), "truncated"),
            (agent_loop.chat_model, chat_reply("", finish_reason="content_filter"), "content_filter"),
            (agent_loop.chat_model, chat_reply(None, [tool_call("c1", "read_partition", north)], finish_reason="length"), "truncated"),
            (agent_loop.chat_model, chat_reply(None), "empty"),
            (agent_loop.chat_model, {"choices": []}, "malformed"),
            (agent_loop.chat_model, chat_reply(json.dumps(PLAN), finish_reason=None), "malformed"),
            (agent_loop.chat_model, chat_reply(json.dumps(PLAN), finish_reason="error"), "error"),
            (agent_loop.responses_model, {"output": [message(output_text(json.dumps(PLAN)))],
                                          "incomplete_details": {"reason": "max_output_tokens"}}, "malformed"),
            (agent_loop.responses_model, responses_reply(message(output_text(json.dumps(PLAN))), status="in_progress"),
             "in_progress"),
        ]
        for make_model, reply, kind in cases:
            with self.subTest(kind=kind, reply=reply):
                fixtures = Fixtures()
                result = await run_agent(make_model(Recorder(reply), "task"), fixtures=fixtures, limits=ROOMY)
                self.assertEqual((result["status"], result["trace"][0]["kind"]), ("invalid_decision", kind))
                self.assertEqual((result["used"]["rounds"], fixtures.started, result["answer"]), (1, [], None))

    async def test_two_calls_with_one_id_reach_preflight_as_they_are(self):
        north, south = {"partition": "north"}, {"partition": "south"}
        responses = Recorder(responses_reply(fc("dup", "read_partition", north), fc("dup", "read_partition", south)))
        chat = Recorder(chat_reply(tool_calls=[tool_call("dup", "read_partition", north), tool_call("dup", "read_partition", south)]))
        for model in (agent_loop.responses_model(responses, "task"), agent_loop.chat_model(chat, "task")):
            fixtures = Fixtures()
            result = await run_agent(model, fixtures=fixtures, limits=ROOMY)
            self.assertEqual((result["status"], fixtures.started), ("duplicate_call_id", []))

    async def test_end_to_end_through_the_responses_format(self):
        create = Recorder(
            responses_reply(fc("call_n", "read_partition", {"partition": "north"}), fc("call_s", "read_partition", {"partition": "south"})),
            responses_reply(fc("call_p", "compute_plan", {"rows": ALL_ROWS})),
            responses_reply(message(output_text(json.dumps(PLAN)))),
        )
        result = await run_agent(agent_loop.responses_model(create, "Plan the restock.", model="some-model", temperature=0),
                                 limits=ROOMY)
        self.assertEqual((result["status"], result["answer"]["total_cents"]), ("completed", 21900))
        self.assertEqual(result["used"], {"rounds": 3, "calls": 3, "credits": 17})
        self.assertEqual(len(create.requests), 3)
        for request in create.requests:
            self.assertEqual((request["model"], request["temperature"], request["tools"]),
                             ("some-model", 0, agent_loop.responses_tools()))
            self.assertEqual(request["input"][0], {"role": "user", "content": "Plan the restock."})
        third = create.requests[2]["input"][1:]
        self.assertEqual([(item["type"], item["call_id"]) for item in third], [
            ("function_call", "call_n"), ("function_call", "call_s"),
            ("function_call_output", "call_n"), ("function_call_output", "call_s"),
            ("function_call", "call_p"), ("function_call_output", "call_p")])
        self.assertEqual(create.requests[1]["input"][1:], third[:4])
        self.assertEqual(json.loads(third[0]["arguments"]), {"partition": "north"})
        north, plan = json.loads(third[2]["output"]), json.loads(third[5]["output"])
        self.assertEqual((north["ok"], north["data"]["partition"], north["data"]["rows"]), (True, "north", DATA["north"]))
        self.assertEqual(plan, {"ok": True, "data": PLAN})

    async def test_your_own_registry_runs_unchanged_through_every_bridge(self):
        answer = {"amount_cents": 12345, "rate_micros": 1085000, "converted_cents": 13394}
        for name, (make_model, options, calls_reply, text_reply) in BRIDGES.items():
            with self.subTest(bridge=name):
                create = Recorder(calls_reply(("r", "get_rate", {"base": "EUR", "quote": "USD"})),
                                  calls_reply(("c", "convert", {"amount_cents": 12345, "rate_micros": 1085000})),
                                  text_reply(json.dumps(answer)))
                desk = RateDesk()
                model = make_model(create, "Convert 123.45 EUR to USD.", CONVERSION_TOOLS, model="m", **options)
                result = await run_agent(model, fixtures=agent_loop.FunctionTools(desk.functions()), registry=CONVERSION_TOOLS,
                                         accept=conversion_accepted, limits=ROOMY)
                self.assertEqual((result["status"], result["answer"], desk.ran), ("completed", answer, ["get_rate", "convert"]))
                offered = create.requests[0]["tools"]
                names = [tool.get("name") or tool["function"]["name"] for tool in offered]
                self.assertEqual(names, ["get_rate", "convert"])

    def test_each_bridge_offers_the_registrys_declarations(self):
        rate = CONVERSION_TOOLS["get_rate"]
        self.assertEqual(agent_loop.responses_tools(CONVERSION_TOOLS)[0], {
            "type": "function", "name": "get_rate", "description": rate.description, "parameters": rate.parameters, "strict": True})
        self.assertEqual(agent_loop.chat_tools(CONVERSION_TOOLS)[0], {"type": "function", "function": {
            "name": "get_rate", "description": rate.description, "parameters": rate.parameters, "strict": True}})
        self.assertEqual(agent_loop.messages_tools(CONVERSION_TOOLS)[0], {
            "name": "get_rate", "description": rate.description, "input_schema": rate.parameters})
        self.assertEqual([tool["name"] for tool in agent_loop.messages_tools()], ["read_partition", "compute_plan"])

    def test_a_tool_is_offered_strict_only_where_its_schema_meets_the_strict_rules(self):
        closed = {"a": {"type": "string"}}
        cases = [  # (parameters, strict)
            (schema(properties=closed, required=["a"], additionalProperties=False), True),
            (schema(properties=closed, required=[], additionalProperties=False), False),  # a property not required
            (schema(properties=closed, required=["a"]), False),  # an open object
            (schema(properties={"a": {"type": "array", "items": schema(properties=closed)}}, required=["a"],
                    additionalProperties=False), False),  # an open object inside
            (schema(properties={"a": {"anyOf": [{"type": "null"}, schema(properties=closed, required=["a"],
                                                                          additionalProperties=False)]}},
                    required=["a"], additionalProperties=False), True),
            (schema(properties={"a": {}}, required=["a"], additionalProperties=False), False),  # untyped: anything
            (schema(properties={"a": {"additionalProperties": {"type": "integer"}}}, required=["a"],
                    additionalProperties=False), False),  # an open map without a type
            (schema(properties={"a": {"type": "array"}}, required=["a"], additionalProperties=False), False),  # any items
            (schema(properties={"a": {"enum": [1, "x"]}}, required=["a"], additionalProperties=False), True),
            # anyOf: never at the root, and never beside a rule of its own, which strict mode would not check
            (schema(properties=closed, anyOf=[schema(properties=closed, required=["a"], additionalProperties=False)]),
             False),
            (schema(anyOf=[schema(properties=closed, required=["a"], additionalProperties=False)]), False),
            (schema(properties={"a": {"anyOf": [{"type": "null"}, {"type": "string"}], "minLength": 2}},
                    required=["a"], additionalProperties=False), False),
            (schema(properties={"a": {"anyOf": [{"type": "null"}, {"type": "string"}], "description": "a or null"}},
                    required=["a"], additionalProperties=False), True),
        ]
        for parameters, strict in cases:
            with self.subTest(parameters=parameters):
                registry = {"tool": ToolSpec(1, True, True, parameters=parameters)}
                self.assertIs(agent_loop.responses_tools(registry)[0]["strict"], strict)
                self.assertIs(agent_loop.chat_tools(registry)[0]["function"]["strict"], strict)

    def test_a_tool_the_providers_cannot_be_offered_is_refused_when_the_model_is_built(self):
        cases = [
            ({"tool": ToolSpec(1, True, True, validate=lambda args: True)}, "tool: no parameters to offer the model"),
            ({"read.file": ToolSpec(1, True, True, parameters=schema())}, "read.file: a tool name must be 1 to 64 letters, digits, _ or -"),
            ({"tool": ToolSpec(1, True, True, parameters=schema(oneOf=[]))}, "tool: parameters: unsupported keyword oneOf"),
        ]
        for registry, message in cases:
            for name, (make_model, options, _, _) in BRIDGES.items():
                with self.subTest(bridge=name, message=message):
                    with self.assertRaises(ValueError) as raised:
                        make_model(Recorder(), "task", registry, **options)
                    self.assertEqual(str(raised.exception), message)
        with self.assertRaises(ValueError) as raised:
            agent_loop.messages_model(Recorder(), "task")
        self.assertEqual(str(raised.exception), "messages_model needs max_tokens: the Messages API requires it")

    def test_messages_tool_use_blocks_are_calls_and_text_alone_is_the_answer(self):
        north = {"partition": "north"}
        cases = [  # (reply, decision)
            (anthropic_reply(text_block("Reading."), tool_use("toolu_1", "read_partition", north), stop_reason="tool_use"),
             calls(call("toolu_1", partition="north"))),
            (anthropic_reply(tool_use("toolu_1", "read_partition", "north"), stop_reason="tool_use"),
             calls({"call_id": "toolu_1", "name": "read_partition", "arguments": "north"})),  # stays as it came
            (anthropic_reply(text_block(json.dumps(PLAN))), final(PLAN)),
            (anthropic_reply(text_block("The total is "), text_block("21900.")), final("The total is 21900.")),
            (anthropic_reply(text_block("I can't help with that."), stop_reason="refusal"), {"kind": "refusal"}),
            (anthropic_reply(text_block(json.dumps(PLAN)[:30]), stop_reason="max_tokens"), {"kind": "truncated"}),
            (anthropic_reply(tool_use("toolu_1", "read_partition", north), stop_reason="max_tokens"), {"kind": "truncated"}),
            (anthropic_reply(stop_reason="model_context_window_exceeded"), {"kind": "truncated"}),
            (anthropic_reply(text_block("Searching..."), stop_reason="pause_turn"), {"kind": "paused"}),
            (anthropic_reply(), {"kind": "empty"}),
            (anthropic_reply(text_block(json.dumps(PLAN)), stop_reason=None), {"kind": "malformed"}),
            (anthropic_reply(text_block(json.dumps(PLAN)), stop_reason="a_new_reason"), {"kind": "a_new_reason"}),
            (anthropic_reply(text_block(json.dumps(PLAN)), stop_reason="stop_sequence"), final(PLAN)),
            (anthropic_reply(text_block("  ")), {"kind": "empty"}),
        ]
        for reply, decision in cases:
            with self.subTest(reply=reply):
                self.assertEqual(agent_loop.from_messages(reply), decision)

    def test_the_messages_replay_alternates_roles_and_answers_every_tool_use(self):
        north, south = call("n", partition="north"), call("s", partition="south")
        history = [{"round": 1, "calls": [north, south], "observations": [
            {**north, "ok": True, "data": {"rows": []}},
            {**south, "ok": False, "error": "temporary", "retryable": True}]}]
        self.assertEqual(agent_loop.messages_input(history), [
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "n", "name": "read_partition", "input": {"partition": "north"}},
                {"type": "tool_use", "id": "s", "name": "read_partition", "input": {"partition": "south"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "n", "content": '{"ok": true, "data": {"rows": []}}'},
                {"type": "tool_result", "tool_use_id": "s", "content": '{"ok": false, "error": "temporary", "retryable": true}',
                 "is_error": True}]},
        ])

    async def test_end_to_end_through_the_messages_format(self):
        create = Recorder(
            anthropic_reply(tool_use("toolu_n", "read_partition", {"partition": "north"}),
                            tool_use("toolu_s", "read_partition", {"partition": "south"}), stop_reason="tool_use"),
            anthropic_reply(tool_use("toolu_p", "compute_plan", {"rows": ALL_ROWS}), stop_reason="tool_use"),
            anthropic_reply(text_block(json.dumps(PLAN))),
        )
        model = agent_loop.messages_model(create, "Plan the restock.", model="some-model", max_tokens=1024)
        result = await run_agent(model, limits=ROOMY)
        self.assertEqual((result["status"], result["used"]), ("completed", {"rounds": 3, "calls": 3, "credits": 17}))
        third = create.requests[2]
        self.assertEqual((third["model"], third["max_tokens"], third["tools"]), ("some-model", 1024, agent_loop.messages_tools()))
        self.assertEqual([m["role"] for m in third["messages"]], ["user", "assistant", "user", "assistant", "user"])
        self.assertEqual(third["messages"][0], {"role": "user", "content": "Plan the restock."})
        self.assertEqual([block["tool_use_id"] for block in third["messages"][2]["content"]], ["toolu_n", "toolu_s"])

    async def test_end_to_end_through_the_chat_format_with_an_async_create(self):
        replies = Recorder(
            chat_reply(None, [tool_call("call_n", "read_partition", {"partition": "north"}),
                              tool_call("call_s", "read_partition", {"partition": "south"})], finish_reason="tool_calls"),
            chat_reply(None, [tool_call("call_p", "compute_plan", {"rows": ALL_ROWS})], finish_reason="tool_calls"),
            chat_reply(json.dumps(PLAN)),
        )

        async def create(**request):
            return replies(**request)

        result = await run_agent(agent_loop.chat_model(create, "Plan the restock.", model="some-model"), limits=ROOMY)
        self.assertEqual((result["status"], result["answer"]["total_cents"]), ("completed", 21900))
        messages = replies.requests[2]["messages"]
        self.assertEqual([(m["role"], m.get("tool_call_id")) for m in messages], [
            ("user", None), ("assistant", None), ("tool", "call_n"), ("tool", "call_s"), ("assistant", None), ("tool", "call_p")])
        self.assertEqual([tc["id"] for tc in messages[1]["tool_calls"]], ["call_n", "call_s"])
        self.assertEqual(messages[1]["tool_calls"][0]["function"], {"name": "read_partition", "arguments": '{"partition": "north"}'})
        self.assertEqual(json.loads(messages[5]["content"]), {"ok": True, "data": PLAN})
        self.assertEqual(replies.requests[0]["tools"], agent_loop.chat_tools())

    def test_every_call_gets_one_output_failures_and_batch_aborted_included(self):
        north, south = call("n", partition="north"), call("s", partition="south")
        history = [{"round": 1, "calls": [north, south], "observations": [
            {**north, "ok": False, "error": "permission_denied", "retryable": False},
            {**south, "ok": False, "error": "batch_aborted", "retryable": False}]}]
        outputs = [item for item in agent_loop.responses_input(history) if item["type"] == "function_call_output"]
        self.assertEqual([(item["call_id"], json.loads(item["output"])) for item in outputs], [
            ("n", {"ok": False, "error": "permission_denied", "retryable": False}),
            ("s", {"ok": False, "error": "batch_aborted", "retryable": False})])
        tools = [m for m in agent_loop.chat_messages(history) if m["role"] == "tool"]
        self.assertEqual([(m["tool_call_id"], json.loads(m["content"])["error"]) for m in tools],
                         [("n", "permission_denied"), ("s", "batch_aborted")])

    async def test_a_blocking_create_runs_in_a_thread_so_the_model_time_limit_holds(self):
        gate = threading.Event()

        def blocking_create(**request):
            gate.wait(30)
            return responses_reply()

        result = await run_agent(agent_loop.responses_model(blocking_create, "task"),
                                 limits=dataclasses.replace(ROOMY, model_seconds=0.2))
        gate.set()
        self.assertEqual((result["status"], result["used"]["rounds"]), ("model_timeout", 1))

    async def test_a_model_that_cannot_be_asked_is_a_value_error_before_the_run(self):
        async def streams(history):
            yield {"kind": "final", "answer": None}

        class Model:
            async def __call__(self, history):
                return await fake_model(history)

        for model in (None, {"kind": "final"}, Model, streams):
            with self.subTest(model=model), self.assertRaises(ValueError) as raised:
                await run_agent(model)
            self.assertEqual(str(raised.exception), "model must be an async function of history")
        self.assertEqual((await run_agent(Model()))["status"], "completed")  # an object of it is a model
        self.assertEqual((await run_agent(lambda history: fake_model(history)))["status"], "completed")

        def plain(history):  # nothing tells it from the lambda above before it is called
            return {"kind": "final", "answer": None}

        class PlainInvoke:
            def invoke(self, call):
                return {}

        result = await run_agent(plain)
        self.assertEqual((result["status"], result["used"]["rounds"], result["trace"][-1]["error_type"]),
                         ("model_exception", 1, "TypeError"))
        result = await run_agent(fixtures=PlainInvoke())
        self.assertEqual((result["status"], result["trace"][-1]["error_type"]), ("tool_exception", "TypeError"))
        for bridge in (agent_loop.responses_model, agent_loop.chat_model):
            for create in (None, "client.responses.create", Model):
                with self.subTest(bridge=bridge.__name__, create=create), self.assertRaises(ValueError) as raised:
                    bridge(create, "the task")
                self.assertEqual(str(raised.exception),
                                 "create must be your client's method, such as client.responses.create")
        with self.assertRaises(ValueError):
            agent_loop.messages_model(None, "the task", max_tokens=100)

    async def test_every_bridge_replays_a_refused_round_so_the_model_can_correct_itself(self):
        for name, (make_model, options, calls_reply, text_reply) in BRIDGES.items():
            with self.subTest(bridge=name):
                bad = '{"partition": "east"' if name != "messages" else {"partition": "east"}
                create = Recorder(calls_reply(("c1", "read_partition", bad)),
                                  calls_reply(("c2", "read_partition", {"partition": "north"}),
                                              ("c3", "read_partition", {"partition": "south"})),
                                  calls_reply(("c4", "compute_plan", {"rows": ALL_ROWS})),
                                  text_reply(json.dumps(PLAN)))
                result = await run_agent(make_model(create, "task", **options), limits=ROOMY, on_refused="observe")
                self.assertEqual(result["status"], "completed")
                second = json.dumps(create.requests[1])
                self.assertIn("c1", second)
                self.assertIn("partition: not one of the allowed values" if name == "messages" else
                              "arguments: not a JSON object", second)
                replayed = (agent_loop.messages_input if name == "messages" else agent_loop.chat_messages)(result["history"])
                first = replayed[0]["content"][0]["input"] if name == "messages" else \
                    replayed[0]["tool_calls"][0]["function"]["arguments"]
                self.assertEqual(first, bad if name == "messages" else "{}")  # malformed JSON goes back as {}

    async def test_a_final_text_that_is_json_but_not_plain_data_reaches_the_final_check_as_text(self):
        judged = []

        def accept(answer, history):
            judged.append(answer)
            return True

        for text in ("123456789012345678901234", "NaN", "1e999", '{"a": 1, "a": 2}', '"\\ud800"'):
            async def create(**request):
                return {"choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": text}}]}

            with self.subTest(text=text):
                model = agent_loop.chat_model(create, "Give the order id.", registry=CONVERSION_TOOLS)
                result = await run_agent(model, registry=CONVERSION_TOOLS, fixtures=agent_loop.FunctionTools(RateDesk().functions()),
                                         accept=accept, limits=ROOMY)
                self.assertEqual((result["status"], result["answer"], judged[-1]), ("completed", text, text))
        async def create(**request):
            return {"choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": '{"total": 5}'}}]}

        model = agent_loop.chat_model(create, "Give the order id.", registry=CONVERSION_TOOLS)
        result = await run_agent(model, registry=CONVERSION_TOOLS, fixtures=agent_loop.FunctionTools(RateDesk().functions()),
                                 accept=accept, limits=ROOMY)
        self.assertEqual(result["answer"], {"total": 5})  # plain JSON data is still parsed

    async def test_a_bridge_refuses_options_it_would_replace_and_takes_opening_turns_as_task(self):
        for bridge, key in ((agent_loop.responses_model, "input"), (agent_loop.chat_model, "messages")):
            for own in (key, "tools"):
                with self.subTest(bridge=bridge.__name__, option=own), self.assertRaises(ValueError) as raised:
                    bridge(lambda **request: None, "the task", **{own: []})
                self.assertTrue(str(raised.exception).startswith(f"{own}: the bridge builds it"))
        requests = []

        async def create(**request):
            requests.append(request)
            return {"choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": "done"}}]}

        opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the task"}]
        model = agent_loop.chat_model(create, opening, registry=CONVERSION_TOOLS, model="m")
        result = await run_agent(model, registry=CONVERSION_TOOLS, fixtures=agent_loop.FunctionTools(RateDesk().functions()),
                                 accept=lambda answer, history: answer == "done", limits=ROOMY)
        self.assertEqual((result["status"], requests[0]["messages"]), ("completed", opening))
        opening.append({"role": "user", "content": "changed later"})
        await model([])
        self.assertEqual(len(requests[-1]["messages"]), 2)  # the bridge keeps its own copy of the turns
        for task in ("", [], [{"role": "user", "content": float("nan")}], ["text"], None):
            with self.subTest(task=task), self.assertRaises(ValueError):
                agent_loop.chat_model(create, task)

    async def test_a_stop_iteration_from_a_plain_create_is_a_model_exception(self):
        def no_match(**args):
            return next(iter([]))

        result = await run_agent(agent_loop.responses_model(no_match, "task"), limits=ROOMY)
        self.assertEqual(result["status"], "model_exception")

    async def test_a_plain_create_that_is_admitted_actually_starts(self):
        plain_create = Recorder(responses_reply(message(output_text(json.dumps(PLAN)))))
        result = await run_agent(agent_loop.responses_model(plain_create, "task"), limits=ROOMY)
        self.assertEqual((result["status"], len(plain_create.requests)), ("invalid_final", 1))

    async def test_whatever_create_returns_as_an_awaitable_is_awaited(self):
        reply = responses_reply(message(output_text("an answer")))

        async def create(**request):
            return reply

        class AsyncCreate:
            async def __call__(self, **request):
                return reply

        for create_method in (AsyncCreate(), functools.partial(create), lambda **request: create(**request)):
            with self.subTest(create=create_method):
                result = await run_agent(agent_loop.responses_model(create_method, "task"), limits=ROOMY)
                self.assertEqual((result["status"], result["trace"][0]["kind"]), ("invalid_final", "final"))

    def test_malformed_replies_never_make_a_bridge_raise(self):
        rng = random.Random(SEED)
        for reply in garbage_replies(rng, 600):
            for read in (agent_loop.from_responses, agent_loop.from_chat, agent_loop.from_messages):
                with self.subTest(reply=reply, read=read.__name__):
                    decision = read(reply)
                    self.assertIs(type(decision), dict)
                    self.assertIs(type(decision["kind"]), str)

    def test_a_tool_is_offered_strict_only_within_openais_documented_strict_subset(self):
        cases = [  # (parameters, strict)
            (closed(type="string", minLength=1), False),  # pydantic's Field(min_length=1)
            (closed(type="string", maxLength=8), False),
            (closed(type="string", default="x"), False),
            (closed(type="string", title="A"), False),  # pydantic titles every property
            (closed(type="string", examples=["x"]), False),
            (closed(type="string", deprecated=True), False),
            (closed(type="string", **{"x-note": "a vendor's"}), False),
            ({**closed(type="string"), "title": "toolArguments"}, False),  # at the root too
            ({**closed(type="string"), "$schema": "https://json-schema.org/draft/2020-12/schema"}, False),
            (closed(type="string", format="uri"), False),  # a format strict mode does not list
            (closed(anyOf=[{"type": "null"}, {"type": "string"}], default=None), False),
            (closed(anyOf=[{"type": "null"}, {"type": "string"}], pattern="^a"), False),  # a rule beside anyOf
            (closed(type="string", format="email"), True),
            (closed(type="string", format="date-time", pattern="^2[0-9]{3}-"), True),
            (closed(type="integer", minimum=0, maximum=9, exclusiveMinimum=-1, exclusiveMaximum=10), True),
            (closed(type="array", items={"type": "string", "enum": ["x", "y"]}, minItems=1, maxItems=2), True),
            (closed(type=["string", "null"], description="what a is"), True),
            (closed(const="x"), True),
            (closed(anyOf=[{"type": "null"}, {"type": "string"}], description="a or null"), True),
        ]
        for parameters, strict in cases:
            with self.subTest(parameters=parameters):
                registry = {"tool": ToolSpec(1, True, True, parameters=parameters)}
                self.assertIs(agent_loop.responses_tools(registry)[0]["strict"], strict)
                self.assertIs(agent_loop.chat_tools(registry)[0]["function"]["strict"], strict)
                self.assertNotIn("strict", agent_loop.messages_tools(registry)[0])  # the Messages bridge never sends it

    async def test_a_schema_edited_after_its_first_use_is_not_offered_either(self):
        parameters = {"type": "object", "properties": {"code": {"type": "string", "enum": ["EUR"]}}, "required": ["code"],
                      "additionalProperties": False}
        registry = {"rate": ToolSpec(1, True, True, parameters=parameters)}
        self.assertIsNone(registry["rate"]._schema_check({"code": "EUR"}))  # first read: preflight has it now
        parameters["properties"]["code"]["enum"].append("USD")  # edited afterwards
        offered = agent_loop.responses_tools(registry)[0]["parameters"]
        self.assertEqual(offered["properties"]["code"]["enum"], ["EUR"])  # what preflight checks is what is offered
        self.assertIsNotNone(registry["rate"]._schema_check({"code": "USD"}))

    def test_the_inventory_tools_stay_strict(self):
        self.assertEqual([tool["strict"] for tool in agent_loop.responses_tools()], [True, True])
        self.assertEqual([tool["function"]["strict"] for tool in agent_loop.chat_tools()], [True, True])



SDK_MISSING = {"responses": not installed("openai"), "chat": not installed("openai"), "messages": not installed("anthropic")}
MAKE_MODEL = {"responses": later("responses_model"), "chat": later("chat_model"), "messages": later("messages_model")}


class SdkLaneTests(RuntimeTestCase):
    """PART 8: the bridges through the official SDKs and a fake provider; each test skips where its SDK is missing."""

    async def asyncSetUp(self):
        self.allowBlockingSteps()  # an SDK's first request builds its models on the loop

    def provider(self, brain):
        fake = FakeProvider(brain)
        self.addCleanup(fake.close)
        return fake

    def create(self, api, fake, asynchronous, **client_options):
        """The official client's create method for api, pointed at the fake provider."""
        if SDK_MISSING[api]:
            self.skipTest(f"the official {'anthropic' if api == 'messages' else 'openai'} package is not installed "
                          "(.ci/run installs it in its SDK lane)")
        options = {"api_key": "test", "max_retries": 0, "timeout": 30, **client_options}
        if api == "messages":
            anthropic = importlib.import_module("anthropic")
            client = (anthropic.AsyncAnthropic if asynchronous else anthropic.Anthropic)(base_url=fake.url, **options)
        else:
            openai = importlib.import_module("openai")
            client = (openai.AsyncOpenAI if asynchronous else openai.OpenAI)(base_url=fake.url + "/v1", **options)
        if asynchronous:
            self.addAsyncCleanup(client.close)
        else:
            self.addCleanup(client.close)
        if api == "messages":
            return client.messages.create
        return client.responses.create if api == "responses" else client.chat.completions.create

    def model(self, api, create, task="Plan the restock.", registry=TOOLS):
        options = {"model": "fake-model", **({"max_tokens": 1024} if api == "messages" else {})}
        return MAKE_MODEL[api](create, task, registry, **options)

    async def test_the_inventory_task_completes_on_every_api_with_sync_and_async_clients(self):
        for api in MAKE_MODEL:
            for asynchronous in (False, True):
                with self.subTest(api=api, asynchronous=asynchronous):
                    fake = self.provider(inventory_brain)
                    model = self.model(api, self.create(api, fake, asynchronous))
                    result = await run_agent(model, limits=ROOMY)
                    self.assertEqual((result["status"], result["answer"]), ("completed", PLAN))
                    self.assertEqual(result["used"], {"rounds": 3, "calls": 3, "credits": 17})
                    self.assertEqual(fake.statuses(), [200, 200, 200])  # every replay was well formed

    async def test_your_own_registry_completes_on_every_api(self):
        for api in MAKE_MODEL:
            for asynchronous in (False, True):
                with self.subTest(api=api, asynchronous=asynchronous):
                    fake, desk = self.provider(conversion_brain), RateDesk()
                    model = self.model(api, self.create(api, fake, asynchronous), "Convert 123.45 EUR to USD.",
                                       CONVERSION_TOOLS)
                    result = await run_agent(model, fixtures=agent_loop.FunctionTools(desk.functions()), registry=CONVERSION_TOOLS,
                                             accept=conversion_accepted, limits=ROOMY)
                    self.assertEqual((result["status"], desk.ran), ("completed", ["get_rate", "convert"]))
                    offered = fake.seen[0][1]["tools"]
                    self.assertEqual([tool.get("name") or tool["function"]["name"] for tool in offered],
                                     ["get_rate", "convert"])

    async def test_malformed_arguments_start_no_tool(self):
        bad = {"responses": '{"partition": "north"', "chat": '{"partition": "north"', "messages": {"partition": "east"}}
        for api, arguments in bad.items():
            with self.subTest(api=api):
                fake, fixtures = self.provider(lambda *_, a=arguments: {"calls": [(None, "read_partition", a)]}), Fixtures()
                result = await run_agent(self.model(api, self.create(api, fake, True)), fixtures=fixtures, limits=ROOMY)
                self.assertEqual((result["status"], result["used"]["calls"], fixtures.started), ("invalid_arguments", 0, []))

    async def test_a_model_corrects_its_malformed_arguments_on_every_api_when_refusals_are_observed(self):
        bad = {"responses": '{"partition": "north"', "chat": '{"partition": "north"', "messages": {"partition": "east"}}
        for api, arguments in bad.items():
            def brain(api, talk, tools, arguments=arguments):
                if not talk.rounds:
                    return {"calls": [(None, "read_partition", arguments)]}
                return inventory_brain(api, talk, tools)  # it saw the refusal: no read succeeded, so it reads again

            with self.subTest(api=api):
                fake = self.provider(brain)
                result = await run_agent(self.model(api, self.create(api, fake, True)), limits=ROOMY, on_refused="observe")
                self.assertEqual((result["status"], result["used"]["rounds"]), ("completed", 4))
                self.assertEqual(fake.statuses(), [200] * 4)  # the provider took every replay, the refused round's too

    def run_readme(self, fake, code):
        """Run code as a user would, in a Python of its own, its SDK clients pointed at the fake provider."""
        env = {**os.environ, "OPENAI_BASE_URL": fake.url + "/v1", "OPENAI_API_KEY": "test",
               "ANTHROPIC_BASE_URL": fake.url, "ANTHROPIC_API_KEY": "test"}
        return subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True,
                              timeout=120, check=False)

    async def test_the_readmes_real_model_example_runs_as_written(self):
        if not installed("openai") or not installed("anthropic"):
            self.skipTest("the official openai and anthropic packages are not installed (.ci/run installs them)")
        example = code_blocks(readme_section("Connect a real model"), "python")[0]
        fake = self.provider(inventory_brain)
        done = await asyncio.to_thread(self.run_readme, fake, example)
        self.assertEqual((done.returncode, done.stderr), (0, ""))
        self.assertEqual(done.stdout.splitlines(), [f"completed {PLAN}"] * 3)

    async def test_the_readmes_own_task_runs_unchanged_with_a_real_model(self):
        if not installed("openai"):
            self.skipTest("the official openai package is not installed (.ci/run installs it)")
        (scripted_block,) = code_blocks(readme_section("Copy it into your own prototype"), "python")
        real_block = textwrap.dedent('''
            from openai import AsyncOpenAI
            from agent_loop import Limits, responses_model


            async def ask_a_real_model():
                async with AsyncOpenAI(timeout=30, max_retries=1) as client:
                    model = responses_model(client.responses.create, "Convert 123.45 EUR to USD.", registry,
                                            model="gpt-4.1")
                    return await run_agent(model, registry=registry, fixtures=tools, accept=check,
                                           limits=Limits(model_seconds=60, total_seconds=300))
        ''')

        def brain(api, talk, tools):
            done = talk.results()
            if "get_rate" not in done:
                return {"calls": [(None, "get_rate", {"base": "EUR", "quote": "USD"})]}
            if "convert" not in done:
                return {"calls": [(None, "convert", {"amount_cents": 12345, "rate_micros": done["get_rate"][-1]["rate_micros"]})]}
            return {"text": json.dumps(done["convert"][-1])}

        fake = self.provider(brain)
        code = scripted_block + real_block + '\nresult = asyncio.run(ask_a_real_model())\nprint(result["status"], result["used"])\n'
        done = await asyncio.to_thread(self.run_readme, fake, code)
        self.assertEqual((done.returncode, done.stderr), (0, ""))
        self.assertEqual(done.stdout.splitlines(), ["completed {'rounds': 3, 'calls': 2, 'credits': 11}"] * 2)
        self.assertEqual([tool["name"] for tool in fake.seen[0][1]["tools"]], ["get_rate", "convert"])

    async def test_every_replys_usage_is_summed_in_one_meaning_on_every_api(self):
        # Each reply's usage as the API spells it (n: the reply's number), and what it means: input, output, cached,
        # reasoning. Messages counts the input read from and written to its cache apart from the rest.
        spelt = {
            "responses": lambda n: {"input_tokens": 100 * n, "input_tokens_details": {"cached_tokens": 60 * n},
                                    "output_tokens": 10 * n, "output_tokens_details": {"reasoning_tokens": 4 * n},
                                    "total_tokens": 110 * n},
            "chat": lambda n: {"prompt_tokens": 100 * n, "prompt_tokens_details": {"cached_tokens": 60 * n},
                               "completion_tokens": 10 * n, "completion_tokens_details": {"reasoning_tokens": 4 * n},
                               "total_tokens": 110 * n},
            "messages": lambda n: {"input_tokens": 30 * n, "cache_read_input_tokens": 60 * n,
                                   "cache_creation_input_tokens": 10 * n, "output_tokens": 10 * n},
        }
        for api, usage in spelt.items():
            for asynchronous in (False, True):
                with self.subTest(api=api, asynchronous=asynchronous):
                    def brain(api, talk, tools, usage=usage):
                        return {**inventory_brain(api, talk, tools), "usage": usage(len(talk.rounds) + 1)}

                    fake = self.provider(brain)
                    result = await run_agent(self.model(api, self.create(api, fake, asynchronous)), limits=ROOMY)
                    self.assertEqual(result["status"], "completed")
                    self.assertEqual(result["usage"], {  # three replies: n = 1, 2, 3
                        "requests": 3, "input_tokens": 600, "output_tokens": 60, "cached_input_tokens": 360,
                        "reasoning_tokens": 0 if api == "messages" else 24, "unreported": 0})

    async def test_a_refusal_or_a_cut_off_reply_never_answers(self):
        for api in MAKE_MODEL:
            for action, kind in (({"refusal": "I can't help with that."}, "refusal"),
                                 ({"cut_off": True, "text": json.dumps(PLAN)[:20]}, "truncated")):
                with self.subTest(api=api, kind=kind):
                    fake = self.provider(lambda *_, a=action: a)
                    result = await run_agent(self.model(api, self.create(api, fake, True)), limits=ROOMY)
                    self.assertEqual((result["status"], result["trace"][0]["kind"], result["answer"]),
                                     ("invalid_decision", kind, None))

    async def test_an_http_error_ends_the_run_model_exception_after_the_sdks_own_retries(self):
        for api in MAKE_MODEL:
            for status, retries, requests in ((400, 2, 1), (500, 0, 1), (500, 2, 3)):  # the SDKs retry 5xx, not 400
                with self.subTest(api=api, status=status, retries=retries):
                    fake = self.provider(lambda *_, s=status: {"status": s})
                    model = self.model(api, self.create(api, fake, True, max_retries=retries))
                    result = await run_agent(model, limits=Limits(model_seconds=20, total_seconds=60))
                    self.assertEqual((result["status"], result["used"]["rounds"]), ("model_exception", 1))
                    self.assertEqual(fake.statuses(), [status] * requests)
                    self.assertEqual(result["trace"][-1]["error_type"],
                                     "BadRequestError" if status == 400 else "InternalServerError")

    async def test_a_reply_slower_than_model_seconds_ends_model_timeout(self):
        for api in MAKE_MODEL:
            for asynchronous in (True, False):
                with self.subTest(api=api, asynchronous=asynchronous):
                    fake = self.provider(lambda *_: {"sleep": 1.5, "then": {"text": "late"}})
                    loop = asyncio.get_running_loop()
                    start = loop.time()
                    result = await run_agent(self.model(api, self.create(api, fake, asynchronous)),
                                             limits=Limits(model_seconds=0.2, total_seconds=30))
                    self.assertLess(loop.time() - start, 1.2)  # returned before the reply came
                    self.assertEqual((result["status"], result["used"]["rounds"]), ("model_timeout", 1))
