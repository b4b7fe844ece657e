"""PART 1-5 and the runtime stand alone: the module cut above PART 6 runs the demo and passes the core's tests
(test_agent_loop.py), and cut at the banner passes the runtime's test files; the later parts declare what they add.
"""

import ast
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import agent_loop
from agent_loop import STOP_STATUSES
from test_agent_loop import code_blocks, DEMO_TRANSCRIPT, HERE, readme_section
from tests.support import STATUSES


CORE_END = "\n# PART 6:"  # the module cut here is the article's runtime, PART 1-5
RUNTIME_END = "\n# ======"  # and cut at the banner, the whole runtime: what serves around it comes after


def cut_module(folder, end=CORE_END):
    """Write into folder agent_loop.py cut just above end, with its own __main__ block, and what its tests read."""
    with open(os.path.join(HERE, "agent_loop.py"), encoding="utf-8") as file:
        source = file.read()
    kept, main = source[:source.index(end)], source[source.index('\nif __name__ == "__main__":'):]
    with open(os.path.join(folder, "agent_loop.py"), "w", encoding="utf-8") as file:
        file.write(kept + "\n\n" + main)
    for name in ("test_agent_loop.py", "result_ownership.py", "verify_ownership.py", "expected.json", "README.md"):
        shutil.copy(os.path.join(HERE, name), folder)
    for name in ("schema_suite", "tests", "examples"):
        shutil.copytree(os.path.join(HERE, name), os.path.join(folder, name))


# The files of the runtime's later parts' tests (PART 6-15), that the module cut at the banner runs as the whole does.
# The pool's processes (test_pool) and PostgreSQL's (test_postgres) run the same store code test_leases, test_jobs and
# test_job_runs do; here they would only add load.
RUNTIME_FILES = ("test_function_tools", "test_refusals", "test_bridges", "test_mcp", "test_named_runs", "test_writes",
                 "test_leases", "test_jobs", "test_job_runs", "test_attempts", "test_catalog")
ALONE = {}  # the runs of a cut file's tests, by name: started when the whole suite loads, as they are slow


def start_alone(name):
    """Start the tests of the cut file, "core" or "runtime", in a Python of its own, beside the rest of the suite."""
    folder = tempfile.mkdtemp(prefix=f"agent_loop_{name}_")
    cut_module(folder, CORE_END if name == "core" else RUNTIME_END)
    flags = ["-O"] if sys.flags.optimize else []
    names = ["test_agent_loop"] if name == "core" else [f"tests.{file}" for file in RUNTIME_FILES]
    command = [sys.executable, *flags, "-m", "unittest", *names]
    ALONE[name] = {"folder": folder, "process": subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE,
                                                                 stderr=subprocess.STDOUT, text=True)}


def finish_alone(test, name):
    """The tests of the cut file `name` passed: they ran, and ran no test fewer than a few."""
    if name not in ALONE:  # this test run alone, by name
        start_alone(name)
    process = ALONE[name]["process"]
    test.addCleanup(shutil.rmtree, ALONE[name]["folder"], True)
    output, _ = process.communicate(timeout=600)
    test.assertEqual(process.returncode, 0, output[-3000:])
    test.assertRegex(output, r"\nRan [1-9][0-9]+ tests")


def load_tests(loader, tests, pattern):
    """The whole suite, loaded: start the cut files' runs now, so that they overlap the others."""
    for name in ("core", "runtime"):
        if name not in ALONE:
            start_alone(name)
    return tests


class StandaloneCoreTests(unittest.TestCase):
    """PART 5: PART 1-5 stand alone: the file cut above PART 6 prints the demo's transcript and passes the core's tests."""

    def test_the_cut_core_prints_the_demos_transcript(self):
        with tempfile.TemporaryDirectory() as folder:
            cut_module(folder)
            for args in (["demo"], []):
                with self.subTest(args=args):
                    flags = ["-O"] if sys.flags.optimize else []
                    done = subprocess.run([sys.executable, *flags, "agent_loop.py", *args], cwd=folder,
                                          capture_output=True, text=True, timeout=120, check=False)
                    self.assertEqual((done.returncode, done.stderr, done.stdout), (0, "", DEMO_TRANSCRIPT))

    def test_the_readmes_prototype_runs_on_part_1_to_6_alone(self):
        (example,) = code_blocks(readme_section("Copy it into your own prototype"), "python")
        with tempfile.TemporaryDirectory() as folder:
            cut_module(folder, "\n# PART 7:")
            done = subprocess.run([sys.executable, "-c", example], cwd=folder, capture_output=True, text=True,
                                  timeout=120, check=False)
        self.assertEqual((done.returncode, done.stderr), (0, ""))
        self.assertEqual(done.stdout, re.search(r"print\(.*\)  # (.*)", example)[1] + "\n")

    def test_the_cut_core_passes_the_cores_tests(self):
        finish_alone(self, "core")



