"""The relay's lean path (issue 37): a first-engine chunk with nothing to recount is passed on as the
engine wrote it, less the token ids the client did not ask for, and the relay still records every
id failover and migration need. Whatever the lean path forwards reads back, as JSON, exactly as the
full decode-and-rewrite path's output; what it cannot handle goes the full path."""

from __future__ import annotations

import json

import pytest

from vllm_kunserve.cluster.frontend.relay import Flight, Relay, _strip_ids
from vllm_kunserve.cluster.frontend.validate import Checked

pytestmark = pytest.mark.unit

# chunks as vLLM 0.32 writes them (``model_dump_json(exclude_unset=True)``, return_token_ids)
FIRST = (b'{"id":"cmpl-7","object":"text_completion","created":1764000000,"model":"m","choices":[{"index":0,'
         b'"text":" w1","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":[5,6,7],'
         b'"token_ids":[101]}]}')
# a text that holds what a member looks like: inside a string every quote is escaped
TRICKY = (b'{"id":"cmpl-7","object":"text_completion","created":1764000000,"model":"m","choices":[{"index":0,'
          b'"text":" \\",\\"token_ids\\":[9]} \\u00e9\xe2\x9c\x93\\\\","logprobs":null,"finish_reason":null,'
          b'"stop_reason":null,"token_ids":[102]}]}')
LAST = (b'{"id":"cmpl-7","object":"text_completion","created":1764000000,"model":"m","choices":[{"index":0,'
        b'"text":" w3","logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":[103]}]}')
CHAT = (b'{"id":"chatcmpl-2","object":"chat.completion.chunk","created":1764000000,"model":"m","choices":[{"index":0,'
        b'"delta":{"content":" w1"},"logprobs":null,"finish_reason":null,"token_ids":[101]}],'
        b'"prompt_token_ids":[5,6,7]}')


def _relay(wants_ids: bool = False, kind: str = "completion", usage: bool = False) -> Relay:
    body = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}
    if wants_ids:
        body["return_token_ids"] = True
    if usage:
        body["stream_options"] = {"include_usage": True}
    return Relay(host=None, flight=Flight("r1", Checked(kind, body, [3], 3, True, True), 0, "m"))


def _full(relay: Relay, payload: bytes) -> bytes | None:
    """The same chunk through the full path (decode, rewrite, encode)."""
    chunk = relay._absorb(json.loads(payload))
    return None if chunk is None else b"data: " + json.dumps(chunk).encode() + b"\n\n"


@pytest.mark.parametrize("wants_ids", [False, True])
def test_lean_path_forwards_what_the_full_path_would_and_records_the_ids(wants_ids):
    lean, full = _relay(wants_ids), _relay(wants_ids)
    for payload in (FIRST, TRICKY, LAST):
        out = lean._forward(payload)
        assert json.loads(out[6:-2]) == json.loads(_full(full, payload)[6:-2])
        if wants_ids:   # nothing to take out: the engine's bytes, untouched
            assert out == b"data: " + payload + b"\n\n"
    f = lean.f
    assert f.prompt_ids == [5, 6, 7] and f.generated == [101, 102, 103] and lean.finished
    assert (f.visible_id, f.created) == ("cmpl-7", 1764000000)
    assert (f.prompt_ids, f.generated, lean.finished) == (full.f.prompt_ids, full.f.generated, full.finished)
    if not wants_ids:
        assert b"token_ids" not in lean._forward(FIRST.replace(b"101", b"104"))
        # the text that mimics a member is the text, byte for byte
        assert b'\\",\\"token_ids\\":[9]} \\u00e9\xe2\x9c\x93\\\\"' in _strip_ids(TRICKY)


def test_chat_chunks_lose_the_top_level_prompt_ids_too():
    r = _relay(kind="chat")
    out = json.loads(r._forward(CHAT)[6:-2])
    assert "prompt_token_ids" not in out and "token_ids" not in out["choices"][0]
    assert out["choices"][0]["delta"] == {"content": " w1"} and r.f.prompt_ids == [5, 6, 7]


def test_what_the_lean_path_cannot_take_goes_the_full_path():
    # a token-id member first in its object: the pattern leaves it, so the chunk is rewritten whole
    first_member = FIRST.replace(b'{"index":0,"text":" w1",', b'{"token_ids":[101],"index":0,"text":" w1",') \
        .replace(b',"token_ids":[101]', b"")
    assert _strip_ids(first_member) is None
    r = _relay()
    out = json.loads(r._forward(first_member)[6:-2])
    assert "token_ids" not in out["choices"][0] and r.f.generated == [101]
    # a usage chunk the client did not ask for is dropped (the full path's rule)
    usage = b'{"id":"cmpl-7","object":"text_completion","created":1,"model":"m","choices":[],"usage":' \
            b'{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}'
    assert r._forward(usage) is None
    # and a malformed chunk is a ValueError (a broken stream), as before
    with pytest.raises(ValueError):
        r._forward(b'{"id": ')
