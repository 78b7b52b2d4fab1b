"""``kunserve compare``: start each system in turn with the same model and trace, replay, stop, and
print one table with ratios to stock vLLM (mean over repeats, [min-max])."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_kunserve.cli.bench import add_bench_args, bench_options, make_factory


def add_parser(sub: argparse._SubParsersAction) -> None:
    from vllm_kunserve.bench.workload import add_workload_args
    from vllm_kunserve.policy.dispatch import describe

    p = sub.add_parser("compare", help="run stock vLLM, kunserve and the oracle on the same trace, side by side",
                       description="Start each system (vllm serve on 127.0.0.1, a free port), replay the same "
                                   "trace, stop it; repeat; print a table with ratios to stock and write "
                                   "OUT/compare.json, OUT/compare.md and per-run outputs under OUT/<system>/rep<k>/.")
    p.add_argument("--model", required=True, help="local model directory (e.g. from `kunserve make-model`)")
    p.add_argument("--systems", default="vllm,kunserve,oracle", help="comma-separated: vllm, kunserve, oracle; with --instances > 1 static (one pipeline group "
                        "from the start), vllm-router and vllm-router-rr (stock engines behind vllm-router, "
                        "cache_aware / round_robin); vllm-tuned and oracle-equal with their options below")
    p.add_argument("--repeat", type=int, default=3, help="repetitions of every system (interleaved)")
    p.add_argument("--derive", action="append", default=[], metavar="NAME=JSON",
                   help="a system made from another: {\"from\": SYSTEM, \"serve_args\": [...] (kunserve serve's), "
                        "\"engine_args\": [...] (each engine's)}; name it in --systems too; repeatable")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="one more kunserve system NAME: the --kunserve-config with JSON's sections merged over it "
                        "(an ablation, e.g. drop-only='{\"drop\": {\"transition\": \"reprefill\"}}'); list NAME in --systems")
    p.add_argument("--kunserve-config", help="kunserve config for the `kunserve` system: inline JSON or a file")
    p.add_argument("--block-size", type=int, default=32,
                   help="KV block size (vLLM-CPU's attention needs a multiple of 32)")
    cap = p.add_mutually_exclusive_group(required=True)
    cap.add_argument("--kv-cache-bytes", type=int, help="base KV cache bytes per instance (--kv-cache-memory-bytes)")
    cap.add_argument("--kv-capacity-tokens", type=int, help="base KV capacity in tokens (converted to bytes)")
    p.add_argument("--instances", type=int, default=1,
                   help="engines per system (> 1: each system is a `kunserve serve` cluster of that many engines)")
    p.add_argument("--dispatch", default=None, metavar="POLICY",
                   help=f"the cluster's dispatch policy (kunserve serve --dispatch; default its own): {describe(None)}")
    p.add_argument("--oracle-kv-multiplier", type=float, default=10.0, help="oracle KV capacity / base capacity")
    p.add_argument("--oracle-equal-kv-multiplier", type=float, default=None,
                   help="adds the system oracle-equal: stock with this KV capacity / base capacity (the KV a "
                        "kunserve group reaches: 1 + w / (2 (1 - w)) for 2 engines of weight share w)")
    p.add_argument("--tuned-max-num-seqs", type=int, default=None,
                   help="adds the system vllm-tuned: stock with this batch cap (--max-num-seqs) per engine")
    p.add_argument("--order", choices=("shuffled", "fixed"), default="shuffled",
                   help="each repetition runs the systems in an order of its own drawn from --seed (shuffled, "
                        "the default) or in the order --systems lists them (fixed)")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs an interrupted comparison left in --out (each rep<k> with its summary.json "
                        "and requests.csv) and run only the rest, in the same orders")
    p.add_argument("--dtype", default="float32", help="model dtype (float32 on CPU)")
    p.add_argument("--max-model-len", type=int, help="default: min(model max positions, base KV capacity)")
    p.add_argument("--max-num-seqs", type=int, help="engine batch limit (default: vLLM's)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="extra engine argument for every system, repeatable (e.g. --engine-arg=--enforce-eager)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra server environment")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--out", required=True, help="output directory")
    add_workload_args(p)
    add_bench_args(p)
    p.set_defaults(func=run)


def model_kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """2 (K and V) x layers x KV heads x head dim x element size, from the HF config."""
    cfg = json.loads((model_dir / "config.json").read_text())
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{model_dir}/config.json: cannot derive the KV size per token ({e})") from None
    size = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}.get(dtype)
    if size is None:
        raise ValueError(f"--dtype {dtype!r}: unknown element size")
    return 2 * layers * kv_heads * head_dim * size


def _parse_env(items: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for it in items:
        if "=" not in it or not it.split("=", 1)[0]:
            raise ValueError(f"--env {it!r}: expected KEY=VALUE")
        k, v = it.split("=", 1)
        out.append((k, v))
    return tuple(out)


def run(args: argparse.Namespace) -> int:
    from vllm_kunserve.bench.compare import compare, mean_ratio, write_compare
    from vllm_kunserve.bench.runner import run_bench
    from vllm_kunserve.bench.systems import (CommonArgs, builtin_systems, derived_systems, select_systems,
                                             variant_systems)
    from vllm_kunserve.config import parse_kunserve_config
    from vllm_kunserve.bench.workload import build_trace, options_from_args

    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"--model: no config.json in {model} (make one with `kunserve make-model`)")
    if args.trace and not Path(args.trace).exists():
        raise FileNotFoundError(f"--trace: no such file: {args.trace}")
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    if not args.oracle_kv_multiplier >= 1:
        raise ValueError(f"--oracle-kv-multiplier must be >= 1, got {args.oracle_kv_multiplier}")
    kcfg = parse_kunserve_config(args.kunserve_config)
    if not 1 <= args.instances <= 64:
        raise ValueError(f"--instances must be 1..64, got {args.instances}")
    if args.dispatch is not None:
        from vllm_kunserve.policy.dispatch import check_mode
        check_mode(args.dispatch)
    if args.oracle_equal_kv_multiplier is not None and not args.oracle_equal_kv_multiplier >= 1:
        raise ValueError(f"--oracle-equal-kv-multiplier must be >= 1, got {args.oracle_equal_kv_multiplier}")
    if args.tuned_max_num_seqs is not None and args.tuned_max_num_seqs < 1:
        raise ValueError(f"--tuned-max-num-seqs must be >= 1, got {args.tuned_max_num_seqs}")
    available = builtin_systems(kcfg, args.oracle_kv_multiplier, args.instances, args.dispatch,
                                args.tuned_max_num_seqs, args.oracle_equal_kv_multiplier)
    available.update(variant_systems(args.variant, kcfg, available))
    available.update(derived_systems(args.derive, available))
    systems = select_systems(args.systems, available)

    per_token = model_kv_bytes_per_token(model, args.dtype)
    per_block = per_token * args.block_size
    kv_bytes = args.kv_cache_bytes if args.kv_cache_bytes else args.kv_capacity_tokens * per_token
    if kv_bytes < per_block:
        raise ValueError(f"KV capacity below one block ({per_block} bytes at block size {args.block_size})")
    kv_bytes = kv_bytes // per_block * per_block
    cap_tokens = kv_bytes // per_token
    max_pos = json.loads((model / "config.json").read_text()).get("max_position_embeddings") or cap_tokens
    # vLLM keeps one block back (the null block): one request of max_model_len must fit in the rest
    usable = cap_tokens - args.block_size
    if usable < 2:
        raise ValueError(f"KV capacity of {cap_tokens} tokens leaves no room for a request at block size {args.block_size}")
    max_len = args.max_model_len or min(int(max_pos), usable)
    if max_len > usable:
        raise ValueError(f"--max-model-len {max_len} exceeds the base KV capacity less one block ({usable} tokens)")

    common = CommonArgs(model=str(model), dtype=args.dtype, block_size=args.block_size, kv_cache_bytes=kv_bytes,
                        max_model_len=max_len, max_num_seqs=args.max_num_seqs, extra_args=tuple(args.engine_arg),
                        env=_parse_env(args.env))
    tok, factory = make_factory(None, str(model), args.prompt_mode, args.seed)
    wopts = options_from_args(args, kv_capacity_tokens=cap_tokens, block_size=args.block_size,
                              max_total_len=min(args.max_total_len or max_len, max_len))
    count = (lambda s: len(tok(s, add_special_tokens=False)["input_ids"])) if args.format == "sharegpt" else None
    trace, winfo = build_trace(wopts, count)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    log(f"trace: {json.dumps(trace.describe())}")
    log(f"KV capacity {cap_tokens} tokens ({kv_bytes} bytes); " + (
        f"in flight at most {args.max_concurrency} (a closed loop: the trace's arrival times set only the order)"
        if args.max_concurrency else f"estimated demand mean {winfo.get('est_kv_demand_mean_share', 0):.2f}x, "
                                     f"peak {winfo.get('est_kv_demand_peak_share', 0):.2f}x"))

    def bench(spec, rep, endpoint, run_dir):
        opts = bench_options(args, endpoint, common.served_name, title=f"{spec.name} rep {rep + 1}")
        return run_bench(trace, factory, opts, run_dir, demand_model=wopts.demand_model(),
                         kv_capacity_tokens=cap_tokens, workload_info=winfo)

    try:
        res = compare(systems, common, out, args.repeat, bench, startup_timeout_s=args.startup_timeout, log=log,
                      shuffle_seed=args.seed if args.order == "shuffled" else None, resume=args.resume)
    except RuntimeError as e:  # a server failed to start: its log tail is in the message
        print(f"kunserve compare: error: {e}", file=sys.stderr)
        return 1
    res.workload = {"trace": trace.describe(), **winfo, "kv_capacity_tokens": cap_tokens,
                    "kv_bytes_per_token": per_token}
    res.args = {k: v for k, v in vars(args).items() if k != "func"}
    names = [s.name for s in systems]
    text = write_compare(out, res, names)
    print(text)
    if "oracle" in names and res.baseline != "oracle":
        r = mean_ratio(res, res.baseline, "oracle", "ttft_p99")
        if r is not None:
            print(f"\n{res.baseline}/oracle P99 TTFT ratio: {r:.2f}x")
    print(f"\nwrote {out / 'compare.json'}, {out / 'compare.md'}, {out / 'ttft_cdf.png'}")
    return 0
