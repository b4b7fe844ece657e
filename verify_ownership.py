"""Run the result-ownership experiment and compare it with the fixed oracle, expected.json beside this file.

    python3 -B verify_ownership.py      # the PASS line, or what differs and a non-zero exit
    python3 -B -O verify_ownership.py   # the same under -O (nothing here relies on assert)
"""

import asyncio
import json
import os
import sys

from result_ownership import run_experiment

ORACLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "expected.json")
PASS = "PASS: borrowed and shallow histories drift; deep-owned history is stable"


class Mismatch(Exception):
    """The experiment's observations differ from the oracle; the message names the mode and the field."""


def first_difference(expected, observed, path):
    """Return 'path: expected X, got Y' for the first place where observed differs from expected, else None."""
    if type(expected) is not type(observed):
        return f"{path}: expected {json.dumps(expected)}, got {json.dumps(observed)}"
    if type(expected) is dict:
        for key in sorted(expected.keys() | observed.keys()):
            if key not in observed:
                return f"{path}.{key}: missing"
            if key not in expected:
                return f"{path}.{key}: not in the oracle"
            found = first_difference(expected[key], observed[key], f"{path}.{key}")
            if found:
                return found
        return None
    if type(expected) is list:
        for index, (want, got) in enumerate(zip(expected, observed)):
            found = first_difference(want, got, f"{path}[{index}]")
            if found:
                return found
        if len(expected) != len(observed):
            return f"{path}: expected {len(expected)} items, got {len(observed)}"
        return None
    if expected != observed:
        return f"{path}: expected {json.dumps(expected)}, got {json.dumps(observed)}"
    return None


def compare(expected, observed):
    """Raise Mismatch naming the mode and field of the first difference; return None when they agree."""
    for mode in sorted(expected.keys() | observed.keys()):
        if mode not in observed:
            raise Mismatch(f"{mode}: the experiment did not run this mode")
        if mode not in expected:
            raise Mismatch(f"{mode}: not in the oracle")
        found = first_difference(expected[mode], observed[mode], mode)
        if found:
            raise Mismatch(found)


def main():
    """Compare one run of the experiment with the oracle; print the PASS line or exit non-zero."""
    with open(ORACLE, encoding="utf-8") as file:
        expected = json.load(file)
    # A JSON round trip, so the run is compared as the oracle was written: as JSON.
    observed = json.loads(json.dumps(asyncio.run(run_experiment())))
    try:
        compare(expected, observed)
    except Mismatch as error:
        print(f"FAIL: {error}", file=sys.stderr)
        return 1
    print(PASS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
