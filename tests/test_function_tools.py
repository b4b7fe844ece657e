"""PART 6: your own tools, plain and async functions behind the same runtime (FunctionTools).
"""

import asyncio
import dataclasses
import functools
import gc
import json
import threading
import warnings

import agent_loop
from agent_loop import call, Fixtures, Limits, run_agent, scripted, Stop, TemporaryError, TOOLS, ToolSpec
from test_agent_loop import (
    calls, conversion_accepted, conversion_model, CONVERSION_TOOLS, errors, final, LookupTool, never_accept,
    observations, RateDesk, ROOMY, RuntimeTestCase, wait_until,
)


# PART 6: your own tools: plain and async functions behind the same runtime

class FunctionToolsTests(LookupTool, RuntimeTestCase):
    """PART 6: FunctionTools: your own plain and async functions as tools, each plain one in a thread of its own."""

    async def test_a_tool_errors_message_that_is_not_plain_text_is_not_kept(self):
        def says(partition):
            raise agent_loop.ToolError("half a pair: \ud800")

        registry = {"read_partition": TOOLS["read_partition"]}
        result = await run_agent(scripted(calls(call("a", partition="north"))), fixtures=agent_loop.FunctionTools(
            {"read_partition": says}), registry=registry, accept=never_accept, limits=dataclasses.replace(ROOMY, rounds=1))
        obs = observations(result)[0]
        self.assertEqual((obs["error"], "message" in obs), ("tool_error", False))
        json.dumps(result, ensure_ascii=False).encode()  # all of it is Unicode text

    async def run_conversion(self, desk, model=conversion_model, **options):
        tools = agent_loop.FunctionTools(desk.functions())
        options.setdefault("limits", ROOMY)
        result = await run_agent(model, fixtures=tools, registry=CONVERSION_TOOLS, accept=conversion_accepted, **options)
        return result, tools

    async def test_own_task_completes_through_the_unchanged_runtime(self):
        desk = RateDesk()
        result, tools = await self.run_conversion(desk)
        self.assertEqual(result["status"], "completed")
        self.assertEqual(result["used"], {"rounds": 3, "calls": 2, "credits": 11})
        self.assertEqual(result["answer"], {"amount_cents": 12345, "rate_micros": 1085000, "converted_cents": 13394})
        self.assertEqual((desk.ran, tools.abandoned), (["get_rate", "convert"], []))

    async def test_a_returned_object_changed_after_delivery_is_not_followed_by_history(self):
        desk = RateDesk()
        result, _ = await self.run_conversion(desk)
        self.assertEqual(desk.cache[("EUR", "USD")]["rate_micros"], 1_085_001)  # the tool changed its object
        self.assertEqual(result["history"][0]["observations"][0]["data"]["rate_micros"], 1_085_000)
        self.assertEqual(result["status"], "completed")

    async def test_own_validator_refuses_a_call_and_nothing_starts(self):
        desk = RateDesk()
        model = scripted(calls(call("r1", "get_rate", base="EUR", quote="USD"), call("r2", "get_rate", base="EUR", quote="EUR")))
        result, _ = await self.run_conversion(desk, model)
        self.assertEqual(result["status"], "invalid_arguments")
        self.assertEqual((result["used"]["calls"], desk.ran), (0, []))

    async def test_a_plain_function_that_times_out_is_abandoned_and_its_late_result_dropped(self):
        gate, desk, views = threading.Event(), RateDesk(), []
        desk.block_first_convert = gate

        async def model(history):
            if any(obs.get("error") == "tool_timeout" for record in history for obs in record["observations"]):
                if not gate.is_set():
                    gate.set()  # let the abandoned thread finish before this decision
                    self.assertTrue(await tools.wait_abandoned(30))
                    views.append(history)
            return await conversion_model(history)

        tools = agent_loop.FunctionTools(desk.functions())
        limits = dataclasses.replace(ROOMY, tool_seconds=0.2)
        result = await run_agent(model, fixtures=tools, registry=CONVERSION_TOOLS, accept=conversion_accepted, limits=limits)
        self.assertEqual(result["status"], "completed")
        self.assertEqual(result["used"], {"rounds": 4, "calls": 3, "credits": 15})
        self.assertEqual(tools.abandoned, ["convert-2"])
        self.assertEqual(desk.ran, ["get_rate", "convert", "convert"])  # the first thread ran to its end
        self.assertEqual(errors(result), ["tool_timeout"])
        attempts = [obs["data"].get("attempt") for obs in observations(result) if obs["ok"]]
        self.assertEqual(attempts, [None, 2])  # the late result of attempt 1 reached no round
        self.assertEqual(len(views), 1)
        self.assertNotIn(1, [obs.get("data", {}).get("attempt") for record in views[0] for obs in record["observations"]])

    async def test_two_plain_functions_in_one_parallel_batch_overlap(self):
        meeting = threading.Barrier(2, timeout=30)  # only two threads running at once can pass it

        def meet(side):
            meeting.wait()
            return {"side": side}

        registry = {"meet": ToolSpec(1, True, True, validate=lambda args: True)}
        model = scripted(calls(call("a", "meet", side="left"), call("b", "meet", side="right")))
        result = await run_agent(model, fixtures=agent_loop.FunctionTools({"meet": meet}), registry=registry, limits=ROOMY, accept=never_accept)
        self.assertEqual(result["trace"][1]["parallel"], True)
        self.assertEqual([obs["data"] for obs in observations(result)], [{"side": "left"}, {"side": "right"}])
        self.assertEqual(result["used"]["calls"], 2)

    async def test_function_exceptions_pass_through_for_the_runtime_to_classify(self):
        # SystemExit only from a thread, where it means nothing; from async code asyncio lets it end the program.
        faults = [TemporaryError("private"), PermissionError("private"), ValueError("private"), SystemExit(3)]
        for fault, error in zip(faults, ["temporary", "permission_denied", "tool_exception", "tool_exception"]):
            async def async_fails(**args):
                raise fault

            def plain_fails(**args):
                raise fault

            for function in (async_fails, plain_fails)[isinstance(fault, SystemExit):]:
                with self.subTest(fault=fault, function=function.__name__):
                    registry = {"f": ToolSpec(1, True, True, validate=lambda args: True)}
                    result = await run_agent(scripted(calls(call("a", "f"))), fixtures=agent_loop.FunctionTools({"f": function}),
                                             registry=registry, limits=dataclasses.replace(ROOMY, rounds=1), accept=never_accept)
                    self.assertEqual(errors(result), [error])
                    self.assertEqual(result["used"]["calls"], 1)
                    self.assertNoPrivateText(result)

    async def test_cancelling_a_thread_call_abandons_it(self):
        gate, cancel = threading.Event(), asyncio.Event()
        started = threading.Event()

        def waits():
            started.set()
            gate.wait(30)
            return {"late": True}

        tools = agent_loop.FunctionTools({"waits": waits})
        registry = {"waits": ToolSpec(1, True, True, validate=lambda args: True)}
        run = asyncio.create_task(run_agent(scripted(calls(call("w", "waits"))), fixtures=tools, registry=registry,
                                            cancel=cancel, limits=ROOMY, accept=never_accept))
        await wait_until(started.is_set)
        cancel.set()
        result = await run
        self.assertEqual((result["status"], errors(result), tools.abandoned), ("cancelled", ["cancelled"], ["w"]))
        self.assertFalse(await tools.wait_abandoned(0.01))
        gate.set()
        self.assertTrue(await tools.wait_abandoned(30))
        self.assertNotIn("late", repr(result))

    async def test_a_call_given_up_before_its_thread_started_never_runs(self):
        held, ran = [], []

        class Held(agent_loop.FunctionTools):
            def _start(self, work):
                held.append(work)  # no thread has picked the call up yet

        def tool(**args):
            ran.append(args)
            return {}

        tools = Held({"f": tool})
        registry = {"f": ToolSpec(1, True, True, validate=lambda args: True)}
        result = await run_agent(scripted(calls(call("a", "f"))), fixtures=tools, registry=registry,
                                 limits=dataclasses.replace(ROOMY, rounds=1, tool_seconds=0.05), accept=never_accept)
        self.assertEqual((errors(result), result["used"]["calls"]), (["tool_timeout"], 1))
        held[0]()  # the thread starts at last, after the runtime gave the call up
        self.assertEqual((ran, tools.abandoned), ([], []))

    async def test_a_cancelled_wait_for_abandoned_threads_leaves_no_unread_outcome(self):
        gate, started = threading.Event(), threading.Event()

        def fails_late():
            started.set()
            gate.wait(30)
            raise RuntimeError("private late failure")

        tools = agent_loop.FunctionTools({"f": fails_late})
        registry = {"f": ToolSpec(1, True, True, validate=lambda args: True)}
        await run_agent(scripted(calls(call("a", "f"))), fixtures=tools, registry=registry,
                        limits=dataclasses.replace(ROOMY, rounds=1, tool_seconds=0.05), accept=never_accept)
        self.assertEqual(tools.abandoned, ["a"])
        with self.assertRaises(TimeoutError):
            await asyncio.wait_for(tools.wait_abandoned(30), 0.05)
        with self.assertNoLogs("asyncio", level="ERROR"):
            gate.set()
            self.assertTrue(await tools.wait_abandoned(30))
            for _ in range(3):
                await asyncio.sleep(0)
            del tools
            gc.collect()

    async def test_a_coroutine_returned_by_an_abandoned_thread_is_closed(self):
        gate = threading.Event()

        async def convert(**args):
            return {}

        def late(**args):
            gate.wait(30)
            return convert()

        tools = agent_loop.FunctionTools({"f": late})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            await run_agent(scripted(calls(call("a", "f"))), fixtures=tools, registry={"f": ToolSpec(1, True, True, validate=lambda args: True)},
                            limits=dataclasses.replace(ROOMY, rounds=1, tool_seconds=0.05), accept=never_accept)
            gate.set()
            self.assertTrue(await tools.wait_abandoned(30))
            del tools  # the last reference to the late result
            gc.collect()
        self.assertEqual([str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)], [])

    async def test_only_the_runtimes_own_fault_names_a_class_of_its_choosing(self):
        Fault = agent_loop._Fault
        for what, error_type in ((Fault(123), "_Fault"), (Fault("password=hunter2 private"), "_Fault"),
                                 (Fault(StopIteration), "StopIteration")):
            async def model(history, what=what):
                raise what

            with self.subTest(what=what):
                result = await run_agent(model, limits=ROOMY)
                self.assertEqual((result["status"], result["trace"][-1]["error_type"]),
                                 ("model_exception", error_type))
                self.assertNoPrivateText(result)

                def tool(key, what=what):
                    raise what

                tools = agent_loop.FunctionTools({"lookup": tool})
                result = await run_agent(scripted(calls(call("a", "lookup", key="k"))), registry=self.LOOKUP,
                                         fixtures=tools, limits=ROOMY, accept=never_accept)
                self.assertEqual([(obs["error"], obs["error_type"]) for obs in observations(result)],
                                 [("tool_exception", error_type)])
        # The runtime's own faults name the class that was raised in the first place.
        for raised in (asyncio.CancelledError, GeneratorExit, Stop):
            async def model(history, raised=raised):
                raise raised("private")

            with self.subTest(model_raised=raised.__name__):
                result = await run_agent(model, limits=ROOMY)
                self.assertEqual(result["trace"][-1]["error_type"], raised.__name__)
        for raised in (SystemExit, StopIteration, KeyboardInterrupt):
            def tool(key, raised=raised):
                raise raised("private")

            with self.subTest(thread_raised=raised.__name__):
                result = await run_agent(scripted(calls(call("a", "lookup", key="k"))), registry=self.LOOKUP,
                                         fixtures=agent_loop.FunctionTools({"lookup": tool}), limits=ROOMY, accept=never_accept)
                self.assertEqual(result["trace"][-1]["error_type"], raised.__name__)
                self.assertNoPrivateText(result)

    async def test_a_stop_iteration_from_a_plain_function_is_a_fault_not_a_timeout(self):
        def no_match(**args):
            return next(iter([]))

        registry = {"f": ToolSpec(1, True, True, validate=lambda args: True)}
        result = await run_agent(scripted(calls(call("a", "f"))), fixtures=agent_loop.FunctionTools({"f": no_match}),
                                 registry=registry, limits=dataclasses.replace(ROOMY, rounds=1), accept=never_accept)
        self.assertEqual((errors(result), result["status"]), (["tool_exception"], "tool_exception"))

    async def test_abandoned_threads_never_starve_a_later_call(self):
        gate = threading.Event()
        self.addCleanup(gate.set)

        def hangs(n):
            gate.wait(30)

        def instant(n):
            return {"n": n}

        async def model(history):  # 36 hanging calls, 4 a round, then one instant call, then an answer
            number = len(history)
            if number < 9:
                return calls(*(call(f"h{number}-{i}", "hang", n=number * 4 + i) for i in range(4)))
            return calls(call("i", "instant", n=0)) if number == 9 else final("done")

        registry = {name: ToolSpec(0, True, True, validate=lambda args: True) for name in ("hang", "instant")}
        tools = agent_loop.FunctionTools({"hang": hangs, "instant": instant})
        limits = Limits(rounds=11, calls=40, credits=100, tool_seconds=0.05, model_seconds=5, total_seconds=30)
        result = await run_agent(model, fixtures=tools, registry=registry, limits=limits, accept=lambda answer, history: True)
        self.assertEqual((result["status"], len(tools.abandoned)), ("completed", 36))
        self.assertEqual(observations(result)[-1]["data"], {"n": 0})  # admitted, started and finished at once

    async def test_whatever_returns_an_awaitable_is_awaited(self):
        async def rate(base, quote):
            return {"rate_micros": 1_085_000}

        class AsyncCall:
            async def __call__(self, base, quote):
                return await rate(base, quote)

        for function in (AsyncCall(), functools.partial(rate), lambda **args: rate(**args)):
            with self.subTest(function=function):
                registry = {"get_rate": CONVERSION_TOOLS["get_rate"]}
                result = await run_agent(scripted(calls(call("r", "get_rate", base="EUR", quote="USD"))), registry=registry,
                                         fixtures=agent_loop.FunctionTools({"get_rate": function}), limits=dataclasses.replace(ROOMY, rounds=1), accept=never_accept)
                self.assertEqual(observations(result)[0]["data"], {"rate_micros": 1_085_000})

    async def test_your_own_tools_need_your_own_fixtures_functions_and_final_check(self):
        functions = RateDesk().functions()
        cases = [
            ({"registry": CONVERSION_TOOLS, "accept": conversion_accepted},
             "fixtures: the default Fixtures serve only the inventory's tools, not get_rate"),
            ({"registry": CONVERSION_TOOLS, "fixtures": agent_loop.FunctionTools(functions)},
             "accept: the default final check knows only the inventory's plan; give your task's own"),
            ({"registry": CONVERSION_TOOLS, "fixtures": agent_loop.FunctionTools({"get_rate": functions["get_rate"]}),
              "accept": conversion_accepted}, "convert: FunctionTools has no function for it"),
        ]
        for options, message in cases:
            with self.subTest(message=message):
                await self.assertRefusedBeforeTheModelIsAsked(message, **options)

    async def test_mistakes_in_what_you_give_are_value_errors_before_the_model_is_asked(self):
        async def watcher(event):
            yield event

        class Named(Exception):
            pass

        with self.assertRaises(ValueError) as raised:
            agent_loop.FunctionTools({"get": None})
        self.assertEqual(str(raised.exception), "get: not a function")
        no_invoke = "fixtures must be an object with an async invoke(call) method"
        cases = [
            ({"fixtures": {"get_rate": dict}, "registry": CONVERSION_TOOLS, "accept": conversion_accepted}, no_invoke),
            ({"fixtures": Fixtures}, no_invoke),  # the class, not an object of it
            ({"fixtures": agent_loop.FunctionTools, "registry": CONVERSION_TOOLS, "accept": conversion_accepted}, no_invoke),
            ({"fixtures": agent_loop.FunctionTools(RateDesk().functions())},
             "registry: give the registry of your FunctionTools; the default is the inventory's"),
            ({"on_event": watcher}, "on_event must be a function or None"),
            ({"on_event": dict}, "on_event must be a function or None"),  # a class: it would only make dicts
        ]
        for options, message in cases:
            with self.subTest(message=message):
                await self.assertRefusedBeforeTheModelIsAsked(message, **options)
