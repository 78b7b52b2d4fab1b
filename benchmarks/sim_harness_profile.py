"""Derive a vLLM-CPU step-time profile from measured harness runs (no new measurement).

The harness logs no per-step timing (``server.log`` has only vLLM's 10 s throughput lines), so this
uses the requests that ran alone, timed under the run's own host conditions
(``vllm_kunserve.sim.harness.solo_profile_rows``): solo prefills give ``[[0, prompt]]`` steps
(TTFT), solo requests give one-request decode steps ``[[prompt + output/2, 1]]`` (TPOT). Batch
shapes that solo requests cannot show (several decodes, mixed steps) are extrapolated by the
fitted Eq. 1-3 form; docs/benchmarks/sim_validation.md checks the result against whole runs.
Calibrate on runs that are not validated (the `kunserve` system: the plugin inert on one engine).

    python benchmarks/sim_harness_profile.py --runs /tmp/kbench/harness/kunserve/rep1,... \\
        --out docs/benchmarks/sim_cpu_small_insitu_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def main() -> int:
    from vllm_kunserve.sim.harness import load_run_requests, solo_profile_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, help="comma-separated harness run dirs (each with requests.csv)")
    ap.add_argument("--out", default="docs/benchmarks/sim_cpu_small_insitu_profile.json")
    a = ap.parse_args()
    runs = [x for x in a.runs.split(",") if x]
    rows: list[dict] = []
    for d in runs:
        for r in solo_profile_rows(load_run_requests(os.path.join(d, "requests.csv"))):
            rows.append({**r, "run": d})
    if len(rows) < 3:
        raise SystemExit(f"only {len(rows)} solo steps found in {a.runs}: need at least 3")
    dec = [r["ms"] for r in rows if r["kind"] == "decode"]
    meta = {"source": "solo requests of measured harness runs (benchmarks/sim_harness_profile.py)",
            "command": "python " + " ".join(sys.argv), "runs": runs, "rows": len(rows),
            "prefill_rows": len(rows) - len(dec), "decode_rows": len(dec),
            "decode_ms_median": statistics.median(dec) if dec else None, "device": "cpu", "dtype": "float32"}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        f.write('{"attention": true, "meta": ' + json.dumps(meta) + ', "rows": [\n')
        f.write(",\n".join(json.dumps(r) for r in rows) + "\n]}\n")
    print(f"wrote {len(rows)} solo steps ({meta['prefill_rows']} prefill, {len(dec)} decode) to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
