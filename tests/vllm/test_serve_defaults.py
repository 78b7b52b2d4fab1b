"""`kunserve serve MODEL --instances 2` with no memory flag serves on a CPU host (issue 36): the front
end divides the host's memory among the engines and says so; without that, each stock engine asks
vLLM-CPU's default 92% of the host and the second cannot start."""

from __future__ import annotations

import json
import urllib.request

import pytest

from vllm_kunserve.cluster.fleet.launcher import KunserveCluster

pytestmark = pytest.mark.vllm


def test_two_engines_start_with_no_memory_flag_and_serve(tiny_model, tmp_path):
    log = tmp_path / "serve.log"
    srv = KunserveCluster(str(tiny_model), ["--served-model-name", "m", "--max-model-len", "256", "--enforce-eager"],
                          None, log_path=log, instances=2, startup_timeout_s=400,
                          extra=["--log-dir", str(tmp_path)])
    with srv:
        body = json.dumps({"model": "m", "prompt": "the cache", "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"{srv.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
    assert out["usage"]["completion_tokens"] == 4
    text = log.read_text()
    assert "[kunserve] memory: 2 engines share" in text and "--gpu-memory-utilization" in text
    assert "Traceback" not in text
