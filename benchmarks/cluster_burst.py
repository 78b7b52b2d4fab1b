"""Cluster drop under a burst: stock vs kunserve vs oracle on 2 engines, where KV is worth throughput.

1. The batch-scaling table of this machine (``benchmarks/batch_scaling.py``): decode step at batch
   1 / 4 / 16 / 64 with one compute thread and the model preset the CPU suits; the run is refused
   (``--force`` overrides, and the doc says so) where a batch of 16 costs more than 3x a batch of 1.
2. ``kunserve compare --instances 2``: three 2-engine clusters behind ``kunserve serve`` (least-work
   dispatch), each engine pinned to its own core (``KUNSERVE_ENGINE_CPUS=0|1``): stock vLLM,
   kunserve (cluster drop) and the oracle (stock with 10x KV), ``--repeat`` interleaved
   repetitions on the same decode-heavy workload: a synthetic length mix (64-token prompts,
   256-token outputs) on gamma arrivals (cv 4, 1.2 req/s) by default, or ``--trace`` (Azure conversation
   arrivals with the same synthetic lengths).
3. docs/benchmarks/cluster_burst.{md,json} + the compare outputs: per-repetition paired ratios
   (stock / oracle P99 TTFT, kunserve / oracle, the share of the gap kunserve closes, kunserve /
   stock P50 TPOT) with their spread, the client's send lag (runs with a request sent > 50 ms
   late are flagged and kept out of the ratios), and each system's timeline picture.

    python benchmarks/cluster_burst.py [--repeat 5] [--out runs/cluster_burst] [--force]

Each engine's KV holds ``--kv-tokens`` tokens (5,120 by default): the weights are ~90% of an
engine's memory, so a 2-engine group holds ~5x the tokens of the two alone.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks" / "cluster_burst.md"
ASSETS = ROOT / "docs" / "benchmarks" / "cluster_burst"
KUNSERVE = {"drop": {"trigger_ratio": 0.9, "forecast_horizon_s": 2.0},
            "restore": {"threshold": 0.4, "hold_s": 5.0}}


def compare_argv(model: Path, dtype: str, out: Path, a: argparse.Namespace) -> list[str]:
    argv = ["compare", "--model", str(model), "--instances", "2", "--dispatch", "least-work",
            "--systems", "vllm,kunserve,oracle", "--repeat", str(a.repeat),
            "--kunserve-config", json.dumps(KUNSERVE), "--kv-capacity-tokens", str(a.kv_tokens),
            "--block-size", "32", "--dtype", dtype, "--max-model-len", "1024", "--engine-arg=--enforce-eager",
            "--env", "KUNSERVE_ENGINE_CPUS=0|1", "--env", "OMP_NUM_THREADS=1",
            "--prompt-len", str(a.prompt_len), "--output-len", str(a.output_len), "--seed", "1", "--out", str(out)]
    if a.trace:
        argv += ["--trace", a.trace, "--format", "azure", "--window-offset", "auto",
                 "--window-duration", str(a.window)]
    else:
        argv += ["--format", "gamma", "--cv", "4", "--rate", str(a.rate), "--num-requests", str(a.requests)]
    return argv


def paired(res: dict) -> dict:
    runs = res["runs"]
    rows = []
    for k, (s, ks, o) in enumerate(zip(runs["vllm"], runs["kunserve"], runs["oracle"])):
        lags = [r.get("late_sends", 0) for r in (s, ks, o)]
        sp, kp, op_ = (r["ttft_s"]["p99"] for r in (s, ks, o))
        gap = (sp - kp) / (sp - op_) if sp and op_ and sp > op_ else None
        rows.append({"rep": k + 1, "stock_over_oracle": sp / op_ if op_ else None,
                     "kunserve_over_oracle": kp / op_ if op_ else None, "gap_closed": gap,
                     "tpot_p50_kunserve_over_stock": ks["tpot_s"]["p50"] / s["tpot_s"]["p50"] if s["tpot_s"]["p50"] else None,
                     "failed": [s["failed"], ks["failed"], o["failed"]], "late_sends": lags,
                     "valid": sum(lags) == 0})
    return rows


def spread(rows: list[dict], key: str) -> dict:
    v = [r[key] for r in rows if r["valid"] and r[key] is not None]
    if not v:
        return {"n": 0}
    return {"n": len(v), "median": statistics.median(v), "min": min(v), "max": max(v)}


def render(scaling: dict, res: dict, argv: list[str], forced: bool) -> str:
    rows = paired(res)
    keys = ("stock_over_oracle", "kunserve_over_oracle", "gap_closed", "tpot_p50_kunserve_over_stock")
    sp = {k: spread(rows, k) for k in keys}
    lines = ["# Cluster drop under a burst (written by benchmarks/cluster_burst.py)", "",
             f"Command: `python benchmarks/cluster_burst.py {' '.join(sys.argv[1:])}`; the comparison it ran: "
             f"`kunserve {shlex.join(argv)}`.", "",
             "## Regime: decode step vs batch size on this machine", "",
             f"{scaling['cpu']}, preset `{scaling['preset']}` ({scaling['dtype']}), {scaling['threads']} compute "
             f"thread(s):", "", "| batch | step (ms) | tokens/s |", "|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['step_ms']} | {r['tokens_per_s']} |" for r in scaling["rows"]]
    lines += ["", f"Batch 16 / batch 1 per step: {scaling['step16_over_step1']:.2f}x "
              + ("(valid: <= 3x)." if scaling["valid_regime"] else
                 "(**not** a valid regime: > 3x" + ("; run forced with --force" if forced else "") + ")."), "",
              "## Paired ratios per repetition (P99 TTFT over the run)", "",
              "| rep | stock / oracle | kunserve / oracle | gap closed | kunserve / stock P50 TPOT | failed (s/k/o) | late sends (s/k/o) |",
              "|---:|---:|---:|---:|---:|---|---|"]

    def f(x):
        return "-" if x is None else f"{x:.2f}"
    for r in rows:
        lines.append(f"| {r['rep']}{'' if r['valid'] else ' (late client: excluded)'} | {f(r['stock_over_oracle'])} | "
                     f"{f(r['kunserve_over_oracle'])} | {f(r['gap_closed'])} | "
                     f"{f(r['tpot_p50_kunserve_over_stock'])} | {r['failed']} | {r['late_sends']} |")
    lines += ["", "Median (min..max) over valid repetitions: " + "; ".join(
        f"{k}: {f(v.get('median'))} ({f(v.get('min'))}..{f(v.get('max'))}, n={v['n']})" for k, v in sp.items()), "",
        "Targets (issue 13): stock / oracle >= 3; gap closed >= 0.8 and kunserve / oracle <= 1.3; "
        "kunserve / stock P50 TPOT <= 1.3; zero failed.", "",
        "Timelines (rep 1): " + ", ".join(f"`cluster_burst/timeline_{n}.png`" for n in ("vllm", "kunserve", "oracle")),
        "", "Raw data: `cluster_burst/compare.json` (every repetition's summary), `cluster_burst.json`."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "runs" / "cluster_burst"))
    ap.add_argument("--kv-tokens", type=int, default=5120)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rate", type=float, default=1.2)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--trace", default="")
    ap.add_argument("--window", type=float, default=300.0)
    ap.add_argument("--force", action="store_true", help="run even where the regime check fails")
    ap.add_argument("--reuse-scaling", action="store_true",
                    help="use docs/benchmarks/batch_scaling.json as measured (skip step 1)")
    a = ap.parse_args()
    if not a.reuse_scaling:
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "batch_scaling.py")], check=True)
    scaling = json.loads((ROOT / "docs" / "benchmarks" / "batch_scaling.json").read_text())
    if not scaling["valid_regime"] and not a.force:
        print(f"refusing: batch 16 costs {scaling['step16_over_step1']:.2f}x batch 1 per step here (> 3x); "
              "KV capacity is not worth throughput on this machine (--force to run anyway)")
        return 2
    from vllm_kunserve.cli.main import main as kunserve
    from vllm_kunserve.tools.make_model import PRESETS

    model = ROOT / "models" / scaling["preset"]
    out = Path(a.out)
    argv = compare_argv(model, PRESETS[scaling["preset"]].dtype, out, a)
    print("running: kunserve " + shlex.join(argv), flush=True)
    rc = kunserve(argv)
    if rc != 0:
        return rc
    res = json.loads((out / "compare.json").read_text())
    ASSETS.mkdir(parents=True, exist_ok=True)
    (ASSETS / "compare.json").write_text(json.dumps(res, indent=1) + "\n")
    for n in ("vllm", "kunserve", "oracle"):
        src = out / n / "rep1" / "timeline.png"
        if src.exists():
            (ASSETS / f"timeline_{n}.png").write_bytes(src.read_bytes())
    (ROOT / "docs" / "benchmarks" / "cluster_burst.json").write_text(
        json.dumps({"scaling": scaling, "paired": paired(res), "argv": argv, "forced": a.force}, indent=1) + "\n")
    DOC.write_text(render(scaling, res, argv, a.force))
    print(DOC.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
