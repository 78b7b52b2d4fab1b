"""Prompt synthesis: exact token counts for the served tokenizer, determinism, no special ids."""

import pytest

from vllm_kunserve.bench.prompts import PromptFactory, load_tokenizer, vocab_size_from_config

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from vllm_kunserve.tools.make_model import PRESETS, build_tokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d, PRESETS["tiny"])
    (d / "config.json").write_text('{"vocab_size": 500}')
    return d


def test_id_prompts_exact_deterministic_and_valid(tok_dir):
    tok = load_tokenizer(str(tok_dir))
    f = PromptFactory(tok, vocab_size=vocab_size_from_config(tok_dir), seed=3)
    a, b = f.make(257, key=1), f.make(257, key=2)
    assert len(a) == 257 and f.count(a) == 257
    assert a == PromptFactory(tok, vocab_size=500, seed=3).make(257, key=1)  # reproducible
    assert a[:8] != b[:8]  # different requests share no prefix
    special = set(tok.all_special_ids)
    assert all(0 <= x < 500 and x not in special for x in a + b)  # bounded by the model's vocab_size


@pytest.mark.parametrize("n", [1, 2, 17, 300])
def test_text_prompts_encode_to_exact_count(tok_dir, n):
    tok = load_tokenizer(str(tok_dir))
    f = PromptFactory(tok, mode="text", seed=0)
    text = f.make(n, key=n)
    assert isinstance(text, str)
    assert len(tok(text)["input_ids"]) == n  # as the server tokenizes it


def test_bad_inputs():
    with pytest.raises(ValueError, match="tokenizer"):
        PromptFactory(None, mode="text", vocab_size=100)
    with pytest.raises(ValueError, match="ids or text"):
        PromptFactory(None, vocab_size=100, mode="words")
    with pytest.raises(ValueError, match=">= 1"):
        PromptFactory(vocab_size=100).make(0, key=0)
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer("/nonexistent/tokenizer/dir")
