"""The bridge between live simulator state and ``vllm_kunserve.policy``: snapshots in, decisions out.

Everything the simulator decides (dispatch, KunServe's monitor, Oneiros, MELL) goes through the
policy package the real system uses; this module only converts live servers into its immutable
inputs and its outputs into simulator terms.
"""

from __future__ import annotations

from typing import Sequence

from vllm_kunserve.policy import microbatch as pm
from vllm_kunserve.policy import snapshot as ps
from vllm_kunserve.policy.dispatch import InstanceLoad
from vllm_kunserve.policy.inputs import EngineLoad
from vllm_kunserve.policy.migration import RequestLoad
from vllm_kunserve.policy.transfer import Link, chunk_bytes

from .steptime import EqStepTime, Pair


def policy_model(sim) -> ps.ModelSpec:
    """The memory shape the policies size drops and remaps with (blocks of the simulator's block size)."""
    m, bs = sim.cfg.model, sim.cfg.block_size
    return ps.ModelSpec(num_layers=m.layers, layer_bytes=m.layer_bytes, block_bytes=bs * m.kv_bytes_per_token,
                        block_size=bs)


def queued_work(s) -> int:
    """Prefill tokens a server still has to compute before a new arrival's prefill is done:
    waiting requests' tokens plus the unfinished prefill of running ones."""
    # the running part changes only when the server schedules or ends a step, or its running set
    # changes (every mover changes its length or its used blocks); it is read for every server at
    # every arrival, so it is cached on that key
    key = (s.version, len(s.running), s.used)
    if s.work_cache is None or s.work_cache[0] != key:
        w = 0
        for r in s.running:  # Req.need, inlined
            n = r.prompt + r.generated - r.computed
            if n > 1:
                w += n
        s.work_cache = (key, w)
    return s.waiting.need + s.work_cache[1]


def instance_loads(sim) -> list[InstanceLoad]:
    """Every server (an instance or a pipeline group) as dispatch sees it, keyed by server id."""
    return [InstanceLoad(s.sid, s.used, s.queued_blocks(), s.capacity, queued_work(s),
                         len(s.running) + len(s.waiting), s.k, s.alive and not s.frozen) for s in sim.servers]


def movable_requests(servers) -> list[RequestLoad]:
    """The requests a migration may move off ``servers``: running ones that have produced a token
    (what the front end can move), each with its KV blocks, tokens so far and tokens left."""
    return [RequestLoad(str(r.id), s.sid, r.blocks, r.prompt + r.generated, r.output - r.generated)
            for s in servers for r in s.running if r.generated >= 1]


def engine_load(sim, s) -> EngineLoad:
    """A server's KV load as the engine agent reports it. The simulator allocates a step's blocks
    when it schedules the step, so it has no look-ahead growth: ``growth_blocks`` is 0 and demand
    is used + queued, as everywhere else in the simulator. The base is the capacity without the
    blocks remapping added (``extra_blocks``)."""
    return EngineLoad(used_blocks=s.used, queued_blocks=s.queued_blocks(), growth_blocks=0,
                      capacity_blocks=s.capacity, base_blocks=s.capacity - s.extra_blocks, free_blocks=s.free,
                      block_bytes=sim.cfg.block_bytes)


def cluster_snapshot(sim) -> ps.ClusterSnapshot:
    """Per-instance snapshot: a group's blocks are split evenly over its members (KV of a pipeline
    group is counted in full-model blocks, so the group's total is the sum). Each instance reports its
    base, the KV it has holding every layer, as an engine does (``EngineLoad.base_blocks``): derived
    from a capped group's capacity less its dropped layers, it goes below zero and no group restores."""
    insts = []
    groups = []
    for s in sim.servers:
        k = s.k
        queued = s.queued_blocks()
        cap = s.capacity
        reqs = [*s.running, *s.waiting]
        prompt, output = sum(r.prompt for r in reqs), sum(r.output for r in reqs)  # the request mix
        awaiting = sum(1 for r in reqs if r.first_t is None)  # no first token yet
        for j, i in enumerate(s.instances):
            share = lambda x: x // k + (1 if j < x % k else 0)  # noqa: E731
            lo, hi = sim.layer_range[i]
            insts.append(ps.InstanceSnapshot(
                instance_id=i, kv_blocks_total=share(cap), kv_blocks_used=share(s.used),
                queued_blocks=share(queued), layer_start=lo,
                layer_end=0 if (lo, hi) == (0, sim.cfg.model.layers) else hi,
                prompt_tokens=share(prompt), output_tokens=share(output), kv_blocks_base=sim.base_blocks,
                awaiting_first_token=share(awaiting)))
        groups.append(tuple(s.instances))
    return ps.ClusterSnapshot(model=policy_model(sim), instances=tuple(insts), groups=tuple(groups),
                              now_s=sim.now)


def eq_from_costmodel(cm) -> EqStepTime:
    """A fitted ``policy.costmodel.CostModel`` (ms or s) as a simulator step-time model (seconds)."""
    k = {"ms": 1e-3, "s": 1.0, "us": 1e-6}.get(getattr(cm, "unit", "ms"))
    if k is None:
        raise ValueError(f"cost model unit {cm.unit!r}: expected ms, s or us")
    return EqStepTime(cm.alpha * k, cm.beta * k, cm.gamma * k, getattr(cm, "delta", 0.0) * k)


def typical_stage_time(sim, k: int) -> float:
    """One pipeline stage of a typical decode-heavy step (64 requests at 1k context)."""
    return sim.cfg.step_time.batch_time([(1024, 1)] * 64) / max(k, 1)


def transfer_chunk_bytes(link: Link, stage_s: float) -> float:
    """Chunk whose transfer takes about one pipeline stage (``policy.transfer.chunk_bytes``)."""
    return float(chunk_bytes(link, max(stage_s, 1e-6)))


def policy_microbatches(pairs: Sequence[Pair], k: int, cost_model, min_tokens: int,
                        lookahead: bool = True) -> list[list[Pair]]:
    """Split one step's chunks into at most ``k`` microbatches with ``policy.microbatch``
    (lookahead divide and conquer, or its Sarathi-style token-count baseline). Decode chunks
    ``(context, 1)`` are priced by the cost model's decode KV-read term (``delta``)."""
    work = [pm.WorkChunk(str(i), p, c, c == 1 and p > 0) for i, (p, c) in enumerate(pairs)]
    fn = pm.lookahead_microbatches if lookahead else pm.token_count_microbatches
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
