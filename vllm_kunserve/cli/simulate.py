"""``kunserve simulate``: discrete-event cluster simulation of a trace under several policies."""

from __future__ import annotations

import argparse
import os

DEFAULT_POLICIES = "vllm,infercept,llumnix,mell,kunserve,oneiros,oracle"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from vllm_kunserve.policy.dispatch import DEFAULT_DISPATCH, describe

    p = sub.add_parser("simulate", help="discrete-event cluster simulation of a trace under several policies",
                       description="Simulate N instances serving a trace under each policy and print "
                                   "P50/P99 TTFT and TPOT with ratios to vLLM. See docs/simulator.md.")
    p.add_argument("--trace", required=True, help="Azure LLM CSV or BurstGPT CSV")
    p.add_argument("--model", default="qwen2.5-14b",
                   help="qwen2.5-14b | llama2-7b | llama2-70b | small | path to a HF config.json or model dir")
    p.add_argument("--dtype", default=None, help="override the model dtype (float32, bfloat16, ...)")
    p.add_argument("--gpu", default="h100", help="h100 | a100 | cpu (cpu needs --cost-model)")
    p.add_argument("--gpu-mem-gb", type=float, default=None, help="device memory in GB (default: the GPU's)")
    p.add_argument("--gpu-mem-util", type=float, default=0.9, help="vLLM gpu_memory_utilization")
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="per-instance KV blocks (override the memory model, e.g. a measured engine's)")
    p.add_argument("--cost-model", default=None,
                   help="policy cost-model JSON (kunserve costmodel fit) used as step time instead of Vidur's")
    p.add_argument("--link", default="nvlink", help="instance link: nvlink | ib | rdma200 | pcie | stage-h100 (this project's link, measured) | local")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma list (default {DEFAULT_POLICIES}; also kunserve-nolookahead, "
                        "kunserve-noexchange, kunserve-norestore, oracle-equal (stock vLLM with a 2-instance "
                        "group's KV), oracle-equal-gN (an N-instance group's), vllm-capN (stock with "
                        "max_num_seqs N per instance))")
    p.add_argument("--dispatch", default=DEFAULT_DISPATCH,
                   help=f"router of every policy but MELL (which places with its own placer): {describe()}")
    p.add_argument("--kunserve-config", default=None, help="JSON (file or inline) of the kunserve config")
    p.add_argument("--window", default=None, metavar="OFFSET:DURATION",
                   help="seconds of the trace to keep, e.g. 1500:600")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiply the arrival rate (inter-arrival times / scale)")
    p.add_argument("--target-mem-share", type=float, default=None,
                   help="scale the rate so the oracle's average KV demand is this share of capacity")
    p.add_argument("--out", default=None, help="directory for results.json and per-policy CSVs")
    p.set_defaults(func=run)


def _window(spec: str | None):
    if not spec:
        return 0.0, None
    try:
        off, _, dur = spec.partition(":")
        return float(off), (float(dur) if dur else None)
    except ValueError:
        raise ValueError(f"--window {spec!r}: expected OFFSET:DURATION in seconds, e.g. 1500:600") from None


def _kconfig(raw: str | None):
    from vllm_kunserve.config import parse_config

    if raw is None:
        return None
    if os.path.isfile(raw):
        with open(raw, encoding="utf-8") as f:
            raw = f.read()
    return parse_config(raw)


def run(args: argparse.Namespace) -> int:
    from vllm_kunserve.sim.policies import DISPATCH, POLICIES, POLICY_PATTERNS, is_policy
    from vllm_kunserve.sim.report import format_table, write_outputs
    from vllm_kunserve.sim.runner import build_config, config_summary, run_policies
    from vllm_kunserve.sim.scaling import scale_to_mem_share
    from vllm_kunserve.sim.trace import load_trace

    names = [n.strip().lower() for n in args.policies.split(",") if n.strip()]
    bad = [n for n in names if not is_policy(n)]
    if bad or not names:
        raise ValueError(f"--policies: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(POLICIES)}, "
                         f"{', '.join(POLICY_PATTERNS)}")
    if args.dispatch not in DISPATCH:
        raise ValueError(f"--dispatch {args.dispatch!r}: choose from {', '.join(DISPATCH)}")
    if args.rate_scale <= 0:
        raise ValueError(f"--rate-scale {args.rate_scale}: must be positive")
    if args.target_mem_share is not None and not 0 < args.target_mem_share <= 4:
        raise ValueError(f"--target-mem-share {args.target_mem_share}: must be in (0, 4]")
    off, dur = _window(args.window)
    kcfg = _kconfig(args.kunserve_config)
    cfg = build_config(args.model, args.gpu, args.instances, args.gpu_mem_gb, args.gpu_mem_util,
                       args.block_size, args.max_num_batched_tokens, args.max_num_seqs, args.link,
                       args.cost_model, args.kv_blocks, args.dtype)
    trace = load_trace(args.trace, off, dur, args.rate_scale)
    scale_info = None
    if args.target_mem_share is not None:
        trace, scale_info = scale_to_mem_share(cfg, trace, args.target_mem_share, dispatch=args.dispatch)
        print(f"rate scaled x{scale_info['scale']:.3g}: oracle mean KV demand "
              f"{scale_info['mean_share']:.1%} of capacity (peak {scale_info['peak_share']:.1%})")
    print(f"{len(trace)} requests over {trace[-1].arrival_s:.1f}s; {cfg.instances} x {cfg.gpu.name} "
          f"({cfg.base_kv_blocks() * cfg.block_size} KV tokens each), model {cfg.model.name}")
    out = run_policies(cfg, names, trace, args.dispatch, kcfg,
                       progress=lambda n, r: print(f"  {n}: done in {r['wall_s']:.1f}s"))
    out["config"] = config_summary(cfg)
    out["trace"] = {"path": args.trace, "window": args.window, "rate_scale": args.rate_scale,
                    "requests": len(trace), "scaling": scale_info}
    print(format_table(out))
    if args.out:
        path = write_outputs(out, args.out)
        print(f"wrote {path}")
    return 0
