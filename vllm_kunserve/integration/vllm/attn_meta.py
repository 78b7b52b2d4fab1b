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
  vLLM 0.26-0.31 (read from their source) add cascade attention's fields (``use_cascade``, the
  prefix's lengths and plan): a group member starts with ``disable_cascade_attn`` (vLLM's default;
  ``engine_hooks``), and a span that arrives with cascade on is refused. 0.26-0.27 make the FA3 plan
  inside ``build()`` (no ``_get_scheduler_metadata``): it is made again here with the same call,
  ``get_scheduler_metadata`` with the builder's heads, head size, KV dtype, block size and window.

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
#: vLLM 0.28-0.31: 0.32's fields and cascade attention's (after ``slot_mapping``; its plan after
#: ``scheduler_metadata``)
_CASCADE = ("use_cascade", "common_prefix_len", "cu_prefix_query_lens", "prefix_kv_lens", "suffix_kv_lens")
FLASH_FIELDS_028 = tuple(f for name in FLASH_FIELDS for f in (
    (name, *_CASCADE) if name == "slot_mapping" else
    (name, "prefix_scheduler_metadata") if name == "scheduler_metadata" else (name,)))
#: vLLM 0.26-0.27: also a ``sliding_window`` tuple, and the multimodal ranges under their older name
FLASH_FIELDS_026 = tuple(f for name in FLASH_FIELDS_028 for f in (
    ("sliding_window", "mm_prefix_range_tensor") if name == "mm_prefix_query_range_tensor" else (name,)))


def flash_fields(rel: tuple[int, int] | None = None) -> tuple[str, ...]:
    """The FlashAttentionMetadata fields read here for vLLM release ``rel`` (default: the running one)."""
    rel = rel or release()
    return FLASH_FIELDS_026 if rel < (0, 28) else FLASH_FIELDS_028 if rel < (0, 32) else FLASH_FIELDS


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
    if getattr(md, "use_cascade", False):   # vLLM 0.26-0.31
        raise AttentionMetadataError(
            f"layer {name}: cascade attention is not supported in a pipeline group (its members start with "
            "disable_cascade_attn)")
    for f in dataclasses.fields(md):
        v = getattr(md, f.name)
        if isinstance(v, torch.Tensor) and v.device != device:
            setattr(md, f.name, v.to(device))
    if md.scheduler_metadata is not None:
        b = _builder(name, builders)
        if not hasattr(b, "_get_scheduler_metadata"):   # vLLM 0.26-0.27: made inside build()
            md.scheduler_metadata = _fa3_plan_026(b, md)
            return
        md.scheduler_metadata = b._get_scheduler_metadata(
            aot_schedule=True, batch_size=md.query_start_loc.numel() - 1, cu_query_lens=md.query_start_loc,
            max_query_len=md.max_query_len, seqlens=md.seq_lens, max_seq_len=md.max_seq_len,
            causal=md.causal, max_num_splits=md.max_num_splits)


def _fa3_plan_026(b: Any, md: Any) -> Any:
    """vLLM 0.26-0.27's ``FlashAttentionMetadataBuilder.build`` plan (its inner ``schedule``, the
    non-cascade, non-DCP call) for this worker's builder ``b``."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends import flash_attn as fa

    qkv_dtype = (current_platform.fp8_dtype() if fa.is_quantized_kv_cache(b.cache_config.cache_dtype)
                 else b.kv_cache_dtype)
    return fa.get_scheduler_metadata(
        batch_size=md.query_start_loc.numel() - 1, max_seqlen_q=md.max_query_len, max_seqlen_k=md.max_seq_len,
        num_heads_q=b.num_heads_q * b.dcp_world_size, num_heads_kv=b.num_heads_kv, headdim=b.headdim,
        cache_seqlens=md.seq_lens, qkv_dtype=qkv_dtype, cu_seqlens_q=md.query_start_loc, page_size=b.block_size,
        causal=md.causal, window_size=fa._maybe_symmetrize_window(b.aot_sliding_window, md.causal),
        num_splits=md.max_num_splits)


__all__ = ["AttentionMetadataError", "FLASH_FIELDS", "flash_fields", "localize"]
