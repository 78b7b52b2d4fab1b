"""Tail statistics pooled over repetitions, with bootstrap 95% intervals.

One repetition's burst window holds some 50 requests, so its P99 is its largest TTFT or the second:
a verdict per repetition is noise. Here every system's window requests of all repetitions are pooled
(failed requests count as an infinite TTFT: a lost request never improves a tail), and each
percentile gets a bootstrap interval that resamples requests within each repetition (stratified, so
every draw keeps the repetitions' sizes). A ratio between two systems' percentiles
(``percentile_ratio``), and the share of a gap one system closes, are computed on every draw of
independent resamples of the systems involved; the interval is the draws' 2.5th..97.5th percentiles. ``rerun_agreement`` resamples the repetitions
too: how far a second run of a system on the same arrivals can land from this one; and
``without_each_rep`` leaves each repetition out in turn: whether one repetition carries a ratio.

Goodput follows ``vllm bench serve --goodput``: the share of the window's requests (failures count)
whose TTFT and TPOT both meet the SLO.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from vllm_kunserve.workload.stats import percentiles

QUANTILES = (50.0, 90.0, 99.0)
DRAWS = 2000


@dataclass(frozen=True)
class Request:
    rep: int
    arrival_s: float
    ok: bool
    ttft_s: float            # inf where the request failed
    tpot_s: float | None     # None: one output token (no TPOT) or failed
    output_tokens: int
    e2e_s: float | None


def read_window(path: Path, rep: int, lo: float, hi: float) -> list[Request]:
    """The requests of one run's ``requests.csv`` that arrived in [lo, hi)."""
    out = []
    with open(path) as f:
        for r in csv.DictReader(f):
            a = float(r["arrival_s"])
            if not lo <= a < hi:
                continue
            ok = r["ok"] == "1" and bool(r["ttft_s"])
            out.append(Request(rep, a, ok, float(r["ttft_s"]) if ok else math.inf,
                               float(r["tpot_s"]) if ok and r.get("tpot_s") else None,
                               int(r.get("output_tokens") or 0), float(r["e2e_s"]) if ok and r.get("e2e_s") else None))
    return out


def request_files(run: Path, system: str, reps: int | None = None) -> list[tuple[int, Path]]:
    """(repetition, requests.csv) of each of ``system``'s runs, in order: laid out ``<system>/rep<k>/``
    (``kunserve compare``) or ``rep<k>/<system>/`` (a doc's copy of them); ``reps``: the first ``reps``
    only (a comparison rendered from the repetitions it finished, while a later one had begun)."""
    files = [(int(f.parent.name[3:]), f) for f in (run / system).glob("rep*/requests.csv")] or \
            [(int(f.parent.parent.name[3:]), f) for f in run.glob(f"rep*/{system}/requests.csv")]
    return sorted(x for x in files if reps is None or x[0] <= reps)


def load_runs(run: Path, systems: list[str], window: tuple[float, float],
              reps: int | None = None) -> dict[str, list[Request]]:
    """Per system, the requests of every repetition (the first ``reps``) arriving in ``window``."""
    out: dict[str, list[Request]] = {}
    for s in systems:
        reqs = [r for k, f in request_files(run, s, reps) for r in read_window(f, k, *window)]
        if reqs:
            out[s] = reqs
    return out


def by_rep(reqs: Sequence[Request], value) -> list[np.ndarray]:
    """Per repetition (in order), the array of ``value(request)`` (None values dropped)."""
    reps = sorted({r.rep for r in reqs})
    out = []
    for k in reps:
        v = [value(r) for r in reqs if r.rep == k]
        out.append(np.asarray([x for x in v if x is not None], dtype=np.float64))
    return [a for a in out if a.size]


_LOST = 1e18   # stands in for a lost request's infinite TTFT where percentiles interpolate


def _pct(x: np.ndarray, q: float, axis=None):
    """The ``q``-th percentile (linear), infinite where it falls on or between lost requests."""
    v = np.percentile(np.where(np.isinf(x), _LOST, x), q, axis=axis, method="linear")
    # any weight on a lost request is a lost tail: a P99 between a finite TTFT and a lost one
    # interpolates to some 1e16 s, not a time
    return np.where(v >= _LOST * 1e-9, math.inf, v)


