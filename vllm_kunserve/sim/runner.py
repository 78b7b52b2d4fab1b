"""Build a simulation from user-facing options, run policies on one trace, collect results."""

from __future__ import annotations

import time

from vllm_kunserve.workload.models import load_model_spec

from .engine import SimConfig, Simulator
from .hardware import ClusterSpec, UnmapCost, get_cluster, get_gpu, get_link
from .metrics import ratios_to, summarize
from .policies import DEFAULT_DISPATCH, build_policy
from .steptime import GpuStepTime, StepTime
from .trace import TraceRequest


def build_config(model: str = "qwen2.5-14b", gpu: str = "h100", instances: int = 8,
                 gpu_mem_gb: float | None = None, gpu_mem_util: float = 0.9, block_size: int = 16,
                 max_tokens: int = 8192, max_seqs: int = 1024, link: str = "nvlink",
                 cost_model: str | None = None, kv_blocks: int | None = None,
                 dtype: str | None = None, contention: bool = False,
                 unmap: UnmapCost | None = None) -> SimConfig:
    """``cost_model``: a ``policy.costmodel`` JSON (fitted to a profile) used as the step time;
    otherwise the GPU step-time model fitted to Vidur's profiles. ``contention`` / ``unmap``: see
    ``SimConfig`` (off / free by default, the earlier model)."""
    for k, v, lo in (("instances", instances, 1), ("block_size", block_size, 1),
                     ("max_tokens", max_tokens, 1), ("max_seqs", max_seqs, 1)):
        if v < lo:
            raise ValueError(f"{k}={v}: must be >= {lo}")
    if not 0 < gpu_mem_util <= 1:
        raise ValueError(f"gpu_mem_util={gpu_mem_util}: must be in (0, 1]")
    spec = load_model_spec(model, dtype)
    g = get_gpu(gpu, gpu_mem_gb)
    st: StepTime
    if cost_model:
        from vllm_kunserve.policy.costmodel import CostModel

        from .adapters import eq_from_costmodel
        st = eq_from_costmodel(CostModel.load(cost_model))
    else:
        if g.name == "cpu":
            raise ValueError("--gpu cpu needs --cost-model (a CPU step-time profile fitted with "
                             "`kunserve costmodel fit`)")
        st = GpuStepTime(spec, g)
    cfg = SimConfig(model=spec, gpu=g, step_time=st, instances=instances, gpu_mem_util=gpu_mem_util,
                    block_size=block_size, max_tokens=max_tokens, max_seqs=max_seqs, kv_blocks=kv_blocks,
                    link=get_link(link), pcie=get_link("pcie"),
                    runtime_reserve_bytes=0 if g.name == "cpu" else int(1.5e9),
                    contention=contention, unmap=unmap)
    cfg.base_kv_blocks()  # fail early when the model does not fit
    return cfg


def cluster_config(model: str, cluster: str | ClusterSpec, gpu_mem_gb: float | None = None, **kw) -> SimConfig:
    """``build_config`` for a named cluster (``hardware.CLUSTERS``: GPU, instances, link,
    contention, unmapping cost)."""
    c = get_cluster(cluster) if isinstance(cluster, str) else cluster
    return build_config(model, c.gpu, c.instances, gpu_mem_gb, link=c.link, contention=c.contention,
                        unmap=c.unmap, **kw)


def simulate(cfg: SimConfig, policy, trace: list[TraceRequest], keep_requests: bool = True,
             warmup_s: float = 0.0, end_s: float | None = None) -> dict:
    """Run one policy; the summary covers the requests arriving in ``[warmup_s, end_s)`` (all by
    default; see ``metrics.summarize``), the timeline and events the whole run."""
    if isinstance(policy, str):
        policy = build_policy(policy)
    t0 = time.perf_counter()
    sim = Simulator(cfg, policy, trace).run()
    out = {"policy": policy.describe(), "summary": summarize(sim, warmup_s, end_s), "timeline": sim.timeline,
           "events": sim.events, "wall_s": time.perf_counter() - t0}
    if keep_requests:
        out["requests"] = [r.record() for r in sim.reqs if r.finish_t is not None]
    out["_sim"] = sim
    return out


def run_policies(cfg: SimConfig, names: list[str], trace: list[TraceRequest], dispatch: str = DEFAULT_DISPATCH,
                 kconfig=None, progress=None, warmup_s: float = 0.0, end_s: float | None = None,
                 keep_requests: bool = True) -> dict:
    results = {}
    for name in names:
        pol = build_policy(name, dispatch, kconfig)
        res = simulate(cfg, pol, trace, keep_requests, warmup_s, end_s)
        res.pop("_sim")
        results[name] = res
        if progress:
            progress(name, res)
    return {"results": results, "ratios_to_vllm": ratios_to(results, "vllm")}


def config_summary(cfg: SimConfig) -> dict:
    return {"model": cfg.model.summary(), "gpu": cfg.gpu.name, "gpu_mem_bytes": cfg.gpu.mem_bytes,
            "instances": cfg.instances, "block_size": cfg.block_size, "max_tokens": cfg.max_tokens,
            "max_seqs": cfg.max_seqs, "kv_blocks_per_instance": cfg.base_kv_blocks(),
            "kv_tokens_per_instance": cfg.base_kv_blocks() * cfg.block_size,
            "link": {"name": cfg.link.name, "bw": cfg.link.bandwidth_bytes_per_s, "latency_s": cfg.link.latency_s},
            "pcie_bw": cfg.pcie.bandwidth_bytes_per_s, "step_time": cfg.step_time.describe(),
            "contention": cfg.contention,
            "unmap": None if cfg.unmap is None else {"fixed_s": cfg.unmap.fixed_s, "per_gb_s": cfg.unmap.per_gb_s}}
