"""Simulator baselines for issue 34: tuned vLLM (a batch cap, picked on a trace) and the equal-KV oracle."""

import pytest

from vllm_kunserve.sim.engine import SimConfig, Simulator
from vllm_kunserve.sim.hardware import get_gpu
from vllm_kunserve.sim.metrics import summarize
from vllm_kunserve.workload.models import BUILTIN
from vllm_kunserve.sim.policies import build_policy, is_policy
from vllm_kunserve.sim.policies.baselines import group_kv_factor, weight_share
from vllm_kunserve.sim.runner import simulate
from vllm_kunserve.sim.steptime import EqStepTime
from vllm_kunserve.sim.trace import TraceRequest
from vllm_kunserve.sim.tuning import pick_vllm_cap

pytestmark = pytest.mark.unit


def make_cfg(kv_blocks=64, instances=2, max_seqs=64, **kw):
    return SimConfig(model=BUILTIN["small"], gpu=get_gpu("h100"), step_time=EqStepTime(1e-8, 2e-5, 5e-3),
                     instances=instances, block_size=16, max_tokens=512, max_seqs=max_seqs, kv_blocks=kv_blocks, **kw)


def burst(n=80, gap=0.005, prompt=120, output=30):
    return [TraceRequest(i, i * gap, prompt + (i * 37) % 90, output + (i * 11) % 20) for i in range(n)]


def run_probe(policy, cfg, trace):
    """Run, recording the largest running batch of any step that started."""
    sim = Simulator(cfg, policy, trace)
    seen = [0]
    kick = sim.kick

    def probed(s):
        kick(s)
        if s.inflight:
            seen[0] = max(seen[0], len(s.running))
    sim.kick = probed
    sim.run()
    return sim, seen[0]


def test_batch_cap_bounds_the_running_batch():
    cfg = make_cfg(kv_blocks=400)
    trace = burst()
    sim, stock_max = run_probe(build_policy("vllm"), cfg, trace)
    assert stock_max > 6  # without a cap the batch grows past it on this burst
    for pol in (build_policy("vllm-cap6"), build_policy("vllm-tuned", max_seqs=6)):
        sim, capped_max = run_probe(pol, cfg, trace)
        assert 1 <= capped_max <= 6
        assert all(s.max_seqs == 6 for s in sim.servers)
        s = summarize(sim)
        assert s["completed"] == len(trace) and s["failed"] == 0
        assert pol.describe()["max_seqs"] == 6


def test_cap_at_the_config_value_is_stock_vllm():
    cfg = make_cfg(kv_blocks=48)
    trace = burst()
    a = simulate(cfg, "vllm", trace, keep_requests=False)["summary"]
    b = simulate(cfg, build_policy(f"vllm-cap{cfg.max_seqs}"), trace, keep_requests=False)["summary"]
    assert a["preemptions"] > 0
    assert a["ttft_s"] == b["ttft_s"] and a["preemptions"] == b["preemptions"]


def test_a_smaller_cap_leaves_vllm_more_kv_without_an_override():
    # vLLM's profile reserves the sampler's logits for max_num_seqs requests
    cfg = make_cfg(kv_blocks=None, max_seqs=256, gpu_mem_util=0.3)
    small = build_policy("vllm-cap8").kv_blocks(cfg)
    assert small > cfg.base_kv_blocks()
    assert small - cfg.base_kv_blocks() == pytest.approx((256 - 8) * cfg.model.vocab * 4 / cfg.block_bytes, abs=1)


def test_tuned_names_and_bad_caps():
    assert is_policy("vllm-cap32") and is_policy("oracle-equal-g8") and is_policy("oracle-equal")
    assert not is_policy("vllm-capx") and not is_policy("vllm-tuned")
    with pytest.raises(ValueError, match="needs its batch cap"):
        build_policy("vllm-tuned")
    with pytest.raises(ValueError, match=">= 1"):
        build_policy("vllm-cap0")
    with pytest.raises(ValueError, match="max_seqs is vllm-tuned's"):
        build_policy("vllm", max_seqs=8)
    with pytest.raises(ValueError, match="group is oracle-equal's"):
        build_policy("kunserve", group=2)
    with pytest.raises(ValueError, match="unknown"):
        build_policy("vllm-capx")


