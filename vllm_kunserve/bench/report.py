"""Run outputs (requests.csv, timeline.csv, summary.json, timeline.png, ttft_cdf.png) and what the
benchmarks' docs share (``benchmarks/*.py``): the header with the command that wrote a doc, the
machine's name, markdown tables, JSON and PNG files.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:  # annotations only (the client pulls in aiohttp)
    from vllm_kunserve.bench.client import RequestResult

#: the checkout this package runs from: the benchmarks' docs name their files relative to it
REPO = Path(__file__).resolve().parents[2]

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


def read_requests_csv(path: Path) -> list[RequestResult]:
    """The results ``write_requests_csv`` wrote (without the per-chunk times and ids, which it does not
    keep): what a resumed comparison needs of a run it keeps."""
    from vllm_kunserve.bench.client import RequestResult

    def num(x: str, cast=float):
        return cast(x) if x != "" else (math.nan if cast is float else -1)
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            out.append(RequestResult(
                idx=int(r["idx"]), arrival_s=float(r["arrival_s"]), prompt_len=int(r["prompt_len"]),
                output_len=int(r["output_len"]), send_s=num(r["send_s"]), ok=r["ok"] == "1", error=r["error"],
                ttft_s=num(r["ttft_s"]), e2e_s=num(r["e2e_s"]), tpot_s=num(r["tpot_s"]), queue_s=num(r["queue_s"]),
                output_tokens=int(r["output_tokens"] or 0), server_prompt_tokens=num(r["server_prompt_tokens"], int),
                finish_reason=r["finish_reason"]))
    return out


def write_timeline_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else _num(r.get(k))) for k in cols})


def json_safe(obj: Any) -> Any:
    """``obj`` as JSON can hold it: NaN and infinities as None, numpy scalars as Python's, tuples as
    lists, keys as strings."""
    if isinstance(obj, float):
        return None if not math.isfinite(obj) else obj
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        return json_safe(obj.item())
    return obj


def write_json(path: Path | str, obj: Any, *, indent: int = 2, clean: bool = True, default=None,
               newline: bool = True) -> None:
    """``obj`` as JSON at ``path``: ``clean`` writes NaN and infinities as null (else as JSON's
    ``NaN`` / ``Infinity``, which Python reads back), ``default`` as ``json.dumps`` takes it; the
    folder is made where it is missing. A file under the checkout's ``docs/`` (a page's data, which
    scripts read and every clone and device transfer carries) is written without whitespace whatever
    ``indent`` says."""
    compact = REPO / "docs" in Path(path).resolve().parents
    text = json.dumps(json_safe(obj) if clean else obj, indent=None if compact else indent, default=default,
                      separators=(",", ":") if compact else None)
    Path(path).parent.mkdir(parents=True, exist_ok=True)   # an --out in a folder not made yet
    Path(path).write_text(text + ("\n" if newline else ""))


def pyplot(optional: bool = False):
    """matplotlib's pyplot on the Agg backend; None where ``optional`` and matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        if optional:
            return None
        raise
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path | str, dpi: int = 110, tight: bool = True) -> None:
    """Lay ``fig`` out tightly (unless it lays itself out: ``tight=False``), write it to ``path`` (PNG)
    and close it."""
    import matplotlib.pyplot as plt

    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    compact_png(path)


def compact_png(path: Path | str) -> None:
    """Rewrite a plot's PNG with a 256-colour palette (Pillow, matplotlib's own dependency): a chart's
    lines, bars and text survive it unchanged to the eye, at a third to a half of the bytes every
    clone of the pages carries. A PNG that is already a palette image is left as it is."""
    from PIL import Image

    with Image.open(path) as im:
        if im.mode == "P":
            return
        rgb = im.convert("RGB")
    rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)


def plot_timeline(path: Path, rows: Sequence[Mapping[str, Any]], title: str = "",
                  kv_capacity_tokens: float | None = None) -> None:
    """Three panels sharing time (like KunServe Fig. 12): arrivals and completions per second;
    KV usage (server) and estimated KV demand as % of capacity, with preemptions; mean TTFT of the
    requests arriving each second."""
    plt = pyplot()
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
    save_figure(fig, path)


