"""``kunserve config-docs``: print the generated configuration reference."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config-docs", help="print the configuration reference (docs/config.md)")
    p.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the generated text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kunserve.config import render_docs

    text = render_docs() + "\n"
    if args.check:
        with open(args.check, encoding="utf-8") as f:
            if f.read() != text:
                print(f"{args.check} is stale: regenerate with `kunserve config-docs > {args.check}`")
                return 1
        return 0
    print(text, end="")
    return 0
