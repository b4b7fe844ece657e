"""What the tests of the later parts share: the providers' reply shapes, the stores' test cases, the job tools, and
how a child process is started.
"""

import concurrent.futures
import copy
import dataclasses
import importlib
import importlib.util
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

import agent_loop
from agent_loop import ToolSpec
from test_agent_loop import any_answer, HERE, observations, ROOMY, RuntimeTestCase
from tests.servers import ThrowawayPostgres


# PART 8: connect a real model: the OpenAI Responses, OpenAI Chat Completions and Anthropic Messages formats,
# here with literal replies shaped like the providers' documented ones

def fc(call_id, name, arguments, item_id=None):
    """A Responses function_call output item; arguments are JSON text as the API sends them."""
    text = arguments if type(arguments) is str else json.dumps(arguments)
    return {"type": "function_call", "id": item_id or f"fc_{call_id}", "call_id": call_id, "name": name,
            "arguments": text, "status": "completed"}


def responses_reply(*output, status="completed", reason=None):
    return {"id": "resp_1", "object": "response", "status": status,
            "incomplete_details": {"reason": reason} if reason else None, "output": list(output)}


def message(*parts):
    return {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "content": list(parts)}


def output_text(text):
    return {"type": "output_text", "text": text, "annotations": []}


def tool_call(call_id, name, arguments):
    text = arguments if type(arguments) is str else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def chat_reply(content=None, tool_calls=None, finish_reason="stop", refusal=None):
    msg = {"role": "assistant", "content": content, "refusal": refusal}
    if tool_calls is not None:
        msg["tool_calls"] = tool_calls
    return {"id": "chatcmpl-1", "object": "chat.completion",
            "choices": [{"index": 0, "message": msg, "finish_reason": finish_reason}]}


def anthropic_reply(*content, stop_reason="end_turn"):
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": list(content),
            "stop_reason": stop_reason, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}


def tool_use(call_id, name, arguments):
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def text_block(text):
    return {"type": "text", "text": text}


def later(name):
    """agent_loop.<name>, looked up when it is called: this module imports against PART 1-5 alone."""
    def function(*args, **kwargs):
        return getattr(agent_loop, name)(*args, **kwargs)

    function.__name__ = name
    return function


BRIDGES = {  # name: (make_model, extra options, a reply with these calls, a reply with this text)
    "responses": (later("responses_model"), {},
                  lambda *calls: responses_reply(*(fc(cid, name, args) for cid, name, args in calls)),
                  lambda text: responses_reply(message(output_text(text)))),
    "chat": (later("chat_model"), {},
             lambda *calls: chat_reply(None, [tool_call(cid, name, args) for cid, name, args in calls], "tool_calls"),
             lambda text: chat_reply(text)),
    "messages": (later("messages_model"), {"max_tokens": 1024},
                 lambda *calls: anthropic_reply(*(tool_use(cid, name, args) for cid, name, args in calls), stop_reason="tool_use"),
                 lambda text: anthropic_reply(text_block(text))),
}


class Recorder:
    """A create() that replays recorded replies in order and keeps every request it was given."""

    def __init__(self, *replies):
        self.replies, self.requests = list(replies), []

    def __call__(self, **request):
        self.requests.append(copy.deepcopy(request))
        return self.replies[min(len(self.requests), len(self.replies)) - 1]

# The SDK lane: every bridge through the official openai and anthropic packages, sync and async clients,
# against a fake provider on 127.0.0.1. `python3 -m unittest` skips these (it needs the standard library
# only); .ci/run installs pinned SDKs in a throwaway virtual environment and runs the whole suite there.

def installed(package):
    """True if the official package is installed here: it is imported only by the test that needs it, so that the
    suite (and each child process of it) does not pay for what it does not use."""
    return importlib.util.find_spec(package) is not None


# PART 10: a named run saved in SQLite, resumed after a crash with nothing refunded. A crash is a real one: a child
# process killed with SIGKILL while a tool runs, or while the model decides; a new process resumes the run. And tools
# that write: a write is approved before it starts, keyed so that it never applies twice, and an unknown outcome is
# reconciled; the crash test kills a child process after its order applied.


class StoreTestCase(RuntimeTestCase):
    """Tests of runs saved in a store (PART 10 on): each test's SqliteStore, closed after it."""

    def store(self, path=":memory:"):
        store = agent_loop.SqliteStore(path)
        self.addCleanup(store.close)
        return store


