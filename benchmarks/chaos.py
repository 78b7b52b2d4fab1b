"""Chaos under a burst (issue 36): completion, token identity and tail TTFT while engines die.

Four engines (the tests' 8-layer burst model, 29 MB fp32, KV 0.75x the weights) behind `kunserve
serve` on this machine's cores; a burst of streamed requests (Poisson arrivals, random prompts,
``--output-len`` tokens each, greedy); a driver hard-kills a random ready engine every
``--kill-every`` seconds while more than ``--min-ready`` are ready (a killed engine restarts, which
takes minutes on two cores while the others serve: a restart may not finish within the run) and,
in turn every ``--ops-every`` seconds, forces a drop of two random ready engines, a drop of every
ready engine (a regroup keeping the KV where a live group lies whole inside it) and a restore.
Reference: the same requests on the same fleet before the driver starts. See
``benchmarks/common/chaos.py``.

    python -m benchmarks.chaos [--requests 400] [--duration 240]

Writes docs/benchmarks/chaos.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from benchmarks.common.chaos import ChaosSpec, run_chaos, summarise
from vllm_kunserve.bench.report import command, cpu_model, md_table, write_json
from vllm_kunserve.cluster.fleet.launcher import KunserveCluster
from vllm_kunserve.tools.make_model import CheckpointSpec, build_model

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks"
#: tests/vllm/conftest.py's BURST_SPEC and BURST_KV_BYTES
MODEL = CheckpointSpec(layers=8, hidden=256, heads=4, kv_heads=2, intermediate=768, vocab=2048)
KV_BYTES = 22 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--duration", type=float, default=240.0)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kill-every", type=float, default=15.0)
    ap.add_argument("--min-ready", type=int, default=2, help="never kill below this many ready engines")
    ap.add_argument("--ops-every", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    model = ROOT / "models" / "burst8"
    if not (model / "config.json").exists():
        build_model(model, MODEL)
    spec = ChaosSpec(requests=a.requests, duration_s=a.duration, output_len=a.output_len, kill_every_s=a.kill_every,
                     min_ready=a.min_ready, ops_every_s=a.ops_every, seed=a.seed)
    args = ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(KV_BYTES),
            "--max-model-len", "512", "--enforce-eager", "--served-model-name", "m"]
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "serve.log"
        with KunserveCluster(str(model), args, {"drop": {"enable": False}}, log_path=log, instances=a.instances,
                             startup_timeout_s=900, extra=["--monitor-interval", "0.25", "--log-dir", d]) as srv:
            run = asyncio.run(run_chaos(srv.url, spec))
    s = summarise(run)
    res = {"command": command("chaos.py", sys.argv[1:]), "cpu": cpu_model(), "instances": a.instances,
           "spec": asdict(spec), "summary": s, "actions": run.actions,
           "requests": [{"idx": r.idx, "send_s": round(r.send_s, 3), "ok": r.ok, "ttft_s": r.ttft_s,
                         "e2e_s": r.e2e_s, "tokens": len(r.token_ids), "error": r.error[:200]} for r in run.results]}
    write_json(OUT / "chaos.json", res, indent=1)
    f = s["fleet"]
    lines = ["# Chaos under a burst (written by benchmarks/chaos.py)", "",
             f"Command: `{res['command']}`; {res['cpu']}, {a.instances} engines of the tests' 8-layer burst model on "
             "this machine's cores. Raw: `chaos.json` (every request and driver action).", "",
             "## Verdict (target: 100% of requests complete, token-identical to the run without faults)", "",
             f"- completed: **{s['completed']} / {s['requests']}**; token-identical: **{s['token_identical']} / "
             f"{s['requests']}**" + (f"; failed: {s['failed']}" if s["failed"] else "")
             + (f"; differing: {s['differ']}" if s["differ"] else ""), "",
             "## What happened", ""]
    lines += md_table(["kills", "drops formed", "of them regroups keeping the KV", "drops refused",
                       "restores ordered", "group ops (op, outcome: n)", "failovers (re-prefills)", "migrations",
                       "engine restarts"],
                      "rrrrrlrrr",
                      [[s["kills"], s["drops_ok"], s["regroups_kept_kv"], s["drops_refused"], s["restores"],
                        ", ".join(f"{k}: {v}" for k, v in sorted(f["group_ops"].items())) or "-",
                        f["failovers"], f["migrations"], f["engine_restarts"]]])
    lines += ["", "## TTFT (s)", "",
              "Near a kill: requests sent at most 10 s after a kill and still running at it (their engine may "
              "have died under them); calm: the rest.", ""]
    tail_cells = lambda t: ([t["n"], *(f"{t[k]:.3f}" for k in ("p50", "p99", "max"))] if t["n"]  # noqa: E731
                            else [0, "-", "-", "-"])
    lines += md_table(["requests", "n", "P50", "P99", "max"], "lrrrr",
                      [["near a kill", *tail_cells(s["ttft_near_kill"])], ["calm", *tail_cells(s["ttft_calm"])]])
    lines += ["", "Driver actions, in order: " + "; ".join(
        f"{x['t']:.0f} s {x['action']}" + (f" {x.get('instance', x.get('instances', ''))}" if x["action"] != "restore" else "")
        + (" (a regroup, KV kept)" if x.get("kept_kv") else "")
        + ("" if x["status"] == 200 else f" ({x['status']})") for x in run.actions), ""]
    (OUT / "chaos.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if s["completed"] == s["requests"] == s["token_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
