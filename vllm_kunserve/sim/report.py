"""Text table and files of a multi-policy simulation."""

from __future__ import annotations

import csv
import json
import os


def _f(x, unit=1.0, nd=3):
    return "-" if x is None else f"{x * unit:.{nd}f}"


def _r(x):
    return "-" if x is None else f"{x:.2f}x"


def format_table(out: dict) -> str:
    res, rat = out["results"], out.get("ratios_to_vllm", {})
    head = ("policy", "done", "P50 TTFT s", "P99 TTFT s", "P50 TPOT ms", "P99 TPOT ms", "preempt",
            "drops", "P99 TTFT vs vLLM", "P50 TTFT vs vLLM")
    rows = [head]
    for name, r in res.items():
        s = r["summary"]
        q = rat.get(name, {})
        rows.append((name, f"{s['completed']}/{s['requests']}", _f(s["ttft_s"]["p50"]), _f(s["ttft_s"]["p99"]),
                     _f(s["tpot_s"]["p50"], 1e3, 1), _f(s["tpot_s"]["p99"], 1e3, 1), str(s["preemptions"]),
                     str(s["drops"]), _r(q.get("ttft_s_p99")), _r(q.get("ttft_s_p50"))))
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    lines.append("ratios: vLLM's value / the policy's (> 1 = lower latency than vLLM)")
    return "\n".join(lines)


def write_outputs(out: dict, outdir: str) -> str:
    """results.json (summaries, ratios, timelines, events) + requests_<policy>.csv."""
    os.makedirs(outdir, exist_ok=True)
    slim = {k: v for k, v in out.items() if k != "results"}
    slim["results"] = {}
    for name, r in out["results"].items():
        reqs = r.get("requests", [])
        if reqs:
            with open(os.path.join(outdir, f"requests_{name}.csv"), "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(reqs[0]))
                w.writeheader()
                w.writerows(reqs)
        slim["results"][name] = {k: v for k, v in r.items() if k not in ("requests", "_sim")}
    path = os.path.join(outdir, "results.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(slim, f, indent=1)
    return path
