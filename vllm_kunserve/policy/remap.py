"""Remap controller (Oneiros): which layers' weight memory becomes KV, and when to give it back.

A remapped layer's weights are streamed from pinned host memory into a shared *slot* just before it
runs. With ``m`` layers remapped evenly on the circular layer order of an ``L``-layer model the
smallest gap between consecutive remapped layers is ``d = L // m`` layers. Let ``t_x`` be the
host-to-device time of one layer (``layer_bytes / bandwidth``) and ``t_c`` the compute time of one
layer. Our reading of the paper's Eq. 4/5:

* one slot (Eq. 4): the next remapped layer can only be loaded once the current one has run, so
  the load hides behind the ``d - 1`` resident layers in between: ``t_x <= (d - 1) * t_c``.
  The slot holds one layer, so freeing ``alpha`` layers of memory needs ``m = alpha + 1`` remapped.
* two slots (Eq. 5): loads alternate between slots and overlap the previous remapped layer too; the
  link then only has to keep up with one layer per gap: ``t_x <= d * t_c``, with ``m = alpha + 2``.

Hosts whose copies cannot overlap compute (``copy_overlap=False``: a CPU whose cores all run
compute threads, so each layer's copy runs inline just before it) hide nothing: every streamed layer
costs ``t_x`` per step whatever the spacing, and a second slot buys no overlap. There one slot is
used and ``m`` is bounded so that the copies cost at most ``INLINE_COPY_BUDGET`` of a step's compute
(``m * t_x <= budget * L * t_c``). There a remap that cannot cover the whole shortage is not made
at all: it would only slow every step (and a larger batch buys no throughput on a compute-bound
host), so the engine queues as it would without kunserve.

Once layers are remapped the slot count is fixed (the slots hold live layers), so a further remap
only considers that count.

``slots="auto"`` takes the fewest slots that reach the needed ``alpha`` (less traffic), else the
choice with the larger reachable ``alpha``. Active models use the decode time (the shortest
compute, the worst case); an inactive model's next work is a prefill, so it uses the prefill time
(the longer): it gives only down to the threshold at which its next prefill streams the rest in time
(no prefill time known: only the caps). Caps:
``remap.max_layers`` (0 = the bandwidth bound), ``remap.max_fraction`` of the layers, and never the
whole model (``m <= L - 1``).

Order: inactive models first, then lowest priority; among equal priorities (or none given) the
most recently used model first (MRU). Reversion walks the same list backwards and needs the freed
KV to be free again: it triggers when demand stays under ``remap.low_watermark`` of the base
capacity for ``remap.revert_hold_s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from vllm_kunserve.config import RemapConfig
from vllm_kunserve.policy._schema import check_unknown, get, need_list, need_mapping

#: hosts without overlapping copies: the most of a step's compute the inline copies may add
INLINE_COPY_BUDGET = 0.25


@dataclass(frozen=True)
class ModelLayers:
    name: str
    num_layers: int
    layer_bytes: int
    decode_ms: float  # compute time of one layer in a decode step
    prefill_ms: float  # compute time of one layer in a prefill step
    active: bool = True
    priority: int | None = None  # lower gives memory first
    last_active_s: float = 0.0
    remapped_alpha: int = 0  # net layers of memory already given to KV
    slots: int = 0  # slots in use now (0 when nothing is remapped)

    @classmethod
    def from_dict(cls, d, where="model"):
        d = need_mapping(d, where)
        check_unknown(d, {"name", "num_layers", "layer_bytes", "decode_ms", "prefill_ms", "active", "priority",
                          "last_active_s", "remapped_alpha", "slots"}, where)
        return cls(name=get(d, "name", str, where), num_layers=get(d, "num_layers", int, where, lo=1),
                   layer_bytes=get(d, "layer_bytes", int, where, lo=1),
                   decode_ms=get(d, "decode_ms", float, where, lo=0.0),
                   prefill_ms=get(d, "prefill_ms", float, where, lo=0.0),
                   active=get(d, "active", bool, where, True), priority=get(d, "priority", int, where, None),
                   last_active_s=get(d, "last_active_s", float, where, 0.0),
                   remapped_alpha=get(d, "remapped_alpha", int, where, 0, lo=0),
                   slots=get(d, "slots", int, where, 0, lo=0, hi=2))


@dataclass(frozen=True)
class RemapInput:
    models: tuple[ModelLayers, ...]
    h2d_bytes_per_s: float
    kv_shortage_bytes: float = 0.0  # more KV needed now (0 if none)
    kv_free_bytes: float = 0.0  # KV currently free (what reverting may take back)
    demand_ratio: float = 0.0  # KV demand / base (unremapped) capacity
    now_s: float = 0.0
    copy_overlap: bool = True  # copies run beside compute (copy engine / spare core); False: inline

    @classmethod
    def from_dict(cls, d, where="remap"):
        d = need_mapping(d, where)
        check_unknown(d, {"models", "h2d_bytes_per_s", "kv_shortage_bytes", "kv_free_bytes", "demand_ratio",
                          "now_s", "copy_overlap", "config", "state"}, where)
        models = tuple(ModelLayers.from_dict(m, f"{where}.models[{k}]")
                       for k, m in enumerate(need_list(get(d, "models", list, where), f"{where}.models")))
        if not models:
            raise ValueError(f"{where}.models: at least one model is required")
        return cls(models, get(d, "h2d_bytes_per_s", float, where, lo=1.0),
                   get(d, "kv_shortage_bytes", float, where, 0.0, lo=0.0),
                   get(d, "kv_free_bytes", float, where, 0.0, lo=0.0),
                   get(d, "demand_ratio", float, where, 0.0, lo=0.0), get(d, "now_s", float, where, 0.0),
                   get(d, "copy_overlap", bool, where, True))


@dataclass(frozen=True)
class ModelRemap:
    model: str
    alpha: int  # net layers whose memory goes to KV
    slots: int
    layers: tuple[int, ...]  # remapped layer indices (m = alpha + slots of them)
    freed_bytes: int
    hidden: bool  # transfers hide behind compute (always False-safe for inactive models)
    alpha_bound: int  # the most this model could give under the bandwidth bound and caps


@dataclass(frozen=True)
class RemapPlan:
    action: str  # "remap", "revert", "hold"
    models: tuple[ModelRemap, ...]  # the target state of every model that changes
    freed_bytes: int  # net change in KV bytes (negative when reverting)
    shortfall_bytes: float

    def to_dict(self) -> dict:
        return {"action": self.action, "freed_bytes": self.freed_bytes, "shortfall_bytes": self.shortfall_bytes,
                "models": [{"model": m.model, "alpha": m.alpha, "slots": m.slots, "layers": list(m.layers),
                            "freed_bytes": m.freed_bytes, "hidden": m.hidden, "alpha_bound": m.alpha_bound}
                           for m in self.models]}


@dataclass(frozen=True)
class RemapState:
    low_since: float | None = None


def max_remapped(num_layers: int, ratio: float, slots: int) -> int:
    """Largest m whose smallest gap ``L // m`` hides a load of ``ratio = t_x / t_c`` layer-times."""
    need_gap = ratio + (1.0 if slots == 1 else 0.0)
    need_gap = max(1.0, need_gap)
    gap = math.ceil(need_gap - 1e-12)
    return num_layers // gap


