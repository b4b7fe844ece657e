"""The result-ownership experiment: the oracle, and the runtime it runs on unchanged.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import result_ownership
import verify_ownership
from agent_loop import DATA
from test_agent_loop import HERE, PLAN


class OwnershipTests(unittest.IsolatedAsyncioTestCase):
    """result_ownership.py: the experiment matches its oracle, fails loudly when it cannot hold, and the verifier says where."""

    def oracle(self):
        with open(os.path.join(HERE, "expected.json"), encoding="utf-8") as file:
            return json.load(file)

    async def test_the_experiment_matches_the_oracle(self):
        observed = json.loads(json.dumps(await result_ownership.run_experiment()))
        self.assertIsNone(verify_ownership.compare(self.oracle(), observed))

    async def test_each_mode_shows_its_status_and_the_drift_it_documents(self):
        report = await result_ownership.run_experiment()
        for mode in result_ownership.MODES:
            with self.subTest(mode=mode):
                self.assertTrue(report[mode]["same_object_returned"])
                self.assertEqual(report[mode]["computed_total_cents"], 21900)
                self.assertEqual([d["stocks"] for d in report[mode]["delivered_values"]], [[4, 12], [2, 0]])
        north = {mode: report[mode]["history_after"][0] for mode in result_ownership.MODES}
        # borrowed: the north read now claims to be south's.
        self.assertEqual((report["borrowed"]["status"], north["borrowed"]["observed_partition"]), ("invalid_final", "south"))
        # shallow_copy: the partition name survived, the rows under it did not.
        self.assertEqual((report["shallow_copy"]["status"], north["shallow_copy"]["observed_partition"]), ("invalid_final", "north"))
        self.assertEqual(north["shallow_copy"]["skus"], ["BAG", "BOOK"])
        # deep_copy: history keeps what was delivered.
        self.assertEqual(report["deep_copy"]["status"], "completed")
        self.assertEqual(report["deep_copy"]["history_after"], report["deep_copy"]["delivered_values"])
        self.assertEqual(report["deep_copy"]["answer"], PLAN)
        self.assertEqual([report[mode]["answer"] for mode in ("borrowed", "shallow_copy")], [None, None])

    def test_the_verifier_names_the_mode_and_field_that_differ(self):
        observed = self.oracle()
        altered = self.oracle()
        altered["shallow_copy"]["history_after"][0]["stocks"][1] = 12
        with self.assertRaises(verify_ownership.Mismatch) as raised:
            verify_ownership.compare(altered, observed)
        self.assertEqual(str(raised.exception), "shallow_copy.history_after[0].stocks[1]: expected 12, got 0")
        del observed["deep_copy"]["status"]
        with self.assertRaises(verify_ownership.Mismatch) as raised:
            verify_ownership.compare(self.oracle(), observed)
        self.assertEqual(str(raised.exception), "deep_copy.status: missing")

    def test_the_verifier_exits_non_zero_on_an_altered_oracle(self):
        with tempfile.TemporaryDirectory() as folder:
            for name in ("agent_loop.py", "result_ownership.py", "verify_ownership.py"):
                shutil.copy(os.path.join(HERE, name), folder)
            altered = self.oracle()
            altered["borrowed"]["history_after"][0]["stocks"][0] = 4
            with open(os.path.join(folder, "expected.json"), "w", encoding="utf-8") as file:
                json.dump(altered, file)
            flags = ["-O"] if sys.flags.optimize else []
            done = subprocess.run([sys.executable, "-B", *flags, "verify_ownership.py"], cwd=folder,
                                  capture_output=True, text=True, timeout=120, check=False)
        self.assertEqual(done.returncode, 1)
        self.assertEqual(done.stdout, "")
        self.assertEqual(done.stderr, "FAIL: borrowed.history_after[0].stocks[0]: expected 4, got 2\n")

    async def test_the_experiment_fails_loudly_when_tools_overlap_or_stay_active(self):
        class Overlapping(result_ownership.ReusedCache):
            async def invoke(self, call):
                self.peak = 2
                return await super().invoke(call)

        class StillActive(result_ownership.ReusedCache):
            async def invoke(self, call):
                self.active += 1
                return await super().invoke(call)

        for make_tool, message in ((Overlapping, "borrowed: tools overlapped (peak 2)"),
                                   (StillActive, "borrowed: a tool is still active")):
            with self.subTest(message=message):
                with self.assertRaises(result_ownership.ExperimentError) as raised:
                    await result_ownership.run_experiment(make_tool)
                self.assertEqual(str(raised.exception), message)

    async def test_the_experiment_fails_loudly_when_data_changes(self):
        class Vandal(result_ownership.ReusedCache):
            async def invoke(self, call):
                DATA["north"][0]["stock"] = 5
                return await super().invoke(call)

        try:
            with self.assertRaises(result_ownership.ExperimentError) as raised:
                await result_ownership.run_experiment(Vandal)
            self.assertEqual(str(raised.exception), "DATA changed during the experiment")
        finally:
            DATA["north"][0]["stock"] = 4

    def test_the_delivery_boundary_refuses_an_unknown_mode(self):
        with self.assertRaises(ValueError):
            result_ownership.DeliveryBoundary(result_ownership.ReusedCache(), "copy_on_write")
