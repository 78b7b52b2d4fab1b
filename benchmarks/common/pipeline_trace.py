"""Where a pipeline group's stages idle, from the workers' step traces.

With ``KUNSERVE_PIPELINE_TRACE=DIR`` set for the engines, each worker of a group writes, in parts as
it goes and when the group splits, when its steps (``execute_model``), samplings
(``sample_tokens``), hops (its span run on the peer) and the peer spans it served waited for its
core, got it and ended, and what each step carried (``integration/vllm/pipeline.py``;
``time.perf_counter``, one clock for every process of the host).
:func:`analyse` turns one group's traces into, per member:

- the cycle (median time between its steps' starts) and what its core did: its own step's compute (the step less
  the hops), the peer's spans, its sampling, and the rest, *idle* as far as the workers go (the
  engine core and the API server of the member, which share the core, run in part of it);
- the chain of one step, mean ms: the part before the hop, the hop, the part after it, the gap to
  the sampling call, the sampling (with its wait for the core), the gap to the next step (the
  engine core: outputs, scheduling) and the next step's wait for the core;
- the idle time of its core by cause, from both members' chains at each moment: *collision* (this
  member's microbatch is at the peer's stage and so is the peer's own: one of them waits there
  while this stage has nothing), *between steps* (this member's engine core is between steps and
  the peer's microbatch is not here), *in transit* (both microbatches between stages: the link and
  the hand-over of the core) and *other*;
- its cycles by where prefill tokens ran meanwhile (:func:`prefill_cycles`: its own step, a step
  of the peer's, both, neither), with each kind's cycle time and core idle share: what a prompt in
  one member's step costs the other.

    python -m benchmarks.common.pipeline_trace DIR
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

# a chain state per moment: what a member's current step is doing
_OWN, _HOP, _WAIT, _SAMPLE, _BETWEEN = "own", "hop", "wait", "sample", "between"
CAUSES = ("collision", "between steps", "in transit", "other")


def _merge(iv: Iterable[tuple[float, float]]) -> list[list[float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return out


def _minus(iv: Sequence[Sequence[float]], holes: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    out = []
    holes = _merge(holes)
    for a, b in _merge(iv):
        for ha, hb in holes:
            if hb <= a or ha >= b:
                continue
            if ha > a:
                out.append((a, ha))
            a = max(a, hb)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def _total(iv: Iterable[Sequence[float]], lo: float, hi: float) -> float:
    return sum(min(b, hi) - max(a, lo) for a, b in _merge(iv) if b > lo and a < hi)


def _times(e: Sequence) -> Sequence[float]:
    """An event's time marks: a hop has four, the others three (a step's are followed by what it
    carried: requests, tokens, prefill tokens)."""
    return e[1:5] if e[0] == "hop" else e[1:4]


def _segments(events: Sequence[Sequence]) -> list[tuple[float, float, str]]:
    """A member's chain as (start, end, state) segments; moments in none are ``between``."""
    seg = []
    for e in events:
        if e[0] == "execute_model":
            seg += [(e[1], e[2], _WAIT), (e[2], e[3], _OWN)]
        elif e[0] == "sample_tokens":
            seg += [(e[1], e[2], _WAIT), (e[2], e[3], _SAMPLE)]
        elif e[0] == "hop":  # (start, sent, back, core again): a hop overrides the step around it
            seg += [(e[2], e[3], _HOP), (e[3], e[4], _WAIT)]
    return sorted(seg)


def _state(segs: list[tuple[float, float, str]], starts: list[float], t: float) -> str:
    """The state at ``t``: a hop or a wait inside a step wins over the step (segments nest at most
    a step deep, so the few that start last before ``t`` decide)."""
    best = _BETWEEN
    for a, b, s in segs[max(0, bisect.bisect_right(starts, t) - 8):bisect.bisect_right(starts, t)]:
        if a <= t < b:
            best = s if s in (_HOP, _WAIT) or best == _BETWEEN else best
    return best


