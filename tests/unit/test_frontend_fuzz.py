"""No 5xx for a client's input: generated request bodies against the front end's validation and relay.

Hypothesis builds bodies of three kinds and posts them to ``/v1/completions`` and
``/v1/chat/completions`` of one front end over two fake engines (``test_frontend._stack``):
arbitrary JSON (nested values, odd strings: lone surrogates, NUL, huge numbers), OpenAI-shaped
bodies with fields of the wrong types and out-of-range values, and raw bytes that are not JSON at
all. Every answer must be a 2xx or a 4xx with the OpenAI error body, and afterwards the fleet must
be as it was: both engines alive and dispatchable, nothing left in flight.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from tests.unit.test_frontend import _stack, _teardown

pytestmark = pytest.mark.unit

_text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=12)
_scalar = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                    st.floats(allow_nan=False, allow_infinity=False), _text)
_json = st.recursive(_scalar, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                     st.dictionaries(_text, kids, max_size=4)), max_leaves=12)
_FIELDS = ("prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "temperature", "top_p",
           "stop", "model", "logprobs", "echo", "best_of", "use_beam_search", "stream_options",
           "return_token_ids", "add_special_tokens", "seed", "ignore_eos", "min_tokens")
_shaped = st.dictionaries(st.sampled_from(_FIELDS), _json, min_size=1, max_size=6)
_message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), _text),
                                  "content": st.one_of(_text, _json)})
_chat = st.fixed_dictionaries({"messages": st.lists(_message, min_size=0, max_size=3)},
                              optional={"max_tokens": _json, "stream": _json, "n": _json})
_completion = st.fixed_dictionaries({"prompt": st.one_of(_text, st.lists(st.integers(-5, 2 ** 40), max_size=5),
                                                         st.lists(_text, max_size=3), _json)},
                                    optional={"max_tokens": st.one_of(st.integers(-3, 5000), _json),
                                              "stream": _json, "n": _json, "model": _json})


def _encode(body) -> bytes:
    # ensure_ascii keeps lone surrogates as \\udxxx escapes: valid JSON the decoder must meet
    return json.dumps(body, ensure_ascii=True, allow_nan=False).encode()


_body = st.one_of(_shaped.map(_encode), _chat.map(_encode), _completion.map(_encode), _json.map(_encode),
                  st.binary(max_size=64))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from vllm_kunserve.cluster.frontend.validate import prompt_counter
    from vllm_kunserve.tools.make_model import PRESETS, build_tokenizer

    loop = asyncio.new_event_loop()
    fakes, front, client, runners = loop.run_until_complete(_stack())
    # the tokenizer a served model has (byte-level BPE with a chat template): the front end counts
    # prompts and renders chats with it, the paths where a lone surrogate once was a 500
    front.tokenizer = build_tokenizer(tmp_path_factory.mktemp("tok"), PRESETS["tiny"])
    front._count = prompt_counter(front.tokenizer)
    yield loop, fakes, front, client
    loop.run_until_complete(_teardown(front, client, runners))
    loop.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(raw=_body, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
@example(raw=b'{"prompt": "\\udc80"}', path="/v1/completions")           # were 500s (issue 36)
@example(raw=b'{"messages": [{"role": "user", "content": "\\udc80"}]}', path="/v1/chat/completions")
@example(raw=b"[" * 10000 + b"]" * 10000, path="/v1/completions")
@example(raw=b'{"prompt": [0.0]}', path="/v1/completions")              # a 500 until stop 83 (a float id)
def test_no_body_gets_a_5xx_and_the_fleet_is_unchanged(stack, raw, path):
    loop, fakes, front, client = stack

    async def go():
        r = await client.post(path, content=raw, headers={"content-type": "application/json"})
        return r.status_code, r.content

    status, content = loop.run_until_complete(go())
    assert status < 500, (status, raw[:200], content[:300])
    if status >= 400:
        err = json.loads(content)["error"]
        assert err["code"] == status and err["message"], content
    assert all(e.accepting for e in front.fleet.engines)
    assert not front.flights, front.flights
