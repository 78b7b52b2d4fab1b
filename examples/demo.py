"""`make demo`: a burst on a 2-engine cluster, stock vLLM, kunserve and the equal-memory oracle side by side.

Run from the checkout's root as ``python -m examples.demo`` (what ``make demo`` does; ``python
examples/demo.py`` re-runs itself that way): the comparison is ``benchmarks/common/demo.py``'s
``run_demo``, which ``benchmarks/demo_spread.py`` repeats.

1. Builds, the first time, a random-weight Llama with full multi-head attention under ``models/``
   (32 layers of hidden 512: 336 MiB in fp32, bf16 where the CPU has avx512_bf16 or AMX).
2. Gives each engine KV for ~1790 tokens, so weights are 60% of an engine's memory and a group of the
   two, keeping one copy of the weights, holds 1.75x their KV.
3. Starts each system in turn (two engines behind ``kunserve serve``, each on its own core): stock vLLM
   first, on which it measures the decode speed of this machine (a few seconds), and sets the burst's
   rate from it: 48 requests of 64 prompt and 128..256 output tokens whose KV demand would peak at
   1.3x stock's KV. Then kunserve (cluster drop) and oracle-equal (stock with the KV a group reaches).
4. Prints one table with ratios to stock, the regime, and what the ratios mean in this run's numbers;
   writes ``runs/demo/timeline.png`` (queue, KV in use and TTFT over the burst, every system).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "runs" / "demo"), help="run directory (default runs/demo)")
    ap.add_argument("--seed", type=int, default=1, help="arrivals, lengths and prompts")
    ap.add_argument("--with-oracle", action="store_true",
                    help="also the 10x-KV oracle (one more cluster start, ~1.5 min on a 2-core Zen 3)")
    a = ap.parse_args(argv)

    from benchmarks.common.demo import SYSTEMS, footer_lines, machine, regime_lines, run_demo

    m = machine()
    print(f"kunserve demo on {m['cpu']} ({m['class']}): stock vLLM, kunserve and oracle-equal, one after the other "
          "(each: start 2 engines, replay the burst, stop)", flush=True)
    systems = (*SYSTEMS, "oracle") if a.with_oracle else SYSTEMS
    res = run_demo(Path(a.out), seed=a.seed, systems=systems, log=lambda s: print(s, file=sys.stderr, flush=True))
    print()
    print("\n".join(regime_lines(res)))
    print()
    print(res.table)
    print()
    print("\n".join(footer_lines(res)))
    print(f"\nThe burst over time, every system: {Path(res.out) / 'timeline.png'}; per-request CSVs and each run's own "
          f"plots under {res.out}/<system>/rep1/. Demo wall time {res.wall_s:.0f} s.")
    return 0


if __name__ == "__main__":
    if not __package__:   # run by path: again as a module from the checkout, so `benchmarks` imports
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "examples.demo", *sys.argv[1:]])
    from vllm_kunserve.runtime.quietexit import quiet_exit

    code = main()   # every engine is stopped by now: skip the teardown's nanobind lines (runtime/quietexit.py)
    quiet_exit(code)
    sys.exit(code)
