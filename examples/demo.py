"""`make demo`: the embedded default job. One burst where KV binds and compute does not, on three
2-engine clusters side by side (stock vLLM, kunserve's cluster drop, and stock with the group's
memory): the regime, the table, a footer that reads it, and a timeline picture.
vllm_kunserve/bench/demo.py says how the regime is chosen."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    from vllm_kunserve.bench.demo import run_demo

    try:
        run_demo(ROOT / "models" / "demo-48x256", ROOT / "runs" / "demo")
    except RuntimeError as e:
        print(f"make demo: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from vllm_kunserve.runtime.quietexit import quiet_exit

    code = main()   # every engine is stopped by now: skip the teardown's nanobind lines (runtime/quietexit.py)
    quiet_exit(code)
    sys.exit(code)
