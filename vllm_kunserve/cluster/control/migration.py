"""MELL's bounded migrations in the front end (``kunserve serve --dispatch mell``).

Each monitor period, while the dispatch policy is a ``periodic`` one (MELL), the front end calls the
planner built here with the units' loads, its movable requests, the engines' latest reports and
the policy; the policy's ``on_period`` (MELL's: the pure :func:`policy.migration.plan_migrations`)
chooses which requests move where and how. KV transfer needs a control port on both engines
(kunserve engines); between stock engines every move re-prefills.
"""

from __future__ import annotations

from typing import Callable, Sequence

from vllm_kunserve.config import PlacementConfig
from vllm_kunserve.policy.dispatch import DispatchPolicy
from vllm_kunserve.policy.migration import MigrationOrder

# Engine-to-engine bandwidth the planner prices a KV transfer with when engines share a host
# (loopback TCP between two engine processes); a multi-machine fleet is slower, not faster.
LOOPBACK_BYTES_PER_S = 1e9


def placement_planner(config: PlacementConfig, link_bytes_per_s: float = LOOPBACK_BYTES_PER_S
                      ) -> Callable[..., Sequence[MigrationOrder]]:
    def plan(units, requests, reports, policy: DispatchPolicy) -> Sequence[MigrationOrder]:
        orders = policy.on_period(units, requests, config, kv_bytes_per_block=kv_block_bytes(reports),
                                  link_bytes_per_s=link_bytes_per_s)
        return kv_or_reprefill(orders, reports)
    return plan


def kv_block_bytes(reports: dict) -> int:
    """Bytes of one KV block, as the kunserve engines' control ports report it (0 where none does)."""
    return max((r.engine_state.capacity.block_bytes or 0 for r in reports.values()
                if r.ok and r.engine_state is not None), default=0)


def kv_or_reprefill(orders: Sequence[MigrationOrder], reports: dict) -> tuple[MigrationOrder, ...]:
    """The orders, each KV transfer between engines without a control port on both turned into a re-prefill."""
    kv_ok = {i for i, r in reports.items() if r.ok and r.source == "control"}
    return tuple(o if o.method != "kv" or {o.src, o.dst} <= kv_ok
                 else MigrationOrder(o.request_id, o.src, o.dst, "reprefill", 0) for o in orders)
