"""benchmarks/relay_cpu.py's profile attribution: py-spy's collapsed stacks counted under the
innermost frame of a known part, shares of the busy samples."""

from __future__ import annotations

import pytest

from tests.unit.benchmod import load_benchmark

pytestmark = pytest.mark.unit


def test_samples_count_under_their_innermost_known_part():
    rc = load_benchmark("relay_cpu")
    raw = "\n".join([
        # the relay's parse, called from uvicorn's task: the relay is the innermost known part
        "run (asyncio/runners.py:118);run_cycle (uvicorn/server.py:1);stream (vllm_kunserve/cluster/frontend/relay.py:9);"
        "_forward (vllm_kunserve/cluster/frontend/relay.py:20) 30",
        # aiohttp reading under the relay's loop: aiohttp is innermost
        "run (asyncio/runners.py:118);stream (vllm_kunserve/cluster/frontend/relay.py:9);"
        "readany (aiohttp/streams.py:5) 50",
        "run (asyncio/runners.py:118);send (uvicorn/protocols/http/httptools_impl.py:3) 20",
        "run (asyncio/runners.py:118);mystery (somewhere.py:1) 0",
        "not a sample line",
    ])
    shares = rc.attribute(raw)
    assert shares == {"aiohttp: engine stream in": 0.5, "relay: parse and rewrite": 0.3,
                      "uvicorn: client stream out": 0.2}
    top = rc.top_frames(raw, 2)
    assert top == [["readany (aiohttp/streams.py:5)", 0.5], ["_forward (vllm_kunserve/cluster/frontend/relay.py:20)", 0.3]]
