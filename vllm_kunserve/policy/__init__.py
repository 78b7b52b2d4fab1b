"""Pure policy decisions over immutable snapshots: no torch, no vLLM.

Callers (the monitor, the simulator, the vLLM integration) build snapshots and call:

* :func:`assess_overload` / :func:`plan_drop`: when and how to merge instances and drop layers;
* :func:`decide_restore`: when to split groups back (threads a :class:`RestoreState`);
* :class:`CostModel`, :func:`fit`, :func:`load_profile`: the batch cost model and its fit;
* :func:`lookahead_microbatches` / :func:`token_count_microbatches` / :func:`pipeline_bubble`;
* :func:`decide_remap`: Oneiros layer remapping (threads a :class:`RemapState`);
* :class:`MellPlacer`, :func:`make_placer`, :func:`choose_migration`: placement and migration;
* :func:`chunk_bytes`: transfer chunk size for the coordinated KV exchange.
"""

from vllm_kunserve.policy.costmodel import (CostModel, Profile, default_model, evaluate, fit, fit_with_holdout,
                                            load_profile, load_vidur_mlp, nnls)
from vllm_kunserve.policy.drop import DropPlan, GroupPlan, StageAssignment, balanced_stages, plan_drop
from vllm_kunserve.policy.microbatch import (Microbatch, WorkChunk, lookahead_microbatches, pipeline_bubble,
                                             token_count_microbatches, work_from_requests)
from vllm_kunserve.policy.overload import OverloadReport, assess_overload, forecast_blocks
from vllm_kunserve.policy.placement import (MellPlacer, MoveCandidate, MoveChoice, OpResult, choose_migration,
                                            lower_bound_l2, size_class)
from vllm_kunserve.policy.placement_baselines import GreedyPlacer, make_placer
from vllm_kunserve.policy.remap import (ModelLayers, RemapInput, RemapPlan, RemapState, decide_remap,
                                        spaced_layers)
from vllm_kunserve.policy.restore import RestoreDecision, RestoreState, decide_restore
from vllm_kunserve.policy.snapshot import ClusterSnapshot, InstanceSnapshot, ModelSpec, RequestSnapshot
from vllm_kunserve.policy.transfer import Link, chunk_bytes, fit_link, load_vidur_send_recv

__all__ = [
    "ClusterSnapshot", "InstanceSnapshot", "ModelSpec", "RequestSnapshot",
    "OverloadReport", "assess_overload", "forecast_blocks",
    "DropPlan", "GroupPlan", "StageAssignment", "balanced_stages", "plan_drop",
    "RestoreDecision", "RestoreState", "decide_restore",
    "CostModel", "Profile", "default_model", "evaluate", "fit", "fit_with_holdout", "load_profile",
    "load_vidur_mlp", "nnls",
    "Microbatch", "WorkChunk", "lookahead_microbatches", "pipeline_bubble", "token_count_microbatches",
    "work_from_requests",
    "ModelLayers", "RemapInput", "RemapPlan", "RemapState", "decide_remap", "spaced_layers",
    "MellPlacer", "GreedyPlacer", "make_placer", "MoveCandidate", "MoveChoice", "OpResult",
    "choose_migration", "lower_bound_l2", "size_class",
    "Link", "chunk_bytes", "fit_link", "load_vidur_send_recv",
]
