"""A peer's attention metadata made valid on this worker (a pipeline group's span, vLLM 0.32.x).

A grouped step sends its span's ``attn_metadata`` (one object per attention layer, usually shared)
through the stage link; its tensors arrive as copies on the link's side of the process boundary.
What each backend needs before this worker's layers can use it, read from vLLM 0.32.0's source:

- ``CPUAttentionMetadata`` (``v1/attention/backends/cpu_attn.py``): ``scheduler_metadata`` is a plan
  made by ``_custom_ops.cpu_attn_get_scheduler_metadata``, which also sizes a process-wide
  scratchpad: a plan made in the peer's process leaves ours unsized (a segfault in
  ``cpu_attn_impl.hpp``), so it is made again with this worker's builder.
- ``FlashAttentionMetadata`` (``v1/attention/backends/flash_attn.py``, the CUDA default): every
  tensor field (``query_start_loc``, ``seq_lens``, ``block_table``, ``slot_mapping`` and the
  optional ones) must be on this worker's device (a peer on another GPU receives them on the
  caller's: the device link's buffer is the caller's allocation); block ids in ``block_table`` and
  ``slot_mapping`` are the caller's, which is what the peer's KV views for the caller are indexed
  by. ``scheduler_metadata`` (FA3's ahead-of-time tile plan) depends on the device's SM count and,
  with full CUDA graphs, is a view of the caller builder's persistent buffer: it is made again with
  this worker's builder (``_get_scheduler_metadata``), eager (a peer's span is not captured).
  Decode context parallelism (``dcp_context_kv_lens``) is refused: a group's member is one rank.

Any other metadata type is refused with a :class:`AttentionMetadataError` naming it, rather than run
with a plan that may not be this process's. Mechanism-level only on CUDA: vLLM on CUDA has not run
here (docs/benchmarks/stage_link_gpu.md), so these branches are tested against vLLM's own dataclass
with recorded values (tests/unit/test_attn_meta.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from vllm_kunserve.integration.vllm.versions import release

#: FlashAttentionMetadata's fields in vLLM 0.32.0 that this module has read and handles; a vLLM that
#: adds one fails tests/unit/test_attn_meta.py until it has been read too
FLASH_FIELDS = (
    "num_actual_tokens", "max_query_len", "query_start_loc", "max_seq_len", "seq_lens", "block_table",
    "slot_mapping", "max_dcp_context_kv_len", "dcp_context_kv_lens", "num_decode_reqs", "num_prefill_reqs",
    "num_decode_tokens", "num_prefill_tokens", "scheduler_metadata", "max_num_splits", "causal",
    "mm_prefix_query_range_tensor", "rswa_prefix_lens", "rswa_window", "rswa_window_tensor",
)


class AttentionMetadataError(RuntimeError):
    """A peer's attention metadata cannot be used on this worker."""


def localize(attn: Any, device: torch.device, builders: Callable[[], dict[str, Any]]) -> None:
    """Make every layer's metadata in ``attn`` (layer name -> metadata) valid here, in place.
    ``builders()`` gives this worker's metadata builder per layer name (called only when needed)."""
    if not isinstance(attn, dict):
        return
    done: set[int] = set()
    for name, md in attn.items():
        if md is None or id(md) in done:
            continue
        done.add(id(md))
        kind = type(md).__name__
        if kind == "CPUAttentionMetadata":
            _cpu(name, md, builders)
        elif kind == "FlashAttentionMetadata":
            _flash(name, md, device, builders)
        else:
            raise AttentionMetadataError(
                f"layer {name}: attention metadata {kind} has not been read for pipeline groups "
                "(CPUAttentionMetadata and FlashAttentionMetadata are)")


def _builder(name: str, builders: Callable[[], dict[str, Any]]) -> Any:
    b = builders().get(name)
    if b is None:
        raise AttentionMetadataError(f"no attention metadata builder for {name} on this worker")
    return b


def _cpu(name: str, md: Any, builders: Callable[[], dict[str, Any]]) -> None:
    if md.encoder_cache is not None:
        return
    b = _builder(name, builders)
    from vllm import _custom_ops as ops
    from vllm import envs

    # vLLM 0.26: no kv_cache_dtype (0.27 added it to the builder and the op)
    extra = {} if release() < (0, 27) else {"kv_cache_dtype": b.kv_cache_dtype}
    md.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=md.query_start_loc.numel() - 1, num_heads=b.num_heads, num_kv_heads=b.num_kv_heads,
        head_dim=b.head_dim, seq_lens=md.seq_lens, dtype=b.dtype, query_start_loc=md.query_start_loc,
        causal=md.causal, sliding_window_size=b.window_size, isa=b.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=md.dynamic_causal, **extra)


def _flash(name: str, md: Any, device: torch.device, builders: Callable[[], dict[str, Any]]) -> None:
    if getattr(md, "dcp_context_kv_lens", None) is not None:
        raise AttentionMetadataError(
            f"layer {name}: decode context parallelism (dcp_context_kv_lens) is not supported in a pipeline group")
    for f in dataclasses.fields(md):
        v = getattr(md, f.name)
        if isinstance(v, torch.Tensor) and v.device != device:
            setattr(md, f.name, v.to(device))
    if md.scheduler_metadata is not None:
        b = _builder(name, builders)
        md.scheduler_metadata = b._get_scheduler_metadata(
            aot_schedule=True, batch_size=md.query_start_loc.numel() - 1, cu_query_lens=md.query_start_loc,
            max_query_len=md.max_query_len, seqlens=md.seq_lens, max_seq_len=md.max_seq_len,
            causal=md.causal, max_num_splits=md.max_num_splits)


__all__ = ["AttentionMetadataError", "FLASH_FIELDS", "localize"]
