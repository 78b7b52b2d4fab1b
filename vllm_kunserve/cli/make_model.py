"""``kunserve make-model OUT --preset tiny|small``: random-weight Llama + BPE tokenizer, offline."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    from vllm_kunserve.tools.make_model import PRESETS

    p = sub.add_parser("make-model", help="build a random-weight Llama model with a BPE tokenizer, offline")
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    for name in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab", "seed"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"override the preset's {name}")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kunserve.tools.make_model import build_model, spec_from_args

    spec = spec_from_args(
        args.preset, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
        intermediate=args.intermediate, vocab=args.vocab, seed=args.seed, dtype=args.dtype)
    spec.validate()
    out = build_model(args.out, spec)
    print(json.dumps({"model": str(out), "preset": args.preset, "weight_mb": round(spec.weight_bytes() / 2**20, 2),
                      "kv_kib_per_token": spec.kv_bytes_per_token() / 1024}))
    return 0
