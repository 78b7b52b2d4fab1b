"""A peer's FlashAttention metadata made valid on a group member (integration/vllm/attn_meta.py),
against the installed vLLM's own dataclass (0.32, and 0.26 in the second line's run): vLLM on CUDA
cannot run here, so the structure is built as vLLM's builder fills it for a recorded step (two
decodes and a 5-token prefill chunk)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_kunserve.integration.vllm.attn_meta import AttentionMetadataError, flash_fields, localize
from vllm_kunserve.integration.vllm.versions import release

pytestmark = pytest.mark.unit

flash_attn = pytest.importorskip("vllm.v1.attention.backends.flash_attn")


def _recorded(**over):
    """One step's metadata: requests with 16, 32 and 0 tokens of context, 1 + 1 + 5 new tokens,
    block size 16, full CUDA graphs' FA3 plan present."""
    md = dict(num_actual_tokens=7, max_query_len=5, query_start_loc=torch.tensor([0, 1, 2, 7], dtype=torch.int32),
              max_seq_len=33, seq_lens=torch.tensor([17, 33, 5], dtype=torch.int32),
              block_table=torch.tensor([[4, 9, 0], [1, 2, 3], [7, 0, 0]], dtype=torch.int32),
              slot_mapping=torch.tensor([9 * 16, 3 * 16, 7 * 16, 7 * 16 + 1, 7 * 16 + 2, 7 * 16 + 3, 7 * 16 + 4]),
              scheduler_metadata=torch.arange(17, dtype=torch.int32), max_num_splits=4,
              rswa_window_tensor=torch.tensor([8], dtype=torch.int32))
    if release() < (0, 32):   # cascade attention's fields, off as a group member runs (disable_cascade_attn)
        md.update(use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None, prefix_kv_lens=None,
                  suffix_kv_lens=None)
    md.update(over)
    return flash_attn.FlashAttentionMetadata(**md)


class _Builder:
    def __init__(self):
        self.calls = []

    def _get_scheduler_metadata(self, **kw):
        self.calls.append(kw)
        return torch.full((17,), 5, dtype=torch.int32, device=kw["cu_query_lens"].device)


def test_every_field_of_vllms_flash_metadata_has_been_read():
    assert tuple(f.name for f in dataclasses.fields(flash_attn.FlashAttentionMetadata)) == flash_fields()


def test_tensors_move_to_this_workers_device_and_the_fa3_plan_is_made_here():
    md, b = _recorded(), _Builder()
    before = {f.name: getattr(md, f.name) for f in dataclasses.fields(md)}
    here = torch.device("meta")  # a device the recorded tensors are not on
    attn = {"model.layers.16.self_attn.attn": md, "model.layers.17.self_attn.attn": md}  # one object, shared
    localize(attn, here, lambda: {n: b for n in attn})
    for f in dataclasses.fields(md):
        v = getattr(md, f.name)
        if isinstance(before[f.name], torch.Tensor):
            assert v.device == here, f.name
        else:
            assert v == before[f.name], f.name  # ints, flags and Nones untouched
    assert len(b.calls) == 1  # a shared object is made valid once
    call = b.calls[0]
    assert call["aot_schedule"] and call["batch_size"] == 3 and call["max_query_len"] == 5
    assert call["max_seq_len"] == 33 and call["max_num_splits"] == 4 and call["causal"] is True
    assert call["seqlens"] is md.seq_lens and call["cu_query_lens"] is md.query_start_loc  # the moved ones
    assert md.scheduler_metadata.device == here


def test_no_plan_means_no_builder_call_and_same_device_tensors_stay_put():
    md, b = _recorded(scheduler_metadata=None), _Builder()
    qsl = md.query_start_loc
    localize({"l": md}, torch.device("cpu"), lambda: {"l": b})
    assert b.calls == [] and md.query_start_loc is qsl and md.scheduler_metadata is None


def test_a_builder_without_the_plan_method_gets_vllm_026s_own_fa3_call(monkeypatch):
    """vLLM 0.26-0.27 make the FA3 plan inside build(): the peer's plan is made here with the same
    get_scheduler_metadata call, from this worker's builder."""
    calls = []

    def get_scheduler_metadata(**kw):
        calls.append(kw)
        return torch.full((17,), 6, dtype=torch.int32)

    monkeypatch.setattr(flash_attn, "get_scheduler_metadata", get_scheduler_metadata, raising=False)

    class Builder026:   # the attributes 0.26's inner schedule() reads (and no _get_scheduler_metadata)
        num_heads_q, dcp_world_size, num_heads_kv, headdim, block_size = 32, 1, 8, 128, 16
        kv_cache_dtype, aot_sliding_window = torch.bfloat16, (-1, -1)
        cache_config = type("C", (), {"cache_dtype": "auto"})()

    md = _recorded()
    localize({"l": md}, torch.device("cpu"), lambda: {"l": Builder026()})
    (kw,) = calls
    assert kw["batch_size"] == 3 and kw["max_seqlen_q"] == 5 and kw["max_seqlen_k"] == 33
    assert kw["num_heads_q"] == 32 and kw["num_heads_kv"] == 8 and kw["headdim"] == 128 and kw["page_size"] == 16
    assert kw["qkv_dtype"] is torch.bfloat16 and kw["causal"] is True and kw["window_size"] == (-1, -1)
    assert kw["num_splits"] == 4 and kw["cache_seqlens"] is md.seq_lens and kw["cu_seqlens_q"] is md.query_start_loc
    assert md.scheduler_metadata.tolist() == [6] * 17


def test_what_a_group_cannot_run_is_refused_by_name():
    with pytest.raises(AttentionMetadataError, match="decode context parallelism"):
        localize({"l": _recorded(dcp_context_kv_lens=torch.tensor([3]))}, torch.device("cpu"), dict)
    cascade = _recorded()
    cascade.use_cascade = True   # vLLM 0.26-0.31's field (a member starts with disable_cascade_attn)
    with pytest.raises(AttentionMetadataError, match="cascade attention is not supported"):
        localize({"l": cascade}, torch.device("cpu"), dict)
    with pytest.raises(AttentionMetadataError, match="no attention metadata builder for l"):
        localize({"l": _recorded()}, torch.device("cpu"), dict)

    class TritonAttentionMetadata:
        pass

    with pytest.raises(AttentionMetadataError, match="TritonAttentionMetadata has not been read"):
        localize({"l": TritonAttentionMetadata()}, torch.device("cpu"), dict)
    localize({"l": None}, torch.device("cpu"), dict)  # a layer without metadata is left alone
    localize(None, torch.device("cpu"), dict)
