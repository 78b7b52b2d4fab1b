"""Oneiros remap inside a real vLLM-CPU engine (see remap_probe.py). The scenarios of the remap
config run in turn on one engine (each as on a fresh one: its own events and preemptions, no cached
prefixes, no failure backoff), the stock burst and the TP=2 faults on engines of their own."""

import pytest
import torch

from tests.vllm.conftest import run_remap_probe

pytestmark = pytest.mark.vllm

# h2d_bandwidth_gbps is declared so the bandwidth bound does not depend on a noisy CPU memcpy probe
REMAP = {"kunserve": {"remap": {"enable": True, "max_fraction": 0.75, "revert_hold_s": 0,
                               "h2d_bandwidth_gbps": 50.0}}}
#: the scenarios that share one remap engine, in the order they run (the controller's last: its
#: failing policy may leave the engine remapped, and a fault armed for a remap would then fire in a revert)
SHARED = ("burst", "fault-map", "fault-exhausted", "identity", "faults", "controller")


@pytest.fixture(scope="module")
def remap_runs(burst_model) -> dict:
    """Each shared scenario's facts, from one engine start (each costs ~30 s on a 2-core host)."""
    return run_remap_probe(burst_model, ",".join(SHARED), REMAP, timeout=900)


@pytest.mark.covering
def test_greedy_outputs_identical_with_remap_forced(remap_runs):
    res = remap_runs["identity"]
    base = res["base_blocks"]
    assert [(r["alpha"], r["slots"]) for r in res["runs"]] == [(1, 1), (2, 1), (2, 2), (3, 2)]
    for r in res["runs"]:
        assert r["remap"] == "ok" and r["revert"] == "ok"
        assert len(r["layers"]) == r["alpha"] + r["slots"]
        assert r["same"], f"greedy tokens changed with alpha={r['alpha']} slots={r['slots']}"
        assert r["copies"] > 0  # the layers really were streamed
        # on vLLM-CPU streamed linears run oneDNN's packed kernel from the slot (not F.linear)
        assert r["streamed_linear"] == ("onednn_packed" if torch.backends.mkldnn.is_available() else "slot_weights")
        assert r["blocks"] > base and r["blocks_after"] == base
        # metrics and counts follow the grown capacity
        assert r["gauges"] == {"remapped_layers": r["alpha"] + r["slots"], "kv_blocks_total": r["blocks"],
                               "kv_blocks_base": base}
        assert r["num_gpu_blocks"] == r["blocks"] and r["usage_idle"] == 0.0
        assert r["problems"] == []  # scheduler and worker agree; every tensor where its state says


def test_burst_completes_without_preemption_while_stock_preempts(burst_model, remap_runs):
    stock = run_remap_probe(burst_model, "burst", None)
    remap = remap_runs["burst"]
    assert stock["completed"] == remap["completed"] == 16
    assert stock["preemptions"] > 0
    assert remap["preemptions"] == 0
    base = remap["blocks_before"]
    assert base == stock["num_gpu_blocks"]
    # the burst needs ~1.4x the base capacity; remap delivered at least that
    demand = 16 * (160 + 80) / 32
    assert 1.3 < demand / (base - 1) < 1.5
    assert remap["max_blocks_seen"] >= demand
    # after the burst drains: weights back, capacity back to base
    assert remap["phase_after"] == "base" and remap["layers_resident"]
    assert remap["blocks_after"] == base == remap["num_gpu_blocks"]
    assert remap["events"][:2] == [["remap", "ok"], ["revert", "ok"]]
    assert remap["problems"] == []


@pytest.mark.parametrize("fault", ["map", "exhausted"])
def test_failure_while_growing_keeps_serving_at_old_capacity(remap_runs, fault):
    res = remap_runs[f"fault-{fault}"]
    assert res["completed"] == 16  # no request lost
    assert res["events"][0] == ["remap", "failed"]
    assert res["blocks_before"] == res["num_gpu_blocks"]
    assert res["phase_after"] == "base" and res["layers_resident"]
    assert res["problems"] == []


@pytest.mark.parametrize("scenario", ["faults", "faults-tp2"])
def test_fault_at_every_step_of_remap_and_revert_rolls_back(burst_model, remap_runs, scenario):
    """Each step of remap and revert fails once in turn, in a real engine: the transition rolls
    back, greedy outputs stay token-identical, the invariants hold, and the engine can still remap
    and revert afterwards. ``faults-tp2``: a TP=2 engine (two worker processes) where every fault
    fires on rank 1 only, so rank 0 has done its half of the step and must be rolled back too."""
    res = remap_runs["faults"] if scenario == "faults" else run_remap_probe(burst_model, scenario, REMAP)
    tp = 2 if scenario == "faults-tp2" else 1
    assert res["tp"] == tp and len(res["worker_pids"]) == tp
    steps = {(s["op"], s["step"]) for s in res["steps"]}
    assert {("remap", k) for k in ("rpc", "pack", "release", "slot_create", "streamer_install", "copy_plan",
                                   "map", "exhausted")} <= steps
    assert {("revert", k) for k in ("kv_shrink", "streamer_uninstall", "slot_destroy", "reload", "rpc")} <= steps
    for s in res["steps"]:
        assert s["outcome"] == "failed", s
        assert s["armed"] == ([tp - 1] if tp > 1 else [0]), s  # the fault was armed where meant
        layers = {(tuple(w[1]), w[2]) for w in s["workers"]}
        assert len(layers) == 1, f"ranks disagree after a failed {s['op']} at {s['step']}: {s['workers']}"
        if s["op"] == "revert":  # rolled back to the remapped state it started from, on every rank
            assert s["workers"] == s["workers_before"], s
        else:  # rolled back to base: every layer resident on every rank
            assert all(state == "resident" for w in s["workers"] for state in w[1]), s
        assert s["same"], f"greedy tokens changed after a failed {s['op']} at {s['step']}"
        assert s["problems"] == [], s
        if s["op"] == "remap":
            assert s["phase"] == "base" and s["blocks"] == s["base"]
        else:
            assert s["remap"] == "ok" and s["phase"] == "remapped"
            assert s["revert_after"] == "ok" and s["phase_after"] == "base"
    assert res["final_remap"] == res["final_revert"] == "ok" and res["final_same"]
    assert res["final_phase"] == "base" and res["final_problems"] == []


def test_controller_error_mid_burst_keeps_serving(remap_runs):
    clean, res = remap_runs["burst"], remap_runs["controller"]
    assert res["completed"] == 16 and res["tokens"] == clean["tokens"]
    assert ["controller_error", "failed"] in res["events"]
    assert res["errors"] >= 1 and res["controller_errors"] >= 1
    assert res["problems"] == []
