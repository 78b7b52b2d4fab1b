"""What every dispatch policy sees and is: :class:`InstanceLoad` (one serving unit's load) and
:class:`DispatchPolicy` (the base class each policy of this package subclasses, one module each)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

__all__ = ["DispatchPolicy", "InstanceLoad"]


@dataclass(frozen=True)
class InstanceLoad:
    """One serving unit's load as dispatch sees it (KV in blocks of this unit)."""

    instance_id: int
    used_blocks: int
    queued_blocks: int          # blocks the waiting requests need to start
    capacity_blocks: int
    queued_prefill_tokens: int = 0  # prefill tokens still to compute (waiting + unfinished running)
    requests: int = 0           # running + waiting requests
    k: int = 1                  # instances in the unit (pipeline width)
    alive: bool = True          # accepts new work
    group: int | None = None    # the pipeline group this instance is a member of (while grouped)
    prefix_share: float = 0.0   # the share of this request's prompt the unit likely holds cached (0..1)
    affinity: bool = False      # the unit this request's session went to last

    @property
    def demand_blocks(self) -> int:
        return self.used_blocks + self.queued_blocks

    @property
    def load(self) -> float:
        """KV demand as a share of capacity (queue included)."""
        return self.demand_blocks / max(self.capacity_blocks, 1)

    def fits(self, blocks: int) -> bool:
        return self.demand_blocks + blocks <= self.capacity_blocks


class DispatchPolicy:
    """A dispatch policy: :meth:`choose` places one request; a ``periodic`` policy also acts every
    monitor period through :meth:`on_period` (MELL's bounded migrations).

    Policies hold no state of their own (the caller counts turns), so the registry keeps one
    instance of each (``policy.dispatch.registry``)."""

    #: the mode's name (``--dispatch``, ``/kunserve/ops/dispatch``, ``choose_instance``)
    name: ClassVar[str] = ""
    #: what it chooses, in a line: the ``--dispatch`` help texts list every policy with it
    #: (``registry.describe``)
    summary: ClassVar[str] = ""
    #: True: the front end runs :meth:`on_period` every monitor period (it needs the migration planner)
    periodic: ClassVar[bool] = False
    #: True: the caller fills each unit's ``prefix_share`` and ``affinity`` for the request
    uses_prefix: ClassVar[bool] = False

    def choose(self, units: Sequence[InstanceLoad], prompt_blocks: int = 0, turn: int = 0) -> int:
        """The ``instance_id`` of the unit among ``units`` (the candidates: never empty, the
        accepting units or, when none accepts, all of them) that takes a request needing
        ``prompt_blocks`` to start; ``turn``: the caller's count of requests placed so far."""
        raise NotImplementedError

    def on_period(self, units: Sequence[InstanceLoad], requests: Sequence[Any], config: Any, *,
                  kv_bytes_per_block: int = 0, link_bytes_per_s: float = 0.0) -> Sequence[Any]:
        """The moves (``policy.migration.MigrationOrder``) to make this monitor period, given every
        unit's load, the movable requests (``policy.migration.RequestLoad``) and the
        ``PlacementConfig``; a ``periodic`` policy's, none by default. (Typed ``Any`` here:
        ``policy.migration`` imports this module.)"""
        return ()

    def __repr__(self) -> str:
        return f"<dispatch {self.name}>"
