"""`make demo`: the embedded default job, a burst on a 2-engine cluster, stock vs kunserve side by side.

1. Builds a small random-weight Llama offline (8 layers, 29 MB of fp32 weights).
2. Runs `kunserve compare --instances 2`: the same burst (40 decode-heavy requests of 32 prompt +
   192 output tokens arriving at 10 req/s) against three 2-engine clusters, each started with
   `kunserve serve` (one OpenAI endpoint, a monitor, least-work dispatch): stock vLLM engines,
   kunserve engines (cluster drop: the monitor merges the two engines into a pipeline group when
   KV demand passes 80% of capacity and splits them when it falls), and the oracle (stock with 10x
   the KV memory), one after the other.
3. Prints one table with ratios to stock (TTFT, TPOT, preemptions, ...).

Each engine's KV budget is 0.75x its weights (weights ~57% of memory): a group of the two holds
~1.66x their tokens. The burst needs more than that, so stock vLLM queues and preempts, kunserve
drops first and falls back to vLLM's handling for the rest. This small fp32 model is
compute-bound on a CPU (a bigger batch is not cheaper per token), so expect TTFT, not
throughput, to move; docs/benchmarks/ has the regime where KV capacity is worth throughput.
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ["--preset", "small", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--intermediate", "768",
        "--vocab", "2048"]
KV_BYTES = 22 << 20
KUNSERVE = {"drop": {"trigger_ratio": 0.8, "forecast_horizon_s": 0.0},
            "restore": {"threshold": 0.3, "hold_s": 2.0}}


def main() -> int:
    from vllm_kunserve.cli.main import main as kunserve

    model = ROOT / "models" / "demo"
    if not (model / "config.json").exists():
        print(f"making the demo model in {model} ...", flush=True)
        if kunserve(["make-model", str(model), *SPEC]) != 0:
            return 1
    out = ROOT / "runs" / "demo"
    argv = ["compare", "--model", str(model), "--instances", "2", "--systems", "vllm,kunserve,oracle", "--repeat", "1",
            "--kunserve-config", json.dumps(KUNSERVE), "--kv-cache-bytes", str(KV_BYTES), "--block-size", "32",
            "--max-model-len", "512", "--engine-arg=--enforce-eager", "--format", "poisson",
            "--num-requests", "40", "--rate", "10", "--prompt-len", "32", "--output-len", "192", "--seed", "1",
            "--out", str(out)]
    print("running: kunserve " + " ".join(argv), flush=True)
    rc = kunserve(argv)
    if rc == 0:
        print("\nHow to read it: each column is a 2-engine cluster behind `kunserve serve` under the same burst;")
        print("(0.58x) = kunserve's value / stock's (lower TTFT and TPOT are better, higher throughput is better).")
        print("One repetition on this machine's CPU cores: see docs/benchmarks/ for repeated, paired runs.")
        print(f"per-request CSVs, timelines and plots under {out}")
    return rc


if __name__ == "__main__":
    from vllm_kunserve.runtime.quietexit import quiet_exit

    code = main()   # every engine is stopped by now: skip the teardown's nanobind lines (runtime/quietexit.py)
    quiet_exit(code)
    sys.exit(code)
