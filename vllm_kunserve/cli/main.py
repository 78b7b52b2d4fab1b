"""Entry point of the ``kunserve`` console script.

Every subcommand is a module in this package exposing ``add_parser(subparsers)``, which registers
its parser and sets ``func`` (called with the parsed args, returning an exit code). Modules are
imported lazily by name so a command's heavy imports (vLLM, torch) cost nothing to the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from vllm_kunserve import __version__

# module name -> one-line help (shown even if the module's own imports are heavy)
COMMANDS: dict[str, str] = {
    "doctor": "report versions, devices, plugin registration and usable memory backends",
    "make_model": "build a tiny random-weight Llama model with a BPE tokenizer, offline",
    "config_docs": "print the configuration reference (docs/config.md)",
    "plan": "policy decisions as JSON in/out: drop, restore, microbatch, remap, placement",
    "costmodel": "fit and evaluate the batch cost model",
    "bench": "replay a trace against an OpenAI-compatible endpoint",
    "compare": "run stock vLLM, kunserve and the oracle on the same trace, side by side",
    "demo": "one burst on three 2-engine clusters (stock, kunserve, oracle-equal), side by side (make demo)",
    "simulate": "discrete-event cluster simulation of a trace under several policies",
    "serve": "serve N vLLM engines behind one OpenAI-compatible endpoint (front end, monitor, dispatch)",
    "status": "print an engine's (or a kunserve front end's) state from its control port as a table",
}


def _cmd_name(module: str) -> str:
    return module.replace("_", "-")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kunserve", description="vllm-kunserve tools")
    parser.add_argument("--version", action="version", version=f"vllm-kunserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = None
    if argv:
        first = next((a for a in argv if not a.startswith("-")), None)
        wanted = {m for m in COMMANDS if _cmd_name(m) == first} or None
    for module in COMMANDS:
        if wanted is not None and module not in wanted:
            # only import the module actually asked for; list the others by name
            sub.add_parser(_cmd_name(module), help=COMMANDS[module])
            continue
        importlib.import_module(f"vllm_kunserve.cli.{module}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:
        # bad input: one clear line, no traceback
        print(f"kunserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