def spaced_layers(num_layers: int, m: int) -> tuple[int, ...]:
    """``m`` layers evenly spaced on the circular order (every gap is L//m or L//m + 1)."""
    if m <= 0:
        return ()
    off = num_layers // (2 * m)
    return tuple(sorted((off + (i * num_layers) // m) % num_layers for i in range(m)))


def _cap(m: ModelLayers, cfg: RemapConfig) -> int:
    """Most layers that may be remapped (m, slots included) regardless of bandwidth."""
    cap = min(m.num_layers - 1, int(cfg.max_fraction * m.num_layers))
    return max(0, cap)


def _options(m: ModelLayers, bw: float, cfg: RemapConfig, overlap: bool = True) -> list[tuple[int, int, bool]]:
    """(slots, alpha_bound, hidden) per allowed slot count."""
    t_x = m.layer_bytes / bw * 1e3
    # an active model decodes (the shortest compute, the worst case); an inactive one's next work is a
    # prefill (the longer compute): it keeps enough resident for that prefill to stream the rest in time
    t_c = min(m.decode_ms, m.prefill_ms) if m.active else m.prefill_ms
    out = []
    counts = (1, 2) if cfg.slots == "auto" else (int(cfg.slots),)
    if m.slots:
        counts = (m.slots,)  # the slots hold live layers: a further remap keeps them
    elif not overlap and cfg.slots == "auto":
        counts = (1,)  # nothing overlaps: a second slot only costs memory
    for s in counts:
        mm = _cap(m, cfg)
        hidden = overlap
        if not m.active and t_c <= 0:
            hidden = False  # no prefill time known: only the caps; a reactivated model streams until reverted
        elif not overlap:
            budget = INLINE_COPY_BUDGET * m.num_layers * t_c
            mm = min(mm, int(budget // t_x) if t_x > 0 else mm)
        else:
            bound = max_remapped(m.num_layers, t_x / t_c if t_c > 0 else math.inf, s) if t_c > 0 else 0
            mm = min(mm, bound)
        alpha = mm - s
        if cfg.max_layers:
            alpha = min(alpha, cfg.max_layers)
        out.append((s, max(0, alpha), hidden))
    return out


def give_order(models):
    """Who gives memory first (Oneiros): inactive models, then the lowest priority, then the most recently used."""
    def key(m: ModelLayers):
        return (m.active, m.priority if m.priority is not None else 0, -m.last_active_s, m.name)
    return sorted(models, key=key)


def decide_remap(inp: RemapInput, cfg: RemapConfig = RemapConfig(), state: RemapState = RemapState()
                 ) -> tuple[RemapPlan, RemapState]:
    """Remap enough layers to cover ``kv_shortage_bytes``, or revert when demand stays low."""
    if inp.h2d_bytes_per_s <= 0:
        raise ValueError("h2d_bytes_per_s must be > 0")
    if inp.kv_shortage_bytes > 0 or inp.demand_ratio > cfg.high_watermark:
        return _remap(inp, cfg), RemapState(None)
    if inp.demand_ratio < cfg.low_watermark and any(m.remapped_alpha for m in inp.models):
        since = state.low_since if state.low_since is not None else inp.now_s
        if inp.now_s - since >= cfg.revert_hold_s:
            plan = _revert(inp)
            return plan, RemapState(None) if plan.models else RemapState(since)
        return RemapPlan("hold", (), 0, 0.0), RemapState(since)
    return RemapPlan("hold", (), 0, 0.0), RemapState(None)


def _remap(inp: RemapInput, cfg: RemapConfig) -> RemapPlan:
    need = inp.kv_shortage_bytes
    out = []
    freed_total = 0
    for m in give_order(inp.models):
        if need <= 0:
            break
        opts = _options(m, inp.h2d_bytes_per_s, cfg, inp.copy_overlap)
        want = m.remapped_alpha + math.ceil(need / m.layer_bytes)
        reach = [o for o in opts if o[1] >= want]
        s, bound, hidden = min(reach, key=lambda o: o[0]) if reach else max(opts, key=lambda o: (o[1], -o[0]))
        alpha = min(want, bound)
        if alpha <= m.remapped_alpha:
            continue
        gained = (alpha - m.remapped_alpha) * m.layer_bytes
        need -= gained
        freed_total += gained
        out.append(ModelRemap(m.name, alpha, s, spaced_layers(m.num_layers, alpha + s), alpha * m.layer_bytes,
                              hidden, bound))
    if out and need > 0 and not inp.copy_overlap:
        # Streaming is not free here (inline copies take compute time) and a bigger batch buys no
        # throughput on a compute-bound host: remap only when it resolves the shortage.
        return RemapPlan("hold", (), 0, max(0.0, need))
    return RemapPlan("remap" if out else "hold", tuple(out), freed_total, max(0.0, need))


def _revert(inp: RemapInput) -> RemapPlan:
    free = inp.kv_free_bytes
    out = []
    change = 0
    for m in reversed(give_order(inp.models)):
        if not m.remapped_alpha:
            continue
        back = min(m.remapped_alpha, int(free // m.layer_bytes))
        if back <= 0:
            continue
        alpha = m.remapped_alpha - back
        slots = m.slots if alpha else 0
        free -= back * m.layer_bytes
        change -= back * m.layer_bytes
        out.append(ModelRemap(m.name, alpha, slots, spaced_layers(m.num_layers, alpha + slots) if alpha else (),
                              alpha * m.layer_bytes, True, m.remapped_alpha))
    return RemapPlan("revert" if out else "hold", tuple(out), change, 0.0)


def lend_plan(m: ModelLayers, h2d_bytes_per_s: float, cfg: RemapConfig = RemapConfig(),
              copy_overlap: bool = True) -> ModelRemap | None:
    """What an inactive model gives when it lends (a multi-model fleet): the most layers of memory whose
    streaming its next prefill still hides (or, inline, keeps within the copy budget), evenly spaced;
    None when it can give nothing."""
    s, bound, hidden = max(_options(m, h2d_bytes_per_s, cfg, copy_overlap), key=lambda o: (o[1], -o[0]))
    if bound <= 0:
        return None
    return ModelRemap(m.name, bound, s, spaced_layers(m.num_layers, bound + s), bound * m.layer_bytes, hidden, bound)


def remap_room(m: ModelLayers, h2d_bytes_per_s: float, cfg: RemapConfig = RemapConfig(),
               copy_overlap: bool = True) -> int:
    """Bytes of weight memory ``m`` could still give to its KV by remapping more layers: up to its
    bound (the layers its link hides, or inline the copy budget, and the caps) less what it gives now."""
    if not cfg.enable:
        return 0
    bound = max(o[1] for o in _options(m, h2d_bytes_per_s, cfg, copy_overlap))
    return max(0, bound - m.remapped_alpha) * m.layer_bytes


def with_models(inp: RemapInput, plan: RemapPlan) -> RemapInput:
    """The input after applying ``plan`` (for simulators stepping the controller)."""
    by = {r.model: r for r in plan.models}
    models = tuple(replace(m, remapped_alpha=by[m.name].alpha, slots=by[m.name].slots) if m.name in by else m
                   for m in inp.models)
    return replace(inp, models=models)
