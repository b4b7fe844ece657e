"""PART 7: a refused batch as an observation (on_refused="observe"), so a model can correct itself.
"""

import asyncio
import dataclasses
import time

import agent_loop
from agent_loop import call, fake_model, Fixtures, Limits, run_agent, scripted, TOOLS, ToolSpec
from test_agent_loop import calls, never_accept, PLAN, ROOMY, RuntimeTestCase


# PART 7: a refused batch as an observation (on_refused="observe"), so a model can correct itself

async def learner(history):
    """A model that sends a bad argument first, then reads the refusal and does the task right."""
    if not history:
        return calls(call("bad", partition="east"), call("ok", partition="north"))
    return await fake_model(history)


async def never_learns(history):
    return calls(call(f"bad{len(history)}", partition="east"))


class ObservedRefusalTests(RuntimeTestCase):
    """PART 7: on_refused="observe": a refused batch becomes a round of failed observations; what still stops the run."""

    async def test_a_refused_calls_id_is_used_and_cannot_run_later(self):
        model = scripted(calls(call("a", partition="../north")), calls(call("a", partition="north")))
        fixtures = Fixtures()
        result = await run_agent(model, on_refused="observe", fixtures=fixtures, limits=ROOMY)
        self.assertEqual((result["status"], fixtures.started), ("duplicate_call_id", []))

    async def test_a_model_that_corrects_a_refused_batch_completes_when_refusals_are_observed(self):
        fixtures = Fixtures()
        result = await run_agent(learner, fixtures=fixtures, limits=ROOMY)  # the article's strictness: the default
        self.assertEqual((result["status"], fixtures.started), ("invalid_arguments", []))
        fixtures = Fixtures()
        result = await run_agent(learner, fixtures=fixtures, limits=ROOMY, on_refused="observe")
        self.assertEqual((result["status"], result["answer"]), ("completed", PLAN))
        self.assertEqual(result["used"], {"rounds": 4, "calls": 3, "credits": 20})  # the refused round: paid, no calls
        self.assertNotIn("bad", fixtures.started)
        self.assertNotIn("ok", fixtures.started)  # the valid call beside the bad one did not start either
        refused = result["history"][0]
        self.assertEqual([(obs["call_id"], obs["ok"], obs["error"], obs["retryable"], obs["reason"])
                          for obs in refused["observations"]],
                         [("bad", False, "invalid_arguments", True, "partition: not one of the allowed values"),
                          ("ok", False, "invalid_arguments", True, "another call of the batch was refused")])
        self.assertEqual(result["trace"][1], {"event": "refused", "round": 1, "status": "invalid_arguments",
                                              "ids": ["bad", "ok"], "call_id": "bad", "name": "read_partition",
                                              "reason": "partition: not one of the allowed values",
                                              "rounds": 1, "calls": 0, "credits": 3})

    async def test_a_model_that_never_learns_ends_on_its_budget(self):
        for limits, status in ((ROOMY, "round_limit"), (dataclasses.replace(ROOMY, credits=10), "credit_limit"),
                               (dataclasses.replace(ROOMY, total_seconds=0.3), "deadline")):
            async def model(history, slow=status == "deadline"):
                if slow:
                    await asyncio.sleep(0.05)
                return await never_learns(history)

            with self.subTest(status=status):
                fixtures = Fixtures()
                result = await run_agent(model, fixtures=fixtures, limits=limits, on_refused="observe")
                self.assertEqual((result["status"], result["used"]["calls"], fixtures.started), (status, 0, []))

    async def test_what_still_stops_when_refusals_are_observed(self):
        north, east = call("n", partition="north"), call("e", partition="east")
        cases = [  # (decisions, status): each stops at its last decision, nothing recorded as refused
            ((calls(*(call(c, partition="north") for c in "abc")),), "repeat_limit"),
            ((calls(call("a", partition="north"), call("b", partition="south")),), "call_limit"),
            ((calls("read north"),), "invalid_call"),
            ((calls({**north, "call_id": ""}),), "invalid_call_id"),
            ((calls(north), calls(east, north)), "duplicate_call_id"),  # a call id of an earlier round, after a refusal
            ((calls(east, {**east, "arguments": {"partition": "north"}}),), "duplicate_call_id"),  # an id twice
            ((calls(north), calls(call("n2", partition="north")),  # two reads of north, then an unknown tool and a third
              calls(call("x", "place_order"), call("n3", partition="north"))), "repeat_limit"),
            ((calls(call("m", "multi_tool_use.parallel")),), "unknown_tool"),  # a name no provider takes back
            ((calls(*(call(f"c{i}", partition="north") for i in range(9))),), "invalid_batch"),  # 9 calls: not a slip
            ((calls({**north, "name": 7}),), "unknown_tool"),  # a name that is not text cannot be replayed
            ((calls(),), "invalid_batch"),
        ]
        for decisions, status in cases:
            with self.subTest(status=status, decisions=decisions):
                limits = dataclasses.replace(ROOMY, calls=1) if status == "call_limit" else ROOMY
                result = await run_agent(scripted(*decisions), limits=limits, on_refused="observe")
                self.assertEqual((result["status"], result["used"]["rounds"]), (status, len(decisions)))
                self.assertNotIn("refused", [event["event"] for event in result["trace"]])

    async def test_an_observed_refusal_stops_with_the_first_calls_own_stop_whatever_comes_before_it(self):
        tools = {"t": ToolSpec(1, True, True, parameters={"type": "object", "additionalProperties": False})}
        cases = [  # (batch, status): the first call is refused, a later one has a stop of its own
            ([call("a", "nope"), call("b", "bad name"), call("", "t")], "invalid_call_id"),
            ([call("a", "nope"), call("b", "bad name"), "not a dict"], "invalid_call"),
            ([call("a", "nope"), call("b", "bad name"), call("a", "t")], "duplicate_call_id"),
            ([call("a", "nope"), ("a", "tuple")], "invalid_call"),
            ([call("a", "bad name", x={1, 2}), call("b", "t"), call("c", "t")], "repeat_limit"),
            ([call("a", "nope"), call("b", "bad name")], "unknown_tool"),  # no own stop: the refusal stops it
        ]
        for batch, status in cases:
            with self.subTest(status=status, batch=repr(batch)[:60]):
                result = await run_agent(scripted(calls(*batch)), registry=tools, fixtures=agent_loop.FunctionTools({"t": dict}),
                                         limits=dataclasses.replace(ROOMY, attempts=1), accept=never_accept,
                                         on_refused="observe")
                self.assertEqual((result["status"], result["history"]), (status, []))

    async def test_a_refusal_decided_after_the_deadline_says_deadline(self):
        self.allowBlockingSteps()

        def late_no(*args):
            time.sleep(0.5)
            return False

        limits = Limits(tool_seconds=5, model_seconds=5, total_seconds=0.3)
        registry = {"read_partition": dataclasses.replace(TOOLS["read_partition"], validate=late_no)}
        for options in ({"registry": registry}, {"registry": registry, "on_refused": "observe"}, {"accept": late_no}):
            with self.subTest(options=sorted(options)):
                result = await run_agent(limits=limits, **options)
                self.assertEqual(result["status"], "deadline")

    async def test_on_refused_and_on_event_must_be_what_they_say(self):
        for options, message in (({"on_refused": "retry"}, "on_refused must be 'stop' or 'observe'"),
                                 ({"on_event": "print"}, "on_event must be a function or None")):
            with self.subTest(message=message):
                with self.assertRaises(ValueError) as raised:
                    await run_agent(limits=ROOMY, **options)
                self.assertEqual(str(raised.exception), message)