def _cause(mine: str, peer: str) -> str:
    if mine == _HOP and peer in (_OWN, _WAIT, _SAMPLE):
        return "collision"
    if mine in (_BETWEEN, _SAMPLE, _WAIT):
        return "between steps"
    if mine == _HOP and peer in (_HOP, _BETWEEN):
        return "in transit"
    return "other"


def analyse(members: dict[str, Sequence[Sequence]], trim: float = 0.2, step_s: float = 2e-4) -> dict[str, Any]:
    """One group's traces (member name -> events) -> per-member cycle, core shares, the chain of a
    step and the idle time by cause, over the middle of the group's life (``trim`` cut each end)."""
    out: dict[str, Any] = {}
    segs = {m: _segments(ev) for m, ev in members.items()}
    starts = {m: [x[0] for x in sg] for m, sg in segs.items()}
    for me, ev in members.items():
        steps = sorted((e for e in ev if e[0] == "execute_model"), key=lambda e: e[1])
        if len(steps) < 3:
            continue
        t0, t1 = steps[0][1], steps[-1][3]
        lo, hi = t0 + trim * (t1 - t0), t1 - trim * (t1 - t0)
        win = hi - lo
        hops = [e for e in ev if e[0] == "hop"]
        own = _minus([(e[2], e[3]) for e in steps], [(h[2], h[4]) for h in hops])
        spans = [(e[2], e[3]) for e in ev if e[0] == "span"]
        samples = sorted((e for e in ev if e[0] == "sample_tokens"), key=lambda e: e[1])
        busy = _merge([*own, *spans, *((e[2], e[3]) for e in samples)])
        idle, prev = [], lo
        for a, b in busy:
            a, b = max(a, lo), min(b, hi)
            if b <= lo or a >= hi:
                continue
            if a > prev:
                idle.append((prev, a))
            prev = max(prev, b)
        if hi > prev:
            idle.append((prev, hi))
        inside = [e for e in steps if lo <= e[1] <= hi]
        row: dict[str, Any] = {
            "steps": len(inside), "window_s": round(win, 3),
            "cycle_ms": (round(statistics.median(b[1] - a[1] for a, b in zip(inside, inside[1:])) * 1e3, 2)
                         if len(inside) > 1 else None),
            "core": {"own_step": round(_total(own, lo, hi) / win, 3), "peer_spans": round(_total(spans, lo, hi) / win, 3),
                     "sampling": round(_total([(e[2], e[3]) for e in samples], lo, hi) / win, 3),
                     "idle": round(sum(b - a for a, b in idle) / win, 3)}}
        chain = []
        for i, e in enumerate(steps[:-1]):
            if not lo <= e[1] <= hi:
                continue
            h = next((x for x in hops if e[2] <= x[1] <= e[3]), None)
            s = next((x for x in samples if x[1] >= e[3]), None)
            if h is None or s is None or s[1] > steps[i + 1][1]:
                continue
            chain.append({"before_hop": h[1] - e[2], "hop": h[4] - h[1], "after_hop": e[3] - h[4],
                          "to_sampling": s[1] - e[3], "sampling": s[3] - s[1], "to_next_step": steps[i + 1][1] - s[3],
                          "step_wait": steps[i + 1][2] - steps[i + 1][1]})
        if chain:
            row["chain_ms"] = {k: round(statistics.fmean(c[k] for c in chain) * 1e3, 2) for k in chain[0]}
        peers = [m for m in members if m != me]
        loads = prefill_cycles(inside, [e for p in peers for e in members[p] if e[0] == "execute_model"], busy)
        if loads:
            row["prefill_cycles"] = loads
        if len(peers) == 1:
            causes = dict.fromkeys(CAUSES, 0.0)
            for a, b in idle:
                t = a
                while t < b:
                    p = peers[0]
                    causes[_cause(_state(segs[me], starts[me], t), _state(segs[p], starts[p], t))] += min(step_s, b - t)
                    t += step_s
            row["idle_by_cause"] = {k: round(v / win, 3) for k, v in causes.items()}
        out[me] = row
    return out


