"""Chaos under a burst: four engines behind `kunserve serve` serve streamed requests while a
driver hard-kills a random engine every few seconds and forces drops and restores; every request
completes with the tokens of a run without faults (vllm_kunserve/bench/chaos.py; the longer run
and its doc: benchmarks/chaos.py)."""

from __future__ import annotations

import asyncio

import pytest

from tests.vllm.conftest import BURST_KV_BYTES
from vllm_kunserve.bench.chaos import ChaosSpec, run_chaos, summarise
from vllm_kunserve.cluster.fleet.launcher import KunserveCluster

pytestmark = pytest.mark.vllm

ARGS = ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(BURST_KV_BYTES),
        "--max-model-len", "512", "--enforce-eager", "--served-model-name", "m"]


def test_every_request_completes_token_identical_while_engines_die(burst_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("chaos") / "serve.log"
    spec = ChaosSpec(requests=48, duration_s=24.0, output_len=48, kill_every_s=7.0, ops_every_s=4.0, seed=3)
    with KunserveCluster(str(burst_model), ARGS, {"drop": {"enable": False}}, log_path=log, instances=4,
                         startup_timeout_s=600, extra=["--monitor-interval", "0.25", "--log-dir", str(log.parent)]) as srv:
        run = asyncio.run(run_chaos(srv.url, spec))
    s = summarise(run)
    assert s["reference_ok"] == spec.requests, s
    assert s["completed"] == spec.requests and s["failed"] == [], s
    assert s["token_identical"] == spec.requests and s["differ"] == [], s
    assert s["kills"] >= 2 and s["fleet"]["failovers"] >= 1, s   # engines died with requests on them
    assert s["drops_ok"] + s["drops_refused"] >= 1 and s["restores"] >= 1, s
