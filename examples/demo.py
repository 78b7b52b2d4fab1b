"""`make demo`: `kunserve demo`, the embedded default job. One burst where KV binds and compute does
not, on three 2-engine clusters side by side (stock vLLM, kunserve's cluster drop, and stock with the
group's memory): the regime, the table, a footer that reads it, and a timeline picture.
vllm_kunserve/cli/demo.py says how the regime is chosen."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    from vllm_kunserve.cli.main import main
    from vllm_kunserve.runtime.quietexit import quiet_exit

    code = main(["demo", "--model", str(ROOT / "models" / "demo-48x256"), "--out", str(ROOT / "runs" / "demo")])
    quiet_exit(code)   # every engine is stopped by now: skip the teardown's nanobind lines (runtime/quietexit.py)
    sys.exit(code)
