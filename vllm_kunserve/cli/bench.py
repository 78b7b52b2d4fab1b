"""``kunserve bench``: replay a trace against an OpenAI-compatible endpoint and write the results."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Replay options shared with ``kunserve compare``."""
    g = p.add_argument_group("replay")
    g.add_argument("--prompt-mode", choices=("ids", "text"), default="ids",
                   help="prompts as token-id lists (exact, default) or text checked with the tokenizer")
    g.add_argument("--request-timeout", type=float, default=300.0, help="per-request timeout in seconds")
    g.add_argument("--deadline", type=float, help="overall replay deadline in seconds (default: trace span + timeout)")
    g.add_argument("--warmup", type=int, default=2, help="unrecorded warm-up requests before the replay")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--no-scrape", action="store_true", help="do not scrape the server's /metrics")
    g.add_argument("--slo-ref-ttft", type=float, help="reference P50 TTFT (s) for SLO attainment (default: own)")
    g.add_argument("--slo-ref-tpot", type=float, help="reference P50 TPOT (s) for SLO attainment (default: own)")
    g.add_argument("--max-concurrency", metavar="N[,N@SECONDS...]",
                   help="at most N requests in flight (vllm bench serve's meaning): a request whose arrival time has "
                        "come waits for a free slot and counts as arriving when it gets one; with every arrival at 0 "
                        "(a high --rate) a closed loop of N users. N,N@SECONDS,... changes N over time (e.g. "
                        "14,28@15,14@30: a burst of users from 15 s to 30 s)")
    g.add_argument("--client-realtime", action="store_true",
                   help="replay from a real-time thread (SCHED_FIFO, not inherited by anything it starts): on a host "
                        "whose cores the servers fill, the client then sends on time (needs root or CAP_SYS_NICE)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    from vllm_kunserve.bench.workload import add_workload_args

    p = sub.add_parser("bench", help="replay a trace against an OpenAI-compatible endpoint",
                       description="Replay a trace against an OpenAI /v1/completions endpoint honouring arrival "
                                   "times; write requests.csv, timeline.csv, summary.json and PNG plots to --out.")
    p.add_argument("--endpoint", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="served model name (the API's `model` field)")
    p.add_argument("--tokenizer", help="tokenizer name or dir (default: --model when it is a local dir)")
    p.add_argument("--kv-capacity-tokens", type=int,
                   help="KV capacity for --target-kv-share and plots (default: read from the server's metrics)")
    p.add_argument("--out", required=True, help="output directory")
    add_workload_args(p)
    add_bench_args(p)
    p.set_defaults(func=run)


def make_factory(tokenizer_src: str | None, model: str, mode: str, seed: int):
    from vllm_kunserve.bench.prompts import PromptFactory, load_tokenizer, vocab_size_from_config

    src = tokenizer_src or (model if Path(model).is_dir() else None)
    if src is None:
        raise ValueError("prompt synthesis needs the served tokenizer: pass --tokenizer (name or dir)")
    tok = load_tokenizer(src)
    vocab = vocab_size_from_config(src) if Path(src).is_dir() else None
    return tok, PromptFactory(tok, vocab_size=vocab, mode=mode, seed=seed)


def server_cache_info(endpoint: str) -> tuple[int | None, int | None]:
    """(KV capacity in tokens, block size) from the server's ``vllm:cache_config_info``, or Nones."""
    import asyncio

    from vllm_kunserve.bench.scrape import scrape_once

    try:
        _, info = asyncio.run(scrape_once(endpoint))
        bs = int(info["block_size"])
        return int(info["num_gpu_blocks"]) * bs, bs
    except Exception:  # noqa: BLE001 - metrics not exposed or unexpected: capacity unknown
        return None, None


def bench_options(args: argparse.Namespace, endpoint: str, model: str, title: str = ""):
    from vllm_kunserve.bench.runner import BenchOptions

    for name in ("request_timeout", "deadline"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {v}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    from vllm_kunserve.bench.client import parse_concurrency

    schedule = parse_concurrency(args.max_concurrency) if args.max_concurrency is not None else None
    return BenchOptions(endpoint=endpoint, model=model, request_timeout_s=args.request_timeout,
                        deadline_s=args.deadline, warmup=args.warmup, progress=not args.no_progress and sys.stderr.isatty(),
                        scrape=not args.no_scrape, plots=not args.no_plots, ref_ttft_s=args.slo_ref_ttft,
                        ref_tpot_s=args.slo_ref_tpot, title=title, realtime=args.client_realtime,
                        max_concurrency=schedule)


def run(args: argparse.Namespace) -> int:
    from vllm_kunserve.bench.runner import run_bench
    from vllm_kunserve.bench.workload import build_trace, options_from_args

    if args.trace and not Path(args.trace).exists():
        raise FileNotFoundError(f"--trace: no such file: {args.trace}")
    opts = bench_options(args, args.endpoint, args.model, title=f"{args.model} @ {args.endpoint}")
    cap, bs = (None, None) if args.no_scrape else server_cache_info(args.endpoint)
    cap = args.kv_capacity_tokens or cap
    wopts = options_from_args(args, kv_capacity_tokens=cap, block_size=bs or 16)
    if args.format == "sharegpt":  # lengths are counted with the served tokenizer
        tok, factory = make_factory(args.tokenizer, args.model, args.prompt_mode, args.seed)
        trace, info = build_trace(wopts, lambda s: len(tok(s, add_special_tokens=False)["input_ids"]))
    else:  # trace errors first: they are cheaper to find than a tokenizer
        trace, info = build_trace(wopts)
        tok, factory = make_factory(args.tokenizer, args.model, args.prompt_mode, args.seed)
    print(f"replaying {len(trace)} requests over {trace.duration_s:.1f} s against {args.endpoint}", file=sys.stderr)
    summary = run_bench(trace, factory, opts, Path(args.out), demand_model=wopts.demand_model(),
                        kv_capacity_tokens=cap, workload_info=info).summary
    keys = ("requests", "completed", "failed", "throughput_rps", "output_tokens_per_s", "preemptions")
    short = {k: summary.get(k) for k in keys}
    short["ttft_p50_s"], short["ttft_p99_s"] = summary["ttft_s"]["p50"], summary["ttft_s"]["p99"]
    short["tpot_p50_s"], short["tpot_p99_s"] = summary["tpot_s"]["p50"], summary["tpot_s"]["p99"]
    short["out"] = str(args.out)
    print(json.dumps(short, indent=2))
    return 0 if summary["completed"] else 1

