"""Run outputs: requests.csv, timeline.csv, summary.json, timeline.png, ttft_cdf.png."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from vllm_kunserve.bench.client import RequestResult

REQUEST_COLUMNS = ["idx", "arrival_s", "send_s", "prompt_len", "output_len", "ok", "error", "ttft_s", "tpot_s",
                   "e2e_s", "queue_s", "output_tokens", "server_prompt_tokens", "finish_reason", "max_gap_s"]


def _num(v: Any) -> Any:
    if isinstance(v, float):
        return "" if v != v else round(v, 6)
    return v


def write_requests_csv(path: Path, results: Sequence[RequestResult]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(REQUEST_COLUMNS)
        for r in results:
            gaps = r.gaps
            w.writerow([_num(x) for x in (
                r.idx, r.arrival_s, r.send_s, r.prompt_len, r.output_len, int(r.ok), r.error, r.ttft_s, r.tpot_s,
                r.e2e_s, r.queue_s, r.output_tokens, r.server_prompt_tokens, r.finish_reason,
                max(gaps) if gaps else math.nan)])


def write_timeline_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else _num(r.get(k))) for k in cols})


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return None if not math.isfinite(obj) else obj
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.generic):
        return _clean(obj.item())
    return obj


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(_clean(obj), indent=2, sort_keys=False) + "\n")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(path: Path, rows: Sequence[Mapping[str, Any]], title: str = "",
                  kv_capacity_tokens: float | None = None) -> None:
    """Three panels sharing time (like KunServe Fig. 12): arrivals and completions per second;
    KV usage (server) and estimated KV demand as % of capacity, with preemptions; mean TTFT of the
    requests arriving each second."""
    plt = _plt()
    t = np.array([r["second"] for r in rows], dtype=float)
    fig, ax = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    ax[0].step(t, [r["arrivals"] for r in rows], where="post", label="arrivals/s")
    ax[0].step(t, [r["completions"] for r in rows], where="post", label="completions/s", alpha=0.8)
    ax[0].set_ylabel("requests / s")
    ax[0].legend(loc="upper right", fontsize=8)
    if any(r.get("kv_usage") is not None for r in rows):
        ax[1].plot(t, [100 * (r.get("kv_usage") or 0.0) for r in rows], label="KV usage (server) %")
    if kv_capacity_tokens and any("est_kv_demand_tokens" in r for r in rows):
        ax[1].plot(t, [100 * r.get("est_kv_demand_tokens", 0.0) / kv_capacity_tokens for r in rows],
                   "--", label="estimated KV demand % of capacity")
    ax[1].axhline(100, color="grey", lw=0.8)
    ax[1].set_ylabel("% of KV capacity")
    if any(r.get("preemptions") is not None for r in rows):
        ax2 = ax[1].twinx()
        ax2.plot(t, [r.get("preemptions") or 0 for r in rows], color="tab:red", lw=1, label="preemptions (cum.)")
        ax2.set_ylabel("preemptions", color="tab:red")
        ax2.set_ylim(bottom=0)
    ax[1].legend(loc="upper left", fontsize=8)
    ttft = [r["mean_ttft_s"] if r["mean_ttft_s"] is not None else np.nan for r in rows]
    ax[2].plot(t, ttft, marker=".", lw=1)
    ax[2].set_ylabel("mean TTFT of arrivals (s)")
    ax[2].set_xlabel("time (s)")
    if np.nanmax(np.asarray(ttft, float), initial=0) > 0:
        ax[2].set_yscale("log")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft_cdf(path: Path, ttfts: Mapping[str, Sequence[float]], title: str = "TTFT CDF") -> None:
    """One CDF line per label (a run, or each system of a comparison)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, vals in ttfts.items():
        v = np.sort(np.asarray([x for x in vals if x == x], float))
        if v.size:
            ax.plot(v, np.arange(1, v.size + 1) / v.size, label=f"{label} (n={v.size})")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_run(out: Path, results: Sequence[RequestResult], rows: Sequence[Mapping[str, Any]],
              summary: Mapping[str, Any], *, title: str = "", kv_capacity_tokens: float | None = None,
              plots: bool = True) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    files = {"requests": out / "requests.csv", "timeline": out / "timeline.csv", "summary": out / "summary.json"}
    write_requests_csv(files["requests"], results)
    write_timeline_csv(files["timeline"], rows)
    write_json(files["summary"], summary)
    if plots:
        files["timeline_png"] = out / "timeline.png"
        files["ttft_cdf_png"] = out / "ttft_cdf.png"
        plot_timeline(files["timeline_png"], rows, title, kv_capacity_tokens)
        plot_ttft_cdf(files["ttft_cdf_png"], {title or "run": [r.ttft_s for r in results if r.ok]})
    return {k: str(v) for k, v in files.items()}
