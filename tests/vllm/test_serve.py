"""`vllm serve` with the plugin: the OpenAI server works, and a bad option refuses to start."""

import json
import urllib.request

import pytest

from vllm_kunserve.cluster.launcher import VllmServer

pytestmark = pytest.mark.vllm

ARGS = ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(32 << 20),
        "--max-model-len", "256", "--enforce-eager"]


def _complete(url: str, prompt: str) -> dict:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 5, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_serve_with_plugin_logs_banner_and_completes(tiny_model, tmp_path):
    srv = VllmServer(str(tiny_model), ARGS + ["--served-model-name", "m"], {"kunserve": {}},
                     log_path=tmp_path / "serve.log")
    with srv:
        out = _complete(srv.url, "the memory cache")
    assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 5
    log = (tmp_path / "serve.log").read_text()
    assert "kunserve active:" in log and "patches: worker_extension" in log


def test_serve_refuses_unknown_key_and_names_it(tiny_model, tmp_path):
    srv = VllmServer(str(tiny_model), ARGS, {"kunserve": {"bogus": 1}}, log_path=tmp_path / "bad.log",
                     startup_timeout_s=180)
    with pytest.raises(RuntimeError, match="exited with code"):
        srv.start()
    log = (tmp_path / "bad.log").read_text()
    assert "kunserve.bogus: unknown key" in log
