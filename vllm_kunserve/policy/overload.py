"""Overload detection: KV demand against capacity, per instance and cluster-wide.

Demand (KunServe section 4.1) = blocks in use + blocks the head-of-line queued requests need. Beyond
the paper we add a short-horizon forecast: the least-squares slope of recent cluster demand samples
times ``forecast_horizon_s`` (only a rising trend counts), so the monitor reacts one period earlier
to a burst that is still ramping up.

Also beyond the paper: demand over capacity is an overload worth dropping for only where KV is what
limits throughput. Extra KV admits a bigger decode batch, which is nearly free per token where decode
is weight-bandwidth-bound; it does nothing for a stream of long prompts and short outputs, whose
prefill is compute-bound and which a pipeline group would only slow down. So the report also gives
the *decode share* of the request mix, the output budgets (``max_tokens``) of the requests in the
engines over their prompt lengths plus those budgets, and calls the cluster overloaded only where
it is at least ``min_decode_share`` (``compute_bound`` otherwise). It is the mix of whole requests,
not of the work left to do: with no queue, the work left is the running requests' outputs, all
decode, in any mix; that view dropped the prefill-heavy cluster burst during its warm start (a 5-s
share of 0.74 where its requests are 256 prompt + 16-32 output tokens, a mix of 0.09). The share
sums the current reading with the snapshot's ``work_history`` of the last ``decode_share_window_s``.
An instance that reports no tokens counts as decode (the check then never blocks a drop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from vllm_kunserve.config import DropConfig
from vllm_kunserve.policy.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class InstanceDemand:
    instance_id: int
    used_blocks: int
    queued_blocks: int
    capacity_blocks: int

    @property
    def demand_blocks(self) -> int:
        return self.used_blocks + self.queued_blocks

    @property
    def ratio(self) -> float:
        return self.demand_blocks / self.capacity_blocks if self.capacity_blocks else float("inf")


@dataclass(frozen=True)
class OverloadReport:
    instances: tuple[InstanceDemand, ...]
    demand_blocks: float  # used + queued, cluster-wide
    forecast_blocks: float  # extra demand expected within the horizon
    capacity_blocks: float
    ratio: float  # (demand + forecast) / capacity
    overloaded: bool
    need_blocks: float  # blocks to free (shortfall plus headroom); 0 when not overloaded
    need_bytes: float
    decode_share: float = 1.0  # the request mix: output budgets / (prompt lengths + output budgets)
    compute_bound: bool = False  # over the trigger, but the pending work is mostly prefill: no drop

    def to_dict(self) -> dict:
        return {
            "overloaded": self.overloaded, "ratio": self.ratio, "demand_blocks": self.demand_blocks,
            "decode_share": self.decode_share, "compute_bound": self.compute_bound,
            "forecast_blocks": self.forecast_blocks, "capacity_blocks": self.capacity_blocks,
            "need_blocks": self.need_blocks, "need_bytes": self.need_bytes,
            "instances": [{"instance_id": d.instance_id, "demand_blocks": d.demand_blocks,
                           "capacity_blocks": d.capacity_blocks, "ratio": d.ratio,
                           "overloaded": d.ratio > 1.0} for d in self.instances],
        }


def forecast_blocks(history: Sequence[tuple[float, float]], horizon_s: float, window_s: float = 10.0) -> float:
    """Extra demand expected within ``horizon_s`` from the trend of the last ``window_s`` of samples.

    Least-squares slope of (time, demand) over the window; a flat or falling trend forecasts 0.
    """
    if horizon_s <= 0 or len(history) < 2:
        return 0.0
    t_end = history[-1][0]
    pts = np.array([(t, d) for t, d in history if t >= t_end - window_s], dtype=float)
    if len(pts) < 2 or np.ptp(pts[:, 0]) <= 0:
        return 0.0
    slope = np.polyfit(pts[:, 0], pts[:, 1], 1)[0]
    return float(max(0.0, slope * horizon_s))


def assess_overload(cluster: ClusterSnapshot, cfg: DropConfig = DropConfig()) -> OverloadReport:
    """Per-instance and cluster demand; ``need_bytes`` is what a drop plan must free."""
    per = tuple(InstanceDemand(i.instance_id, i.kv_blocks_used, i.queued_blocks, i.kv_blocks_total)
                for i in cluster.instances if i.healthy)
    demand = float(sum(d.demand_blocks for d in per))
    cap = float(sum(d.capacity_blocks for d in per))
    fc = forecast_blocks(cluster.demand_history, cfg.forecast_horizon_s)
    ratio = (demand + fc) / cap if cap else float("inf")
    share = decode_share(cluster, cfg.decode_share_window_s)
    compute_bound = ratio > cfg.trigger_ratio and share < cfg.min_decode_share
    overloaded = ratio > cfg.trigger_ratio and not compute_bound
    need = 0.0
    if overloaded:
        # bring (demand + forecast) back under the trigger, plus headroom on that shortfall
        shortfall = demand + fc - cfg.trigger_ratio * cap
        need = shortfall * (1.0 + cfg.headroom_ratio)
    return OverloadReport(per, demand, fc, cap, ratio, overloaded, need, need * cluster.model.block_bytes,
                          share, compute_bound)


def decode_share(cluster: ClusterSnapshot, window_s: float = 0.0) -> float:
    """The requests' output budgets over their prompt lengths plus output budgets (healthy
    instances), summed over the current reading and the ``work_history`` readings of the last
    ``window_s``; 1.0 with none."""
    _, dec, pre = cluster.work_now()
    if window_s > 0:
        for t, d, p in cluster.work_history:
            if cluster.now_s - window_s <= t < cluster.now_s:
                dec, pre = dec + d, pre + p
    return dec / (dec + pre) if dec + pre else 1.0
