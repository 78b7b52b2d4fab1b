"""Drop planner (KunServe Fig. 6): merge the smallest groups until enough weight memory is freed.

Every group holds every decoder layer exactly once, split into contiguous, balanced stages (stage
sizes differ by at most one layer), one stage per instance. Merging two groups that each hold one
full copy leaves one copy for both, so every merge frees exactly ``model.weight_bytes``. Groups sit
in a min-heap keyed by (size, smallest instance id): always merging the two smallest keeps
pipelines shallow and balanced, and the whole plan costs O(N log N) for N instances.

Where the instances report how far their KV can grow (``InstanceSnapshot.kv_blocks_max``: the
engine plans its KV cache at ``memory.max_kv_ratio`` times its base), a merge counts only the KV it
can use: every member of a G-group holds its own requests' KV and its peers' over the layers it
keeps, so one merge adds ``weight_bytes / G`` to each member's own block count (in blocks of
``block_bytes``) up to its cap, and the group runs at its smallest member's count. A merge that adds
nothing is not made (it would only cost pipeline hops).

A mechanism that cannot re-form a live group (the fleet: a member of a group cannot join another)
plans with ``regroup=False``: groups of more than one instance are left as they are and only lone
instances merge.

When even the best plan (one group left, or the two smallest groups would exceed
``max_group_size``) frees less than needed, the plan is returned anyway with ``satisfied=False``
and ``shortfall_bytes`` so the caller can fall back to KV-centric handling (queue, swap, recompute)
for the rest.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from vllm_kunserve.policy.snapshot import ClusterSnapshot, InstanceSnapshot, ModelSpec


@dataclass(frozen=True)
class StageAssignment:
    instance_id: int
    layer_start: int
    layer_end: int  # exclusive
    freed_bytes: int  # weight bytes this instance releases (negative: it must load more)
    load_layers: tuple[tuple[int, int], ...] = ()  # ranges it must fetch (from a peer or host)


@dataclass(frozen=True)
class GroupPlan:
    instances: tuple[int, ...]  # pipeline order: stage 0 first
    stages: tuple[StageAssignment, ...]
    changed: bool = True  # every group in DropPlan.groups is newly formed; untouched ones are in .unchanged


@dataclass(frozen=True)
class DropPlan:
    groups: tuple[GroupPlan, ...]  # the groups the plan forms (changed ones only)
    unchanged: tuple[tuple[int, ...], ...]  # groups left as they are (including lone instances)
    merges: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # in order
    need_bytes: float
    freed_bytes: int
    satisfied: bool
    skipped: tuple[str, ...] = ()  # why candidates were not merged (another host's, alone on its host)

    @property
    def shortfall_bytes(self) -> float:
        return max(0.0, self.need_bytes - self.freed_bytes)

    def to_dict(self) -> dict:
        return {
            "satisfied": self.satisfied, "need_bytes": self.need_bytes, "freed_bytes": self.freed_bytes,
            "shortfall_bytes": self.shortfall_bytes,
            "merges": [[list(a), list(b)] for a, b in self.merges],
            "unchanged_groups": [list(g) for g in self.unchanged],
            "skipped": list(self.skipped),
            "groups": [{"instances": list(g.instances),
                        "stages": [{"instance_id": s.instance_id, "layer_start": s.layer_start,
                                    "layer_end": s.layer_end, "freed_bytes": s.freed_bytes,
                                    "load_layers": [list(r) for r in s.load_layers]} for s in g.stages]}
                       for g in self.groups],
        }


def balanced_stages(num_layers: int, n: int) -> list[tuple[int, int]]:
    """Split ``num_layers`` into ``n`` contiguous ranges whose sizes differ by at most one."""
    if not 1 <= n <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {n} stages")
    q, r = divmod(num_layers, n)
    out, start = [], 0
    for k in range(n):
        size = q + (1 if k < r else 0)  # earlier stages take the extra layer (last stage has the head)
        out.append((start, start + size))
        start += size
    return out


def _missing(new: tuple[int, int], old: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    out = []
    if new[0] < min(old[0], new[1]):
        out.append((new[0], min(old[0], new[1])))
    if new[1] > max(old[1], new[0]):
        out.append((max(old[1], new[0]), new[1]))
    if old[1] <= new[0] or old[0] >= new[1]:
        return (new,)
    return tuple(out)


def _assign(members: Sequence[InstanceSnapshot], num_layers: int, layer_bytes: int) -> GroupPlan:
    ranges = balanced_stages(num_layers, len(members))
    old = {m.instance_id: (m.layer_start, m.layer_end or num_layers) for m in members}
    # stage k goes to the k-th instance by the midpoint of what it holds now: when merging
    # pipelined groups, every instance keeps a sub-range of its current layers (nothing to load)
    order = sorted(old, key=lambda i: (old[i][0] + old[i][1], i))
    stages = []
    for iid, rg in zip(order, ranges):
        o = old[iid]
        freed = ((o[1] - o[0]) - (rg[1] - rg[0])) * layer_bytes
        stages.append(StageAssignment(iid, rg[0], rg[1], freed, _missing(rg, o)))
    return GroupPlan(tuple(order), tuple(stages))


def plan_drop(cluster: ClusterSnapshot, need_bytes: float, max_group_size: int = 8, *,
              regroup: bool = True) -> DropPlan:
    """Merge the two smallest groups repeatedly until ``need_bytes`` are freed (KunServe Fig. 6).

    Groups containing an unhealthy instance are never merged, nor, with ``regroup=False``, groups
    of more than one instance. Only groups on one host merge (a group's stage link is one machine's;
    instances whose host is unknown count as one host): the two smallest groups of the host whose
    pair is smallest, per step. Returns the (possibly partial) plan; ``skipped`` says which
    candidates no merge could use because of their host.
    """
    if max_group_size < 1:
        raise ValueError("max_group_size must be >= 1")
    model = cluster.model
    by_id = cluster.by_id()
    heaps: dict[str, list[tuple[int, int, tuple[int, ...]]]] = {}
    untouched: list[tuple[int, ...]] = []
    sick = {i.instance_id for i in cluster.instances if not i.healthy}
    for g in cluster.groups:
        if (not sick or sick.isdisjoint(g)) and len(g) < model.num_layers and (regroup or len(g) == 1):
            heaps.setdefault(by_id[g[0]].host, []).append((len(g), min(g), tuple(g)))
        else:
            untouched.append(tuple(g))
    for h in heaps.values():
        heapq.heapify(h)
    merged_from: dict[tuple[int, ...], bool] = {}
    merges = []
    freed = 0
    blocks = {i.instance_id: float(i.kv_blocks_total) for i in cluster.instances}  # own blocks as merged
    done: set[str] = set()   # hosts where no merge helps any more
    while freed < need_bytes:
        pairs = [(h[0][0] + min(h[1][0], h[2][0] if len(h) > 2 else h[1][0]), h[0][1], host)
                 for host, h in heaps.items() if len(h) >= 2 and host not in done]
        if not pairs:
            break
        host = min(pairs)[2]
        heap = heaps[host]
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        size = a[0] + b[0]
        g = a[2] + b[2]
        gain, each = (_usable_gain(g, blocks, by_id, model) if size <= min(max_group_size, model.num_layers)
                      else (0, None))
        if gain <= 0:
            heapq.heappush(heap, a)
            heapq.heappush(heap, b)
            done.add(host)  # the host's two smallest are too big together, or their KV cannot grow:
            continue        # no merge on this host helps
        if each is not None:
            blocks.update((i, each) for i in g)
        merges.append((a[2], b[2]))
        merged_from[g] = True
        merged_from.pop(a[2], None)
        merged_from.pop(b[2], None)
        freed += gain
        heapq.heappush(heap, (size, min(a[1], b[1]), g))
    left = [e for h in heaps.values() for e in h]
    groups = [_assign([by_id[i] for i in g], model.num_layers, model.layer_bytes)
              for _, _, g in left if g in merged_from]
    groups.sort(key=lambda gp: min(gp.instances))
    unchanged = sorted((g for _, _, g in left if g not in merged_from), key=min) + untouched
    skipped = ()
    if freed < need_bytes and len(heaps) > 1:
        skipped = tuple(f"instances {[i for _, _, g in h for i in g]} on host {host or '(unknown)'}: "
                        f"{'alone on their host' if len(h) < 2 else 'no merge left on their host'}; groups never span hosts"
                        for host, h in sorted(heaps.items()))
    return DropPlan(tuple(groups), tuple(unchanged), tuple(merges), float(need_bytes), freed, freed >= need_bytes,
                    skipped)


def _usable_gain(group: tuple[int, ...], blocks: dict[int, float], by_id: dict[int, InstanceSnapshot],
                 model: ModelSpec) -> tuple[int, float | None]:
    """Bytes of KV one more merge into ``group`` adds, and each member's own block count after it
    (None where no member reports a cap: the counts are then not tracked).

    The merge frees one weight copy (``weight_bytes``, the whole gain where no member reports a cap).
    Each member's own block count rises by ``weight_bytes / (G * block_bytes)`` (the copy spread over
    the G members that each hold the KV of all G members' requests for their layers), capped at its
    ``kv_blocks_max``; the group runs at its smallest member's count."""
    n = len(group)
    if not any(by_id[i].kv_blocks_max for i in group):
        return model.weight_bytes, None
    each = min(min(blocks[i] + model.weight_bytes / (n * model.block_bytes), by_id[i].kv_blocks_max or float("inf"))
               for i in group)
    gain = n * each - sum(blocks[i] for i in group)
    return (int(gain * model.block_bytes), each) if gain > 0 else (0, each)
