"""`make demo`: the embedded default job, a burst on a 2-engine cluster, stock vs kunserve side by side.

1. Builds a small random-weight Llama offline (8 layers, 29 MB of fp32 weights).
2. Runs `kunserve compare --instances 2`: the same burst (64 requests of 160 prompt + 80 output
   tokens arriving at 16 req/s) against three 2-engine clusters, each started with
   `kunserve serve` (one OpenAI endpoint, a monitor, least-work dispatch): stock vLLM engines,
   kunserve engines (remap), and the oracle (stock with 10x the KV memory), one after the other.
3. Prints one table with ratios to stock (TTFT, TPOT, preemptions, ...).

Each engine's KV budget is 0.75x its weights, so the burst needs ~1.4x the KV the cluster has:
stock vLLM preempts and recomputes, kunserve turns streamed layers' weight memory into KV instead.
The cluster-level drop (engines merging into pipeline groups) is not in this demo yet.
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ["--preset", "small", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--intermediate", "768",
        "--vocab", "2048"]
KV_BYTES = 22 << 20
KUNSERVE = {"remap": {"enable": True, "max_fraction": 0.75, "revert_hold_s": 1.0}}


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
            "--num-requests", "64", "--rate", "16", "--prompt-len", "160", "--output-len", "80", "--seed", "1",
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
    sys.exit(main())
