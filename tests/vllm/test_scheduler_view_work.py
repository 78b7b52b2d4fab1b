"""The engine's pending work and request mix, read from vLLM's own Request objects
(scheduler_view.pending_tokens, request_mix): the mix is what the drop monitor weighs to tell a
decode-bound load from a prefill-bound one."""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.vllm


def test_pending_tokens_from_real_requests():
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from vllm_kunserve.integration.vllm.scheduler_view import SchedulerView

    def req(i, prompt, max_tokens):
        return Request(f"r{i}", list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), None)

    waiting = [req(0, 64, 320), req(1, 256, 24)]
    running = req(2, 100, 50)
    running.num_computed_tokens = 40          # mid-prefill: 60 prompt tokens left
    done = req(3, 32, 10)
    done.num_computed_tokens = 32
    done.append_output_token_ids([5, 6, 7])   # decoding: 3 of 10 generated
    done.num_computed_tokens = 34
    view = types.SimpleNamespace(scheduler=types.SimpleNamespace(waiting=waiting, running=[running, done]))
    prefill, decode = SchedulerView.pending_tokens(view)
    assert prefill == 64 + 256 + 60 + 0
    assert decode == 320 + 24 + 50 + 7
    # the mix counts whole requests, however far along: prompt lengths and output budgets
    prompt, output = SchedulerView.request_mix(view)
    assert (prompt, output) == (64 + 256 + 100 + 32, 320 + 24 + 50 + 10)
