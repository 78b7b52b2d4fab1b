"""`make demo`: the embedded default job, a burst on one engine, stock vs kunserve side by side.

1. Builds a small random-weight Llama offline (8 layers, 29 MB of fp32 weights).
2. Runs `kunserve compare`: the same burst (32 requests of 160 prompt + 80 output tokens arriving
   at 8 req/s) against stock `vllm serve`, `vllm serve` with kunserve remap, and the oracle (stock
   with 10x the KV memory), each on 127.0.0.1, one after the other.
3. Prints one table with ratios to stock (TTFT, TPOT, preemptions, ...).

The KV budget is 0.75x the weights, so the burst needs ~1.4x the KV the engine has: stock vLLM
preempts and recomputes, kunserve turns streamed layers' weight memory into KV instead.
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
    argv = ["compare", "--model", str(model), "--systems", "vllm,kunserve,oracle", "--repeat", "1",
            "--kunserve-config", json.dumps(KUNSERVE), "--kv-cache-bytes", str(KV_BYTES), "--block-size", "32",
            "--max-model-len", "512", "--engine-arg=--enforce-eager", "--format", "poisson",
            "--num-requests", "32", "--rate", "8", "--prompt-len", "160", "--output-len", "80", "--seed", "1",
            "--out", str(out)]
    print("running: kunserve " + " ".join(argv), flush=True)
    rc = kunserve(argv)
    if rc == 0:
        print(f"\nper-request CSVs, timelines and plots under {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
