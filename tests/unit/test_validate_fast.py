"""The front end's per-request checks on their fast paths give the verdicts of the slow ones: vLLM's
request models are consulted once per request shape (same fields, another prompt), never for a
shape they rejected or for a prompt form the shape does not capture; prompts are counted by the
tokenizer's Rust backend only where it counts as the transformers wrapper does."""

from __future__ import annotations

import pytest

from vllm_kunserve.cluster.frontend import validate as V

pytestmark = pytest.mark.unit

SERVED = dict(served=["m"], max_model_len=4096, count_tokens=lambda kind, body: [3])


@pytest.fixture
def counted(monkeypatch):
    """vLLM's request models, with every call to model_validate counted."""
    real = V.load_request_models()
    calls = []

    def wrap(cls):
        class Counted:
            @staticmethod
            def model_validate(body):
                calls.append(dict(body))
                return cls.model_validate(body)
        return Counted

    monkeypatch.setattr(V, "load_request_models", lambda: (wrap(real[0]), wrap(real[1])))
    monkeypatch.setattr(V, "_verdicts", V._Verdicts())
    return calls


def test_same_fields_another_prompt_skips_the_models_with_the_same_verdict(counted):
    base = {"model": "m", "max_tokens": 8, "stream": True, "temperature": 0, "stream_options": {"include_usage": True}}
    first = V.validate("completion", {**base, "prompt": "one prompt"}, **SERVED)
    second = V.validate("completion", {**base, "prompt": "another, longer prompt"}, **SERVED)
    assert len(counted) == 1
    assert (first.stream, first.movable, first.max_tokens) == (second.stream, second.movable, second.max_tokens)
    # any other field value, or another prompt form, is a shape of its own: checked by the models
    V.validate("completion", {**base, "prompt": "x", "temperature": 0.5}, **SERVED)
    V.validate("completion", {**base, "prompt": [1, 2, 3]}, **SERVED)
    V.validate("completion", {**base, "prompt": ["a", "b"]}, **SERVED)     # a list of texts: never memoized
    V.validate("completion", {**base, "prompt": ["a", "b"]}, **SERVED)
    assert len(counted) == 5
    # the chat shape holds the roles: another role sequence is checked again
    chat = {"model": "m", "max_tokens": 8, "stream": True}
    V.validate("chat", {**chat, "messages": [{"role": "user", "content": "hi"}]}, **SERVED)
    V.validate("chat", {**chat, "messages": [{"role": "user", "content": "hello there"}]}, **SERVED)
    V.validate("chat", {**chat, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
               **SERVED)
    assert len(counted) == 7


def test_a_shape_the_models_rejected_is_rejected_every_time(counted):
    bad = {"model": "m", "prompt": "a", "n": "two"}
    for prompt in ("a", "b"):
        with pytest.raises(V.BadRequest) as e:
            V.validate("completion", {**bad, "prompt": prompt}, **SERVED)
        assert e.value.param == "n"
    assert len(counted) == 2
    # a memoized shape with an empty prompt: the empty prompt is another form, and vLLM refuses it
    ok = {"model": "m", "max_tokens": 4}
    V.validate("completion", {**ok, "prompt": "fine"}, **SERVED)
    with pytest.raises(V.BadRequest):
        V.validate("completion", {**ok, "prompt": ""}, **SERVED)
    # a chat whose fields passed, then one with a message content of the wrong type
    V.validate("chat", {**ok, "messages": [{"role": "user", "content": "x"}]}, **SERVED)
    with pytest.raises(V.BadRequest):
        V.validate("chat", {**ok, "messages": [{"role": "user", "content": 5}]}, **SERVED)


def test_a_body_a_validator_rewrote_is_not_remembered(monkeypatch):
    calls = []

    class Rewrites:
        @staticmethod
        def model_validate(body):
            calls.append(1)
            body["max_tokens"] = 16   # as a "before" validator that edits the dict in place would

            class Req:
                stream, n, use_beam_search = False, 1, False
            return Req

    monkeypatch.setattr(V, "load_request_models", lambda: (Rewrites, Rewrites))
    monkeypatch.setattr(V, "_verdicts", V._Verdicts())
    for prompt in ("a", "b"):
        V.check_fields("completion", {"model": "m", "prompt": prompt, "max_tokens": None})
    assert len(calls) == 2


def test_shape_key_refuses_what_it_cannot_capture():
    assert V.shape_key("completion", {"prompt": "\ud800"}) is None          # not UTF-8
    assert V.shape_key("completion", {"prompt": [1, -2]}) is None
    assert V.shape_key("completion", {"prompt": [1, True]}) is None
    assert V.shape_key("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}) is None
    assert V.shape_key("chat", {"messages": [{"role": "user", "content": "x", "name": "n"}]}) is None
    a = V.shape_key("completion", {"prompt": "x", "seed": 1})
    assert a != V.shape_key("completion", {"prompt": "x", "seed": 1.0})
    assert a != V.shape_key("completion", {"prompt": "x", "seed": True})
    assert a == V.shape_key("completion", {"seed": 1, "prompt": "another"})


def test_prompt_counter_counts_as_the_wrapper(tmp_path):
    from transformers import AutoTokenizer

    from vllm_kunserve.tools.make_model import PRESETS, build_model

    tok = AutoTokenizer.from_pretrained(str(build_model(tmp_path / "tiny", PRESETS["tiny"])))
    count = V.prompt_counter(tok)
    assert count.__name__ == "fast"   # this tokenizer's backend agrees with its wrapper
    for text in ("the cache holds blocks and", " x  y ", "日本語のテキスト ✓", "<s>hello</s>", "a" * 700):
        for special in (True, False):
            assert count(text, special) == len(tok(text, add_special_tokens=special)["input_ids"])

    class Disagrees:   # a backend that counts otherwise is not used
        _tokenizer = tok._tokenizer

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [0] * (len(text) + 1)}

    slow = V.prompt_counter(Disagrees())
    assert slow.__name__ == "wrapped" and slow("abc", True) == 4
    assert V.prompt_counter(None) is None


def test_parse_json_reads_what_the_json_module_reads():
    import json
    import math

    for raw in (b'{"prompt": "caf\xc3\xa9", "max_tokens": 3}', b'{"a": 123456789012345678901234567890}',
                b'{"a": 1, "a": 2}', b'{"t": NaN}', b'{"t": 1e400}', b'{"s": "\\ud800"}'):
        got, want = V.parse_json(raw), json.loads(raw)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == want[k] or (isinstance(want[k], float) and math.isnan(want[k]) and math.isnan(got[k]))
    for raw in (b"{", b"[1]", b"\xff\xfe", b'"x"'):
        with pytest.raises(V.BadRequest):
            V.parse_json(raw)