#: a member's cycle by where prefill tokens ran during it (``prefill_cycles``)
CYCLE_KINDS = ("decode only", "own prefill", "peer prefill", "both")


def prefill_cycles(steps: Sequence[Sequence], peer_steps: Sequence[Sequence],
                   busy: Sequence[Sequence[float]] | None = None) -> dict[str, dict]:
    """A member's cycles (one step's start to the next's) by whether its own step and any peer
    step running during the cycle carried prefill tokens: how many, their total time (s), the
    cycle's median and P90 (ms), the member's requests per step and its prefill tokens per step
    (means), and with ``busy`` (its core's busy intervals, merged) the share of these cycles' time
    its core idled. Steps traced without their load (older traces) give ``{}``."""
    steps = sorted((e for e in steps if len(e) >= 7), key=lambda e: e[1])
    peer = sorted((e for e in peer_steps if len(e) >= 7 and e[6] > 0), key=lambda e: e[1])
    peer_starts = [e[1] for e in peer]
    by: dict[str, list[tuple[float, int, int, float]]] = {k: [] for k in CYCLE_KINDS}
    for e, nxt in zip(steps, steps[1:]):
        a, b = e[1], nxt[1]
        k = bisect.bisect_left(peer_starts, b)
        theirs = any(p[3] > a for p in peer[max(0, k - 8):k])  # a peer prefill step overlapping [a, b)
        kind = CYCLE_KINDS[(e[6] > 0) + 2 * theirs]
        by[kind].append((b - a, e[4], e[6], _total(busy, a, b) if busy is not None else 0.0))
    out = {}
    for kind, rows in by.items():
        if rows:
            c = sorted(x[0] for x in rows)
            out[kind] = {"cycles": len(rows), "seconds": round(sum(c), 3),
                         "cycle_p50_ms": round(statistics.median(c) * 1e3, 2),
                         "cycle_p90_ms": round(c[min(len(c) - 1, int(0.9 * len(c)))] * 1e3, 2),
                         "requests": round(statistics.fmean(x[1] for x in rows), 1),
                         "prefill_tokens": round(statistics.fmean(x[2] for x in rows), 1)}
            if busy is not None:
                out[kind]["idle"] = round(1 - sum(x[3] for x in rows) / sum(c), 3)
    return out


def load(files: Iterable[str | Path]) -> list[dict[str, list]]:
    """The trace dumps ``files`` (a trace directory's ``*.json``), one dict (member -> events) per
    group: the members' dumps whose spans of time overlap. A worker writes a group's events in
    parts (``pid``, ``group``, ``part``); the parts of one are joined first."""
    parts: dict[tuple, list] = {}
    for k, p in enumerate(sorted(map(Path, files))):
        d = json.loads(p.read_text())
        ev = d.get("events") or []
        if not ev or "member" not in d:
            continue
        key = (d["member"], d["pid"], d["group"]) if "pid" in d and "group" in d else (d["member"], "file", k)
        parts.setdefault(key, []).append((d.get("part", 0), ev))
    dumps = []
    for (name, *_), chunks in parts.items():
        ev = [e for _, c in sorted(chunks, key=lambda x: x[0]) for e in c]
        dumps.append((min(e[1] for e in ev), max(max(_times(e)) for e in ev), name, ev))
    groups: list[tuple[float, float, dict]] = []
    for a, b, name, ev in sorted(dumps):
        for k, (ga, gb, g) in enumerate(groups):
            if a < gb and b > ga and name not in g:
                g[name] = ev
                groups[k] = (min(a, ga), max(b, gb), g)
                break
        else:
            groups.append((a, b, {name: ev}))
    return [g for _, _, g in groups]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", help="the KUNSERVE_PIPELINE_TRACE directory")
    a = ap.parse_args(argv)
    groups = load(Path(a.directory).glob("*.json"))
    if not groups:
        print(f"no traces in {a.directory}", file=sys.stderr)
        return 1
    print(json.dumps([analyse(g) for g in groups], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