def store_result(store, run_id):
    """What the store holds for an ended run, as run_agent returns it."""
    saved = store.load(run_id)
    return {"status": saved["status"], "answer": saved["answer"], "used": saved["state"]["used"],
            "history": saved["history"], "trace": saved["trace"], "run_id": run_id}


def order_errors(result):
    return [obs["error"] for obs in observations(result) if not obs["ok"]]


def dict_store(store_id=None):
    """A store of your own, in memory, with the five methods of Store's docstring and nothing more (made here: the
    core cut away from the later parts has no Store)."""
    class DictStore(agent_loop.Store):
        def __init__(self):
            self.runs = {}

        def load(self, run_id):
            return copy.deepcopy(self.runs.get(run_id))

        def claim(self, run_id, config, started):
            run = self.runs.setdefault(run_id, {"config": config, "started": started, "generation": 0,
                                                "state": dict(agent_loop._NOTHING_SAVED), "history": [], "trace": [],
                                                "status": None, "answer": None})
            run["generation"] += 1
            return run["generation"]

        def claimed(self, run_id, generation):
            if self.runs[run_id]["generation"] != generation:
                raise agent_loop.Superseded(run_id)

        def save(self, run_id, generation, state, records, events, end=None):
            self.claimed(run_id, generation)
            run = copy.deepcopy(self.runs[run_id])
            rounds = {record["round"]: record for record in run["history"] + copy.deepcopy(records)}
            run.update(state=copy.deepcopy(state), history=[rounds[n] for n in sorted(rounds)],
                       trace=run["trace"] + copy.deepcopy(events))
            if end is not None:
                run["status"], run["answer"] = copy.deepcopy(end)
            self.runs[run_id] = run  # all of it, or nothing

        def unfinished(self):
            return [run_id for run_id, run in self.runs.items() if run["status"] is None]

    store = DictStore()
    if store_id is not None:
        store.store_id = store_id
    return store

# PART 11: many workers, one database. The PostgreSQL tests start a server of their own: a throwaway cluster in a
# temporary folder, on a loopback port, run as the postgres user when the tests run as root, always removed.


class LeaseCase(RuntimeTestCase):
    """The database a test of leases runs on (an SQLite file here; PostgresLeaseTests' server), and its workers."""

    def setUp(self):
        self.folder = tempfile.mkdtemp(prefix="agent_loop_pool_")
        self.addCleanup(shutil.rmtree, self.folder, True)
        self.where = os.path.join(self.folder, "runs.db")

    def connect(self):
        return sqlite3.connect(self.where, isolation_level=None, timeout=30, check_same_thread=False)

    def store(self, **options):
        store = agent_loop.SqlStore(self.connect, **options)
        self.addCleanup(store.close)
        return store

    def free(self, run_id):
        """A saved state of nothing used, for a store's own methods."""
        return {"used": {"rounds": 0, "calls": 0, "credits": 0}, "paused": 0.0, "paused_at": None}

    def kind(self):
        return "sqlite" if "://" not in self.where and "host=" not in self.where else "postgres"

    def workers(self, child, *workers):
        """A worker process per (name, *args), the child `child` of this file on this test's database, each logging
        to a file of its own (killed at the end of the test); and lines(name), the JSON lines it printed so far."""
        logs, processes = {}, {}
        for name, *args in workers:
            logs[name] = open(os.path.join(self.folder, f"{name}.log"), "w+")
            self.addCleanup(logs[name].close)
            processes[name] = subprocess.Popen(child_command(child, self.kind(), self.where, name, *args),
                                               stdout=logs[name], stderr=subprocess.STDOUT)
            self.addCleanup(processes[name].kill)

        def lines(name):
            logs[name].seek(0)
            return [json.loads(line) for line in logs[name].read().splitlines() if line.startswith("{")]

        return processes, lines

    def frozen(self, run_id, freeze="between", lease=1.0):
        """A worker process that holds run_id under a lease of `lease` seconds, frozen with SIGSTOP inside a save's
        transaction (or its claim's: frozen_worker); it is woken at the end of the test, and its log is returned."""
        ready = os.path.join(self.folder, f"{run_id}.ready")
        log = open(os.path.join(self.folder, f"{run_id}.log"), "w+")
        self.addCleanup(log.close)
        worker = subprocess.Popen(child_command("frozen_worker", self.kind(), self.where, run_id, ready, freeze,
                                                str(lease)),
                                  stdout=log, stderr=subprocess.STDOUT)
        self.addCleanup(worker.wait, 60)
        self.addCleanup(worker.kill)  # (a stopped process dies of SIGKILL too)
        end = time.monotonic() + 60
        while not os.path.exists(ready):
            self.assertTrue(worker.poll() is None and time.monotonic() < end, "the worker never froze")
            time.sleep(0.01)
        os.kill(worker.pid, signal.SIGSTOP)
        return worker, log

