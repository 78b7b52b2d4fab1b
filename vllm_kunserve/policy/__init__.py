"""Pure policy decisions over immutable snapshots: no torch, no vLLM.

Callers (the cluster controller, the engine agent, the simulator) build snapshots and call:

* :func:`choose_instance`: which instance takes a new request (over :class:`InstanceLoad`);
* :func:`decide_levers`: each period, the order of the levers (remap first, then drop; restore
  first, then revert) over :func:`monitor_tick`, threading a :class:`LeverState`;
* :func:`monitor_tick`: each period, drop, restore or nothing from the demand history (threads a
  :class:`MonitorState`); it uses :func:`assess_overload` / :func:`plan_drop` (when and how to merge
  instances and drop layers) and :func:`decide_restore` (when to split groups back);
* :class:`CostModel`, :func:`fit`, :func:`load_profile`: the batch cost model and its fit;
* :func:`admit_count` / :func:`peak_blocks`: peak-aware admission (start a queued request only if
  every admitted one can finish in the KV);
* :func:`lookahead_microbatches` / :func:`token_count_microbatches` / :func:`pipeline_bubble`;
  :func:`step_budget` (a group member's next step, cost-balanced against its peers');
* :func:`remap_input` (from an :class:`EngineLoad`) and :func:`decide_remap`: Oneiros layer
  remapping (threads a :class:`RemapState`);
* :class:`MellPlacer`, :func:`make_placer`, :func:`choose_migration`: placement and migration;
* :class:`Link`, :func:`chunk_bytes`: link timing and the chunk size of the coordinated KV exchange.
"""

from vllm_kunserve.policy.admission import KvNeed, admit_count, peak_blocks
from vllm_kunserve.policy.costmodel import (CostModel, Profile, default_model, evaluate, fit, fit_with_holdout,
                                            load_profile, load_vidur_mlp, nnls)
from vllm_kunserve.policy.dispatch import DEFAULT_DISPATCH, DISPATCH, InstanceLoad, choose_instance
from vllm_kunserve.policy.drop import DropPlan, GroupPlan, StageAssignment, balanced_stages, plan_drop
from vllm_kunserve.policy.inputs import EngineLoad, remap_input
from vllm_kunserve.policy.microbatch import (Microbatch, WorkChunk, lookahead_microbatches, pipeline_bubble,
                                             step_budget, token_count_microbatches, work_from_requests)
from vllm_kunserve.policy.levers import LeverDecision, LeverState, decide_levers
from vllm_kunserve.policy.monitor import MonitorDecision, MonitorState, monitor_tick
from vllm_kunserve.policy.overload import OverloadReport, assess_overload, forecast_blocks
from vllm_kunserve.policy.placement import (MellPlacer, MoveCandidate, MoveChoice, OpResult, choose_migration,
                                            lower_bound_l2, size_class)
from vllm_kunserve.policy.placement_baselines import GreedyPlacer, make_placer
from vllm_kunserve.policy.remap import (ModelLayers, RemapInput, RemapPlan, RemapState, decide_remap,
                                        remap_room, spaced_layers)
from vllm_kunserve.policy.restore import RestoreDecision, RestoreState, decide_restore
from vllm_kunserve.policy.snapshot import ClusterSnapshot, InstanceSnapshot, ModelSpec, RequestSnapshot
from vllm_kunserve.policy.transfer import Link, chunk_bytes, fit_link, load_vidur_send_recv

__all__ = [
    "KvNeed", "admit_count", "peak_blocks",
    "ClusterSnapshot", "InstanceSnapshot", "ModelSpec", "RequestSnapshot",
    "DEFAULT_DISPATCH", "DISPATCH", "InstanceLoad", "choose_instance",
    "MonitorDecision", "MonitorState", "monitor_tick", "LeverDecision", "LeverState", "decide_levers",
    "OverloadReport", "assess_overload", "forecast_blocks",
    "DropPlan", "GroupPlan", "StageAssignment", "balanced_stages", "plan_drop",
    "RestoreDecision", "RestoreState", "decide_restore",
    "CostModel", "Profile", "default_model", "evaluate", "fit", "fit_with_holdout", "load_profile",
    "load_vidur_mlp", "nnls",
    "Microbatch", "WorkChunk", "lookahead_microbatches", "pipeline_bubble", "step_budget", "token_count_microbatches",
    "work_from_requests",
    "EngineLoad", "remap_input", "ModelLayers", "RemapInput", "RemapPlan", "RemapState", "decide_remap", "remap_room",
    "spaced_layers",
    "MellPlacer", "GreedyPlacer", "make_placer", "MoveCandidate", "MoveChoice", "OpResult",
    "choose_migration", "lower_bound_l2", "size_class",
    "Link", "chunk_bytes", "fit_link", "load_vidur_send_recv",
]