class LaterPartsTests(unittest.TestCase):
    """The later parts declare what they add where the core reads it: the core's own lists stay the article's."""

    def test_the_cores_lists_are_the_articles_and_every_list_adds_the_later_parts_after_them(self):
        self.assertEqual(list(STOP_STATUSES), STATUSES)
        self.assertEqual(agent_loop.OBSERVATION_ERRORS, ("temporary", "tool_timeout", "batch_aborted", "tool_error"))
        every = agent_loop.every_status()
        self.assertEqual((every[:len(STATUSES)], len(set(every))), (STOP_STATUSES, len(every)))
        self.assertIn("superseded", every[len(STATUSES):])
        self.assertEqual(list(agent_loop.COMMANDS), ["demo"])
        self.assertEqual(list(agent_loop.every_command()), ["demo", "store"])

    def test_every_seam_is_a_method_of_part_with_a_one_line_docstring_and_no_part_defines_another(self):
        seams = [name for name, seam in vars(agent_loop.Part).items() if inspect.iscoroutinefunction(seam)]
        self.assertEqual(seams, agent_loop._SEAMS)
        self.assertGreaterEqual(len(seams), 10)
        for name in seams:
            doc = getattr(agent_loop.Part, name).__doc__
            self.assertTrue(doc and "\n" not in doc.strip() and len(doc) <= 120, name)
        for kind in agent_loop.PARTS:  # a part's own coroutines are seams, or helpers of its own (named _...)
            for name, method in vars(kind).items():
                if inspect.iscoroutinefunction(method) and not name.startswith("_"):
                    self.assertIn(name, [*seams, "join", "retry"], f"{kind.__name__}.{name}")

    def test_the_parts_meet_a_run_in_the_order_of_one_tuple(self):
        self.assertEqual([kind.__name__ for kind in agent_loop.PARTS],
                         ["ObservedRefusals", "_CatalogRun", "Attempts", "_JobRuns", "ResultChecks", "_Journal", "_Writes",
                          "Usage"])
        self.assertEqual(set(agent_loop.Part.__subclasses__()) | {agent_loop._Writes}, set(agent_loop.PARTS))
        source = inspect.getsource(agent_loop)
        self.assertEqual(source.count("__subclasses__"), 0)  # nothing else says in what order parts come

    def test_no_module_level_name_is_bound_twice(self):
        tree = ast.parse(inspect.getsource(agent_loop))
        names = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names += [target.id for target in targets if isinstance(target, ast.Name)]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names += [(alias.asname or alias.name).split(".")[0] for alias in node.names]
        self.assertEqual([name for name in set(names) if names.count(name) > 1], [])

    def test_no_part_names_a_later_parts_definition(self):
        source = inspect.getsource(agent_loop)
        lines = source.splitlines()
        banners = [(number, int(m[1])) for number, line in enumerate(lines, 1) if (m := re.match(r"# PART (\d+):", line))]

        def part(lineno):
            return max((n for start, n in banners if start <= lineno), default=0)

        tree = ast.parse(source)
        defined = {}
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for name in [getattr(node, "name", None), *(t.id for t in targets if isinstance(t, ast.Name))]:
                if name:
                    defined.setdefault(name, part(node.lineno))
        later = sorted({(part(node.lineno), getattr(node, "name", "?"), use.id, defined[use.id])
                        for node in tree.body for use in ast.walk(node)
                        if isinstance(use, ast.Name) and defined.get(use.id, 0) > part(node.lineno)})
        self.assertEqual(later, [])


class StandaloneRuntimeTests(unittest.TestCase):
    """PART 1-11 stand alone: the file cut at the banner is the whole runtime. It prints the demo's transcript, has no
    command but demo, and passes the tests of the runtime's later parts (own tools, refusals, bridges, MCP, named
    runs, writes, leases)."""

    def test_the_cut_runtime_prints_the_demos_transcript_and_has_the_demo_alone(self):
        with tempfile.TemporaryDirectory() as folder:
            cut_module(folder, RUNTIME_END)
            flags = ["-O"] if sys.flags.optimize else []
            demo, help = (subprocess.run([sys.executable, *flags, "agent_loop.py", *args], cwd=folder,
                                         capture_output=True, text=True, timeout=120, check=False)
                          for args in (["demo"], ["--help"]))
            self.assertEqual((demo.returncode, demo.stderr, demo.stdout), (0, "", DEMO_TRANSCRIPT))
            self.assertEqual((help.returncode, re.findall(r"^    (\w+) ", help.stdout, re.M)), (0, ["demo"]))

    def test_the_cut_runtime_passes_the_runtimes_tests(self):
        finish_alone(self, "runtime")