def plot_ttft_cdf(path: Path, ttfts: Mapping[str, Sequence[float]], title: str = "TTFT CDF") -> None:
    """One CDF line per label (a run, or each system of a comparison)."""
    plt = pyplot()
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
    save_figure(fig, path)


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


# ------------------------------------------------------------------------------------------ benchmark docs
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor()


def cpu_device(what: str) -> str:
    """``<CPU model>, <n> threads (<what>)`` for a benchmark run without a GPU."""
    import torch

    return f"{cpu_model()}, {torch.get_num_threads()} threads ({what})"


def device_name(dev) -> str:
    """The GPU's name for a CUDA device (a ``torch.device``), else ``cpu_device("CPU, no GPU lent")``."""
    if dev.type == "cuda":
        import torch

        return torch.cuda.get_device_name(dev)
    return cpu_device("CPU, no GPU lent")


def rel(path: Path | str) -> str:
    """``path`` relative to the checkout when inside it (as the docs write it), else absolute."""
    path = Path(path).resolve()
    return (path.relative_to(REPO) if path.is_relative_to(REPO) else path).as_posix()


def command(script: str, args: Sequence[str] | None = None, quote: bool = True) -> str:
    """``python -m benchmarks.<name> ARGS``: the command line that ran ``script`` (``<name>.py``) with ``args``
    (default: its arguments as given when it runs as a program, by path or as ``python -m
    benchmarks.<name>``; none when called otherwise), each shell-quoted unless not ``quote``."""
    if args is None:
        args = sys.argv[1:] if Path(sys.argv[0]).name == script else []
    return " ".join(["python", "-m", f"benchmarks.{Path(script).stem}", *(map(shlex.quote, args) if quote else args)])


def doc_header(title: str, script: str, device: str, raw: Path, *paragraphs: str,
               load: float | str | None = None, args: Sequence[str] | None = None) -> list[str]:
    """Title, provenance, the given paragraphs and the machine-load caveat, as markdown lines (``load``:
    the 1-min load average the measuring run recorded, or a note saying it was not; default: now;
    ``args``: the measuring run's arguments, for a doc re-written from its raw data; default: this run's)."""
    lines = [f"# {title}", "",
             f"Produced by `{command(script, args)}` on **{device}**; raw numbers in `{rel(raw)}`.", ""]
    for p in paragraphs:
        lines += [p, ""]
    load = os.getloadavg()[0] if load is None else load
    cores = os.cpu_count() or 1
    lines += [f"Machine load (1-min load average at the end, {cores} cores): "
              f"{load if isinstance(load, str) else f'{load:.1f}'}"
              + ("; 2 shared cores, so repeat on a quiet machine before trusting small differences." if cores <= 2
                 else "."), ""]
    return lines


def text_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A plain-text table's lines: columns padded to their widest cell (the first left-aligned, the
    rest right-aligned), a rule of dashes under the header."""
    rows = [list(header), *map(list, rows)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def write_doc(path: Path | str, lines: Sequence[str], keep: str | None = None) -> None:
    """``lines`` as the markdown file ``path`` (joined by newlines; parents made). ``keep``: a heading
    (``## Reading``) from which on what the file held (a reading written by hand) follows them."""
    path = Path(path)
    tail = ""
    if keep and path.is_file():
        old = path.read_text(encoding="utf-8")
        if "\n" + keep in old:
            tail = old[old.index("\n" + keep) + 1:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + ("\n" + tail if tail else ""), encoding="utf-8")


def md_row(cells: Iterable[Any]) -> str:
    """One markdown table row."""
    return "| " + " | ".join(map(str, cells)) + " |"


def md_table(columns: Sequence[str], align: str, rows: Iterable[Iterable[Any]] = ()) -> list[str]:
    """A markdown table's lines: the header, its rule (``align``: a letter a column, ``l`` left, ``r``
    right) and a row per item of ``rows`` (its cells as given)."""
    if len(align) != len(columns):
        raise ValueError(f"align {align!r}: one letter per column ({len(columns)})")
    return [md_row(columns), "|" + "".join("---:|" if a == "r" else "---|" for a in align),
            *(md_row(r) for r in rows)]
