"""Weight streaming of remapped decoder layers through one or two shared slots."""

from __future__ import annotations

import pytest
import torch

from vllm_kunserve.memory import LayerReleasedError, MemoryPool
from vllm_kunserve.memory import streaming
from vllm_kunserve.memory.streaming import WeightStreamer, install_streaming

transformers = pytest.importorskip("transformers")

NUM_LAYERS = 6


def _evenly_spaced(num_layers: int, alpha: int) -> list[int]:
    return [int((k + 0.5) * num_layers / alpha) for k in range(alpha)]


def _tiny_llama(device: str = "cpu"):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval().to(device)


def _run(model, ids):
    """Logits of a prefill and greedy tokens of a short decode (several forward passes)."""
    with torch.no_grad():
        logits = model(ids).logits
        mask = torch.ones_like(ids)
        toks = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return logits, toks


@pytest.fixture(scope="module")
def llama():
    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, ids, _run(model, ids)


def _layer_params(layer):
    return {n: p for n, p in layer.named_parameters()}


@pytest.mark.unit
@pytest.mark.parametrize("copier", ["thread", "inline"])
@pytest.mark.parametrize("num_slots", [1, 2])
@pytest.mark.parametrize("alpha", range(1, NUM_LAYERS // 2 + 1))
def test_streamed_outputs_identical_to_resident(llama, alpha, num_slots, copier, monkeypatch):
    model, ids, (ref_logits, ref_toks) = llama
    layers = model.model.layers
    remapped = _evenly_spaced(NUM_LAYERS, alpha)
    originals = {i: _layer_params(layers[i]) for i in remapped}
    monkeypatch.setattr(streaming, "_spare_core", lambda: copier == "thread")
    streamer = install_streaming(layers, remapped, num_slots)
    try:
        assert type(streamer._copier).__name__ == {"thread": "_ThreadCopier", "inline": "_InlineCopier"}[copier]
        slot_ptrs = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in streamer.slots]
        for i in remapped:  # the remapped layers really compute from the shared slots
            for n, p in _layer_params(layers[i]).items():
                assert p is not originals[i][n]
                assert any(lo <= p.data_ptr() < hi for lo, hi in slot_ptrs), n
        logits, toks = _run(model, ids)
        assert torch.equal(logits, ref_logits)
        assert torch.equal(toks, ref_toks)
        assert streamer.stats.sync_loads == 0
        if alpha > num_slots:
            assert streamer.stats.copies > alpha  # layers were re-fetched every pass
    finally:
        streamer.uninstall()


@pytest.mark.unit
def test_uninstall_restores_the_resident_model(llama):
    model, ids, (ref_logits, _) = llama
    layers = model.model.layers
    before = {i: _layer_params(layers[i]) for i in range(NUM_LAYERS)}
    with WeightStreamer(layers, [1, 4], num_slots=1):
        assert layers[1].self_attn.q_proj.weight is not before[1]["self_attn.q_proj.weight"]
    for i in range(NUM_LAYERS):
        after = _layer_params(layers[i])
        assert all(after[n] is p for n, p in before[i].items())
        assert not layers[i]._forward_pre_hooks and not layers[i]._forward_hooks
        assert "forward" not in vars(layers[i])  # the class's own forward again
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref_logits)


@pytest.mark.unit
def test_out_of_order_use_stays_correct(llama):
    """A pass aborted half-way leaves slots out of step; the next pass must still be exact."""
    model, ids, (ref_logits, _) = llama
    layers = model.model.layers
    streamer = install_streaming(layers, [1, 3, 5], num_slots=1)
    boom = layers[2].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
            model(ids)
        boom.remove()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref_logits)
            assert torch.equal(model(ids).logits, ref_logits)
        assert streamer.stats.sync_loads >= 1
    finally:
        boom.remove()
        streamer.uninstall()


@pytest.mark.unit
def test_streaming_from_released_pool_regions():
    """Oneiros end to end on the host pool: remapped layers' chunks become KV, the layers stream."""
    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    ref_logits, ref_toks = _run(model, ids)
    layers = model.model.layers
    pool = MemoryPool(64 << 20, backend="host", chunk_bytes=64 << 10)
    try:
        regions = {i: pool.create_weight_region(f"layer{i}", layers[i]) for i in range(NUM_LAYERS)}
        kv = pool.create_kv_region("kv", pool.capacity_bytes, 64 << 10)
        remapped = [1, 4]
        streamer = install_streaming(layers, remapped, 1, sources={i: regions[i] for i in remapped})
        freed = sum(pool.release_layer(regions[i]) for i in remapped)
        kv.grow(freed)
        kv.view().fill_(0x5A)  # the remapped layers' old memory now holds KV data
        logits, toks = _run(model, ids)
        assert torch.equal(logits, ref_logits) and torch.equal(toks, ref_toks)
        with pytest.raises(LayerReleasedError, match="reload"):
            streamer.uninstall()  # the layers' own memory is gone
        kv.shrink(freed)
        for i in remapped:
            pool.reload_layer(regions[i])
        streamer.uninstall()
        assert torch.equal(_run(model, ids)[0], ref_logits)
        pool.check()
    finally:
        pool.close()


@pytest.mark.unit
def test_streaming_a_released_layer_without_source_is_a_clear_error():
    model = _tiny_llama()
    with MemoryPool(16 << 20, backend="host", chunk_bytes=64 << 10) as pool:
        pool.create_weight_region("l2", model.model.layers[2])
        pool.release_layer("l2")
        with pytest.raises(LayerReleasedError, match="sources="):
            install_streaming(model.model.layers, [2])
        with pytest.raises(ValueError, match="outside"):
            install_streaming(model.model.layers, [NUM_LAYERS])
        with pytest.raises(ValueError, match="num_slots"):
            install_streaming(model.model.layers, [1], num_slots=3)


@pytest.mark.gpu
@pytest.mark.parametrize("num_slots", [1, 2])
def test_streamed_outputs_match_on_cuda(num_slots):
    model = _tiny_llama("cuda")
    ids = torch.randint(0, 128, (2, 12), device="cuda")
    ref_logits, ref_toks = _run(model, ids)
    for alpha in range(1, NUM_LAYERS // 2 + 1):
        streamer = install_streaming(model.model.layers, _evenly_spaced(NUM_LAYERS, alpha), num_slots)
        try:
            logits, toks = _run(model, ids)
            torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
            assert torch.equal(toks, ref_toks)
            assert streamer.stats.sync_loads == 0
        finally:
            streamer.uninstall()