class OnPostgres:
    """A test case's database on a PostgreSQL server of its own, started for its class: a schema of its own each."""

    @classmethod
    def setUpClass(cls):
        cls.server = ThrowawayPostgres()
        cls.addClassCleanup(cls.server.stop)
        cls.schemas = 0

    def setUp(self):
        super().setUp()
        import psycopg
        type(self).schemas += 1
        schema = f"test_{type(self).schemas}"
        with psycopg.connect(self.server.conninfo, autocommit=True) as admin:
            admin.execute(f"CREATE SCHEMA {schema}")
        self.where = f"{self.server.conninfo} options='-c search_path={schema}'"

    def connect(self):
        import psycopg
        return psycopg.connect(self.where, autocommit=True)


JOB_LEASE = 0.5  # seconds: the crash tests wait one and a half of these


def utf8_json(value):
    """Canonical JSON in UTF-8, written out here: sorted keys, fixed separators, text not escaped."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


# PART 15: a run that waits for its jobs without holding a process; runs cancelled and followed from anywhere

JOB_X = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}


class JobRunTools:
    """The tools of the job runs' tests: every call answers with its arguments; rd fails with x=0."""

    def __init__(self):
        self.asked = []

    async def invoke(self, call):
        if call["name"] == "rd" and call["arguments"]["x"] == 0:
            raise RuntimeError("private")
        return {"got": call["arguments"]}


JOB_RUN_OPTIONS = dict(registry={
    "ja": ToolSpec(1, True, False, parameters=JOB_X, job=True), "jb": ToolSpec(1, True, False, parameters=JOB_X, job=True),
    "jp": ToolSpec(1, True, True, parameters=JOB_X, job=True), "jw": ToolSpec(1, False, False, parameters=JOB_X, job=True),
    "rd": ToolSpec(1, True, True, parameters=JOB_X), "wr": ToolSpec(1, False, False, parameters=JOB_X)},
    accept=any_answer, fixtures=JobRunTools(), limits=dataclasses.replace(ROOMY, calls=20, credits=100))
STATUSES = [
    "completed", "round_limit", "call_limit", "credit_limit", "deadline", "cancelled", "model_timeout",
    "model_exception", "invalid_decision", "invalid_final", "invalid_batch", "invalid_call", "invalid_call_id",
    "duplicate_call_id", "unknown_tool", "permission_denied", "invalid_arguments", "repeat_limit", "tool_exception",
]


def child_command(name, *args):
    """The command line that runs the child NAME of tests/children.py with args, in a Python of its own."""
    flags = ["-O"] if sys.flags.optimize else []
    return [sys.executable, *flags, os.path.join(HERE, "tests", "children.py"), name, *args]


def run_in_a_process(name, *args, kill_when=None):
    """Run the child NAME in a Python of its own: to its end (its printed JSON), or SIGKILLed once kill_when exists."""
    process = subprocess.Popen(child_command(name, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if kill_when is None:
        out, err = process.communicate(timeout=120)
        if process.returncode != 0:
            raise AssertionError(err)
        return json.loads(out)
    deadline = time.monotonic() + 60
    while not os.path.exists(kill_when) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.kill()  # SIGKILL: nothing of the runtime runs after this, not even a finally
    process.communicate(timeout=60)
    if not os.path.exists(kill_when):
        raise AssertionError("the crash never came")
    return None


def run_script(name, *args):
    """Run examples/NAME.py (or benchmarks/bench.py, for "bench") with args, as a reader does, from the root."""
    flags = ["-O"] if sys.flags.optimize else []
    path = os.path.join(HERE, "benchmarks" if name == "bench" else "examples", f"{name}.py")
    return subprocess.run([sys.executable, *flags, path, *args], capture_output=True, text=True, timeout=120,
                          check=False, cwd=HERE)


def run_scripts(*argvs):
    """run_script for each argv, the scripts side by side: their waits overlap."""
    with concurrent.futures.ThreadPoolExecutor(len(argvs)) as pool:
        return list(pool.map(lambda argv: run_script(*argv), argvs))