def draws(groups: Sequence[np.ndarray], q: float, n: int = DRAWS, seed: int = 0) -> np.ndarray:
    """``n`` bootstrap draws of the ``q``-th percentile of the pooled groups, each group resampled
    with replacement within itself."""
    rng = np.random.default_rng(seed)
    parts = [g[rng.integers(0, g.size, size=(n, g.size))] for g in groups]
    pooled = np.concatenate(parts, axis=1)
    return _pct(pooled, q, axis=1)


def run_draws(groups: Sequence[np.ndarray], q: float, n: int = DRAWS, seed: int = 0) -> np.ndarray:
    """``n`` draws of the ``q``-th percentile of another run like this one: its repetitions resampled
    with replacement, then each drawn repetition's requests within it (a two-level bootstrap). Where a
    run's slow requests bunch in a few repetitions, this spread is wider than ``draws``', which keeps
    every repetition once: it is the spread between runs of the system on the same arrivals."""
    rng = np.random.default_rng(seed)
    out = np.empty(n)
    for i, pick in enumerate(rng.integers(0, len(groups), size=(n, len(groups)))):
        out[i] = _pct(np.concatenate([groups[j][rng.integers(0, groups[j].size, groups[j].size)] for j in pick]), q)
    return out


def rerun_agreement(reqs: Sequence[Request], q: float, tol: float, seed: int = 0) -> dict:
    """How closely a run fixes its own pooled P{q} TTFT: ``agree``, the share of pairs of independent
    ``run_draws`` within ``tol`` of each other (``|a / b - 1| <= tol``: would a second run of the
    system land within ``tol`` of this one?), and ``lo``..``hi``, the run draws' 95% interval (the
    runs' spread). Below one half, no prediction can be held to ``tol`` against this run: a second
    run of the system itself would miss more often than not."""
    g = by_rep(reqs, lambda r: r.ttft_s)
    if not g:
        return {"agree": None, "lo": None, "hi": None}
    a, b = run_draws(g, q, seed=seed), run_draws(g, q, seed=seed + 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        same = (a == b) | (np.abs(a / b - 1) <= tol)   # two lost-request tails (inf) agree
    lo, hi = interval(a)
    return {"agree": float(same.mean()), "lo": lo, "hi": hi}


def point(groups: Sequence[np.ndarray], q: float) -> float:
    return float(_pct(np.concatenate(groups), q))


def interval(x: np.ndarray) -> tuple[float, float]:
    finite = x[np.isfinite(x)]
    if finite.size < x.size * 0.975:   # more than 2.5% of draws unbounded: the upper end is too
        lo = float(np.percentile(finite, 2.5)) if finite.size else math.inf
        return lo, math.inf
    return float(np.percentile(x, 2.5)), float(np.percentile(x, 97.5))


def tail(reqs: Sequence[Request], qs: Iterable[float] = QUANTILES, seed: int = 0) -> dict[str, dict]:
    """Pooled TTFT percentiles with intervals: {'p50': {'value', 'lo', 'hi'}, ...}."""
    g = by_rep(reqs, lambda r: r.ttft_s)
    out = {}
    for q in qs:
        if not g:
            out[f"p{q:g}"] = {"value": None, "lo": None, "hi": None}
            continue
        lo, hi = interval(draws(g, q, seed=seed))
        out[f"p{q:g}"] = {"value": point(g, q), "lo": lo, "hi": hi}
    return out


#: a request's value of each metric a ratio reads: a lost request's TTFT and end-to-end latency are
#: infinite, it has no TPOT
METRIC = {"ttft": lambda r: r.ttft_s, "tpot": lambda r: r.tpot_s, "e2e": lambda r: r.e2e_s if r.ok else math.inf}


def percentile_ratio(a: Sequence[Request], b: Sequence[Request], q: float, seed: int = 0, metric: str = "ttft") -> dict:
    """P{q} TTFT (``metric="tpot"``: TPOT, over the requests that have one; ``"e2e"``: end-to-end latency)
    of ``a`` over ``b``, pooled, with the interval of independent resamples."""
    if metric not in METRIC:
        raise ValueError(f"metric {metric!r}: one of {', '.join(METRIC)}")
    value = METRIC[metric]
    ga, gb = by_rep(a, value), by_rep(b, value)
    if not ga or not gb:
        return {"value": None, "lo": None, "hi": None}
    with np.errstate(divide="ignore", invalid="ignore"):
        x = draws(ga, q, seed=seed) / draws(gb, q, seed=seed + 1)
    lo, hi = interval(x)
    v = point(ga, q) / point(gb, q)
    return {"value": None if math.isnan(v) else v, "lo": lo, "hi": hi}   # None: both tails lost requests


def without_each_rep(a: Sequence[Request], b: Sequence[Request], q: float) -> list[dict]:
    """The pooled P{q} TTFT of ``a`` over ``b`` with each repetition left out of both in turn
    (repetition k of every system ran the same arrivals in the same cycle of the order):
    ``[{'rep': k, 'value': ratio}, ...]``, empty with fewer than two repetitions in common. Where one
    repetition carries a pooled ratio (one system's run thrashed), leaving it out moves the ratio
    across a target that the pooled point alone says is met or missed."""
    reps = sorted({r.rep for r in a} & {r.rep for r in b})
    if len(reps) < 2:
        return []
    out = []
    for k in reps:
        ga = by_rep([r for r in a if r.rep != k], lambda r: r.ttft_s)
        gb = by_rep([r for r in b if r.rep != k], lambda r: r.ttft_s)
        out.append({"rep": k, "value": point(ga, q) / point(gb, q)})
    return out


def paired(a: Sequence[Request], b: Sequence[Request]) -> list[tuple[Request, Request]]:
    """The requests of ``a`` with their twin in ``b``: the same repetition and arrival time (every
    system of a comparison replays one trace, so repetition k's arrivals are the same request in each),
    as ``(a's, b's)`` in ``a``'s order; requests arriving at one instant pair in their order."""
    twins: dict[tuple[int, float], list[Request]] = {}
    for r in b:
        twins.setdefault((r.rep, round(r.arrival_s, 4)), []).append(r)
    out = []
    for r in a:
        left = twins.get((r.rep, round(r.arrival_s, 4)))
        if left:
            out.append((r, left.pop(0)))
    return out


def gap_closed(best: Sequence[Request], system: Sequence[Request], bound: Sequence[Request], q: float,
               seed: int = 0) -> dict:
    """(best - system) / (best - bound) at P{q} TTFT: the share of the gap from the best alternative
    to the bound that ``system`` closes (1: all of it; > 1: it beat the bound). None where the best
    alternative is not above the bound (no gap)."""
    gs = [by_rep(x, lambda r: r.ttft_s) for x in (best, system, bound)]
    if not all(gs):
        return {"value": None, "lo": None, "hi": None}
    pb, ps, po = (point(g, q) for g in gs)
    if not pb > po:
        return {"value": None, "lo": None, "hi": None, "no_gap": True}
    db, ds, do = (draws(g, q, seed=seed + i) for i, g in enumerate(gs))
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(db > do, (db - ds) / (db - do), np.nan)
    x = x[~np.isnan(x)]
    lo, hi = interval(x) if x.size else (None, None)
    return {"value": (pb - ps) / (pb - po), "lo": lo, "hi": hi}


def share_above(reqs: Sequence[Request], threshold_s: float, seed: int = 0) -> dict:
    """The share of the requests whose TTFT exceeds ``threshold_s`` (a lost request does), pooled,
    with the stratified bootstrap interval. Where a percentile sits on the knee of the TTFT curve
    (a few more slow requests move it from seconds to a minute), this share is the stable figure."""
    g = by_rep(reqs, lambda r: r.ttft_s)
    if not g:
        return {"value": None, "lo": None, "hi": None}
    rng = np.random.default_rng(seed)
    over = [(x > threshold_s).astype(np.float64) for x in g]
    hits = sum(o[rng.integers(0, o.size, size=(DRAWS, o.size))].sum(axis=1) for o in over)
    n = sum(o.size for o in over)
    lo, hi = np.percentile(hits / n, [2.5, 97.5])
    return {"value": float(sum(o.sum() for o in over) / n), "lo": float(lo), "hi": float(hi)}


def tpot(reqs: Sequence[Request], qs: Iterable[float] = (50.0, 99.0)) -> dict[str, float | None]:
    return percentiles([r.tpot_s for r in reqs if r.tpot_s is not None], tuple(qs))


def goodput(reqs: Sequence[Request], ttft_slo_s: float, tpot_slo_s: float) -> float | None:
    """Share of the requests (failures count as misses) with TTFT <= ``ttft_slo_s`` and TPOT <=
    ``tpot_slo_s`` (a request of one output token has no TPOT and passes that half)."""
    if not reqs:
        return None
    good = sum(1 for r in reqs if r.ok and r.ttft_s <= ttft_slo_s and (r.tpot_s is None or r.tpot_s <= tpot_slo_s))
    return good / len(reqs)
