"""The bridge between live simulator state and ``vllm_kunserve.policy``: snapshots in, decisions out.

Everything the simulator decides for KunServe, Oneiros and MELL goes through the policy package
the real system uses; this module only converts. Where a policy part does not exist yet, a
fallback here says so in its docstring (and ``describe()`` reports which one ran).
"""

from __future__ import annotations

from typing import Sequence

from vllm_kunserve.policy import snapshot as ps

from .steptime import EqStepTime, Pair


def policy_model(sim) -> ps.ModelSpec:
    m, c = sim.cfg.model, sim.cfg
    return ps.ModelSpec(num_layers=m.layers, layer_bytes=m.layer_bytes, block_bytes=c.block_bytes,
                        block_size=c.block_size)


def cluster_snapshot(sim, history: Sequence[tuple[float, float]] = ()) -> ps.ClusterSnapshot:
    """Per-instance snapshot: a group's blocks are split evenly over its members (KV of a pipeline
    group is counted in full-model blocks, so the group's total is the sum)."""
    insts = []
    groups = []
    for s in sim.servers:
        k = s.k
        queued = s.queued_blocks()
        cap = s.capacity
        for j, i in enumerate(s.instances):
            share = lambda x: x // k + (1 if j < x % k else 0)  # noqa: E731
            lo, hi = sim.layer_range[i]
            insts.append(ps.InstanceSnapshot(
                instance_id=i, kv_blocks_total=share(cap), kv_blocks_used=share(s.used),
                queued_blocks=share(queued), layer_start=lo,
                layer_end=0 if (lo, hi) == (0, sim.cfg.model.layers) else hi))
        groups.append(tuple(s.instances))
    return ps.ClusterSnapshot(model=policy_model(sim), instances=tuple(insts), groups=tuple(groups),
                              now_s=sim.now, demand_history=tuple(history))


def eq_from_costmodel(cm) -> EqStepTime:
    """A fitted ``policy.costmodel.CostModel`` (ms or s) as a simulator step-time model (seconds)."""
    k = {"ms": 1e-3, "s": 1.0, "us": 1e-6}.get(getattr(cm, "unit", "ms"))
    if k is None:
        raise ValueError(f"cost model unit {cm.unit!r}: expected ms, s or us")
    return EqStepTime(cm.alpha * k, cm.beta * k, cm.gamma * k, getattr(cm, "delta", 0.0) * k)


def token_count_microbatches(pairs: Sequence[Pair], k: int) -> list[list[Pair]]:
    """Sarathi-style: ``k`` microbatches of equal token counts, chunking a request where needed
    (its chunks stay in prefix order)."""
    total = sum(c for _, c in pairs)
    if k <= 1 or total <= 1:
        return [list(pairs)]
    target = -(-total // k)
    out: list[list[Pair]] = [[]]
    room = target
    for p, c in pairs:
        while c > 0:
            if room == 0:
                out.append([])
                room = target
            take = min(c, room)
            out[-1].append((p, take))
            p, c, room = p + take, c - take, room - take
    return [mb for mb in out if mb]


def harness_trace(path: str):
    """Load a CSV trace with the harness's loader (``bench.traces.load_csv``: Azure or BurstGPT,
    errors naming line and column) and convert it to :class:`TraceRequest` starting at 0."""
    from vllm_kunserve.bench import traces as bt

    from .trace import TraceRequest, read_trace_csv

    if not hasattr(bt, "load_csv"):
        return read_trace_csv(path)
    tr = bt.load_csv(path)
    if len(tr) == 0:
        raise ValueError(f"{path}: no requests")
    t0 = float(tr.arrival_s[0])
    order = sorted(range(len(tr)), key=lambda i: float(tr.arrival_s[i]))
    return [TraceRequest(k, float(tr.arrival_s[i]) - t0, int(tr.prompt_len[i]), int(tr.output_len[i]))
            for k, i in enumerate(order)]


def typical_stage_time(sim, k: int) -> float:
    """One pipeline stage of a typical decode-heavy step (64 requests at 1k context)."""
    return sim.cfg.step_time.batch_time([(1024, 1)] * 64) / max(k, 1)


def transfer_chunk_bytes(link, stage_s: float) -> float:
    """Chunk whose transfer takes about one pipeline stage (``policy.transfer.chunk_bytes``)."""
    from vllm_kunserve.policy.transfer import Link as PLink, chunk_bytes

    return float(chunk_bytes(PLink(link.bw, link.latency_s), max(stage_s, 1e-6)))


def lookahead_impl():
    """The policy package's microbatcher module (``policy.microbatch``), or None while absent."""
    import importlib

    try:
        mod = importlib.import_module("vllm_kunserve.policy.microbatch")
    except ImportError:
        return None
    return mod if hasattr(mod, "lookahead_microbatches") else None


def policy_microbatches(mod, pairs: Sequence[Pair], k: int, cost_model, min_tokens: int,
                        lookahead: bool = True) -> list[list[Pair]]:
    """Split one step's chunks into at most ``k`` microbatches with ``policy.microbatch``
    (lookahead divide and conquer, or its Sarathi-style token-count baseline). Decode chunks
    ``(context, 1)`` are priced by the cost model's decode KV-read term (``delta``)."""
    work = [mod.WorkChunk(str(i), p, c, c == 1 and p > 0) for i, (p, c) in enumerate(pairs)]
    fn = mod.lookahead_microbatches if lookahead else mod.token_count_microbatches
    mbs = fn(work, cost_model, k, min_tokens)
    return [[(ch.prefix, ch.tokens) for ch in mb.chunks] for mb in mbs]


# batch shapes timed on the step-time model to fit the microbatcher's cost model: prefill chunks
# at several prefixes, decode batches at several contexts and sizes, and mixes of both
_PREFILL = [((p, c),) for c in (16, 64, 256, 512, 1024, 2048, 4096, 8192) for p in (0, 512, 2048, 8192)]
_DECODE = [((p, 1),) * n for n in (1, 8, 64, 256) for p in (128, 1024, 4096, 16384)]
_MIXED = [((p, c),) + ((d, 1),) * n for c in (256, 2048) for p in (0, 2048) for n, d in ((16, 1024), (128, 4096))]


def lookahead_costmodel(st):
    """The microbatcher's CostModel: ``policy.costmodel.fit`` in its extended form (Eq. 1-3 plus
    the decode KV-read term) on prefill, decode and mixed batches timed by the step-time model."""
    from vllm_kunserve.policy import costmodel as pc

    if isinstance(st, EqStepTime):
        return pc.CostModel(st.alpha * 1e3, st.beta * 1e3, st.gamma * 1e3, delta=st.delta * 1e3,
                            meta={"source": "sim eq"})
    import numpy as np

    shapes = tuple(_PREFILL + _DECODE + _MIXED)
    ms = np.array([st.batch_time(list(b)) * 1e3 for b in shapes])
    return pc.fit(pc.Profile(shapes, ms, True, "sim-steptime"), form="extended")


def _find(module: str, names: Sequence[str]):
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    for n in names:
        if callable(getattr(mod, n, None)):
            return getattr(mod, n)
    return None
