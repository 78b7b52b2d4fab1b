"""runtime/quietexit.py: the process ends with the status asked for, its output flushed, and no
atexit handler or interpreter teardown runs (where triton's nanobind prints its "leaked" lines)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SCRIPT = """
import atexit, sys
from vllm_kunserve.runtime.quietexit import quiet_exit
atexit.register(lambda: print("teardown ran"))
print("summary line", end="")
sys.stderr.write("err line")
quiet_exit(3)
print("after")
sys.exit(0)
"""


def test_quiet_exit_keeps_the_status_and_the_output_and_skips_the_teardown():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KUNSERVE_QUIET_EXIT": "1"})
    assert r.returncode == 3 and r.stdout == "summary line" and "err line" in r.stderr


def test_quiet_exit_can_be_turned_off():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KUNSERVE_QUIET_EXIT": "0"})
    assert r.returncode == 0 and r.stdout == "summary lineafter\nteardown ran\n"