@pytest.mark.parametrize("group", [2, 4, 8])
def test_oracle_equal_holds_factor_times_the_base_kv(group):
    cfg = make_cfg(kv_blocks=64, instances=8)
    w = weight_share(cfg)
    layers = cfg.model.layers * cfg.model.layer_bytes
    assert w == pytest.approx(layers / (layers + 64 * cfg.block_bytes))
    factor = group_kv_factor(w, group)
    assert factor == pytest.approx(1 + (group - 1) * w / (group * (1 - w)))
    pol = build_policy("oracle-equal", group=group) if group == 2 else build_policy(f"oracle-equal-g{group}")
    assert pol.kv_factor(cfg) == pytest.approx(factor)
    sim = Simulator(cfg, pol, [])
    assert sim.base_blocks == int(factor * cfg.base_kv_blocks())
    assert all(s.capacity == int(factor * 64) for s in sim.servers)
    assert not pol.infinite_memory and pol.preempt_mode == "recompute"
    # the same memory as a kunserve group of that size holding one copy of the layers, per member
    ks = Simulator(cfg, build_policy("kunserve"), [])
    L = cfg.model.layers
    for j, i in enumerate(range(group)):
        lo, hi = L * j // group, L * (j + 1) // group
        ks.layer_range[i] = (lo, hi)
    per_member = ks.capacity_blocks(tuple(range(group))) / group
    assert sim.base_blocks == pytest.approx(per_member, abs=1)


def test_oracle_equal_default_group_is_two_and_it_preempts_less_than_vllm():
    cfg = make_cfg(kv_blocks=48)
    assert build_policy("oracle-equal").group == 2
    trace = burst()
    v = simulate(cfg, "vllm", trace, keep_requests=False)["summary"]
    e = simulate(cfg, "oracle-equal", trace, keep_requests=False)["summary"]
    assert e["kv_blocks_per_instance"] > v["kv_blocks_per_instance"]
    assert e["completed"] == len(trace) and e["preemptions"] < v["preemptions"]


def test_group_kv_factor_checks():
    assert group_kv_factor(0.5, 2) == pytest.approx(1.5)
    assert group_kv_factor(0.5, 1) == 1.0
    with pytest.raises(ValueError):
        group_kv_factor(1.0)
    with pytest.raises(ValueError):
        group_kv_factor(0.5, 0)


def test_pick_vllm_cap_returns_the_lowest_p99():
    cfg = make_cfg(kv_blocks=48)
    trace = burst()
    caps = [2, 6, 16, 64]
    out = pick_vllm_cap(cfg, trace, caps)
    direct = {c: simulate(cfg, build_policy(f"vllm-cap{c}"), trace, keep_requests=False)["summary"]["ttft_s"]["p99"]
              for c in caps}
    assert out["p99_ttft_s"] == pytest.approx(direct)
    assert len(set(direct.values())) > 1  # the caps differ on this trace
    assert out["cap"] == min(caps, key=lambda c: (direct[c], -c))
    assert out["p99_ttft_s"][out["cap"]] == min(direct.values())


def test_pick_vllm_cap_ties_go_to_the_larger_cap_and_bad_input():
    cfg = make_cfg(kv_blocks=400)
    trace = burst(n=6, gap=0.5)  # never more than a few running: every cap above that is stock
    out = pick_vllm_cap(cfg, trace, [64, 32])
    assert out["p99_ttft_s"][32] == out["p99_ttft_s"][64] and out["cap"] == 64
    with pytest.raises(ValueError, match="no candidate"):
        pick_vllm_cap(cfg, trace, [])
    with pytest.raises(ValueError, match=">= 1"):
        pick_vllm_cap(cfg, trace, [0, 4])


def test_simulate_cli_takes_the_parameterized_names(tmp_path, capsys):
    from vllm_kunserve.cli.main import main

    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1000,120,3\n2000,200,4\n3000,90,5\n")
    assert main(["simulate", "--trace", str(trace), "--instances", "2",
                 "--policies", "vllm,vllm-cap4,oracle-equal,oracle-equal-g4"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in ("vllm-cap4", "oracle-equal-g4"))
    assert main(["simulate", "--trace", str(trace), "--policies", "vllm-capx"]) == 2
    err = capsys.readouterr().err
    assert "unknown vllm-capx" in err and "vllm-cap<N>" in err
