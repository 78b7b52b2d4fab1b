"""Read measured harness runs (``kunserve bench``/``compare`` output) for simulator validation.

* :func:`load_run_requests` - the completed requests of a ``requests.csv`` as intervals (send, first
  token, end, prompt and output tokens, TPOT); :func:`run_trace` - the same as a simulator trace;
* :func:`solo_profile_rows` - step-time profile rows from the requests that ran alone: the harness
  logs no per-step timing, but a request with nothing else in flight from its send to its first
  token is one prefill step ``[[0, prompt]]`` (its TTFT, API overhead included), and one that
  overlapped no other request at all decoded in one-request steps ``[[context, 1]]`` (its TPOT);
* :func:`stalled_seconds` - seconds of a ``timeline.csv`` in which requests were running but no
  token came out and nothing completed (the engine was starved by the host; no scheduler does that);
* :func:`discover_runs` - ``<dir>/<system>/rep<k>/`` run directories of a ``kunserve compare`` output.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass

from .trace import TraceRequest


@dataclass(frozen=True)
class Interval:
    send: float
    first: float
    end: float
    prompt: int
    output: int
    tpot: float


def prompt_of(row: dict) -> int:
    """A requests.csv row's prompt tokens: the server's count, where it gave one (the client writes -1
    where the usage never came, e.g. a stream a front end resumed elsewhere), else the length asked for."""
    n = int(float(row.get("server_prompt_tokens") or -1))
    return n if n > 0 else int(float(row["prompt_len"]))


def load_run_requests(path: str) -> list[Interval]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such requests.csv")
    out = []
    with open(path, newline="", encoding="utf-8") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            if row.get("ok", "1") in ("0", "False", "false"):
                continue
            try:
                s = float(row["send_s"])
                out.append(Interval(s, s + float(row["ttft_s"]), s + float(row["e2e_s"]),
                                    prompt_of(row),
                                    int(float(row["output_tokens"])), float(row.get("tpot_s") or 0.0)))
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path}:{line}: bad request row ({e})") from None
    return out


def run_trace(path: str) -> list[TraceRequest]:
    """The completed requests of a ``requests.csv`` as a trace: sent when they were sent (from the
    first), with the server-counted prompt and at least one output token."""
    reqs = sorted((r.send, r.prompt, max(r.output, 1)) for r in load_run_requests(path))
    if not reqs:
        raise ValueError(f"{path}: no completed request")
    return [TraceRequest(i, t - reqs[0][0], p, o) for i, (t, p, o) in enumerate(reqs)]


def solo_profile_rows(reqs: list[Interval], min_output: int = 3) -> list[dict]:
    """Profile rows (``policy.costmodel`` format plus ``kind``) of the requests that ran alone."""
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].send)
    rows = []
    for pos, i in enumerate(order):
        r = reqs[i]
        # others overlap r iff they start before r ends and end after r starts; scan sends in order
        prefill_alone = decode_alone = True
        for j in order[:pos]:
            q = reqs[j]
            if q.end > r.send:
                prefill_alone = decode_alone = False
                break
        if prefill_alone:
            for j in order[pos + 1:]:
                q = reqs[j]
                if q.send >= r.end:
                    break
                decode_alone = False
                if q.send < r.first:
                    prefill_alone = False
                    break
        if prefill_alone:
            rows.append({"chunks": [[0, r.prompt]], "ms": (r.first - r.send) * 1e3, "kind": "prefill"})
        if decode_alone and r.output >= min_output and r.tpot > 0:
            rows.append({"chunks": [[r.prompt + r.output // 2, 1]], "ms": r.tpot * 1e3, "kind": "decode"})
    return rows


def stalled_seconds(timeline_csv: str) -> tuple[int, int]:
    """(stalled seconds, longest stalled streak) of a harness ``timeline.csv``."""
    if not os.path.isfile(timeline_csv):
        raise FileNotFoundError(f"{timeline_csv}: no such timeline.csv")
    total = best = cur = 0
    with open(timeline_csv, newline="", encoding="utf-8") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            try:
                stalled = (float(row["running"]) > 0 and float(row["output_tokens"]) == 0
                           and float(row["completions"]) == 0)
            except (KeyError, ValueError) as e:
                raise ValueError(f"{timeline_csv}:{line}: bad timeline row ({e})") from None
            cur = cur + 1 if stalled else 0
            total += stalled
            best = max(best, cur)
    return total, best


def discover_runs(root: str, systems: tuple[str, ...] = ("vllm", "oracle")) -> list[tuple[str, int, str]]:
    """``(system, repeat, run_dir)`` for every ``root/<system>/rep<k>`` holding a summary and requests."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: not a directory")
    out = []
    for system in systems:
        base = os.path.join(root, system)
        if not os.path.isdir(base):
            continue
        for name in os.listdir(base):
            m = re.fullmatch(r"rep(\d+)", name)
            d = os.path.join(base, name)
            if m and all(os.path.isfile(os.path.join(d, f)) for f in ("summary.json", "requests.csv")):
                out.append((system, int(m.group(1)), d))
    if not out:
        raise FileNotFoundError(f"{root}: no <system>/rep<k>/ run with summary.json and requests.csv "
                                f"for systems {','.join(systems)}")
    return sorted(out)
