"""Cache-aware dispatch and session affinity: the policy (policy/dispatch/cache_aware.py) over
snapshots, the front end's prefix index and session map (cluster/frontend/prefix.py)."""

import pytest

from vllm_kunserve.cluster.frontend.prefix import CHUNK, PrefixIndex, Sessions, prompt_key
from vllm_kunserve.policy.dispatch import DISPATCH, InstanceLoad, choose_instance

pytestmark = pytest.mark.unit


def _u(i, requests=0, share=0.0, affinity=False, used=0, cap=100):
    return InstanceLoad(i, used, 0, cap, requests=requests, prefix_share=share, affinity=affinity)


def test_the_cached_or_the_sessions_engine_wins_within_the_load_bound():
    assert "cache-aware" in DISPATCH
    # a long shared prefix on engine 1: it wins though engine 0 is idle
    assert choose_instance([_u(0), _u(1, requests=3, share=0.8)], "cache-aware") == 1
    # a short match does not count: least work
    assert choose_instance([_u(0), _u(1, requests=3, share=0.2)], "cache-aware") == 0
    # the hot engine is too busy (more than the bound above the least loaded): least work
    assert choose_instance([_u(0), _u(1, requests=9, share=0.9)], "cache-aware") == 0
    # the session's engine first, over a better prefix elsewhere
    assert choose_instance([_u(0, share=0.9), _u(1, requests=1, affinity=True)], "cache-aware") == 1
    # an engine the prompt does not fit is not chosen for its cache
    assert choose_instance([_u(0), _u(1, share=0.9, used=99)], "cache-aware", prompt_blocks=5) == 0


def test_the_index_finds_leading_chunks_and_forgets_a_restarted_engine():
    idx = PrefixIndex(capacity=1000)
    system = "You are a helpful assistant. " * 20          # a shared system prompt, many chunks long
    a = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi " * 30}]}
    b = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "bye " * 30}]}
    idx.add(1, prompt_key(a))
    share = idx.share(prompt_key(b))
    assert set(share) == {1} and 0.5 < share[1] < 1.0      # the system prompt's chunks, not the question
    assert idx.share(prompt_key({"prompt": "x" * 500})) == {}
    ids = list(range(3 * CHUNK))
    idx.add(0, prompt_key({"prompt": ids}))
    assert idx.share(prompt_key({"prompt": ids + [1, 2]}))[0] == pytest.approx(3 * CHUNK / (3 * CHUNK + 2))
    idx.forget(1)
    assert 1 not in idx.share(prompt_key(b))
    assert prompt_key({"prompt": ["a", "b"]}) is None and idx.share(None) == {}


def test_the_index_and_the_session_map_stay_bounded():
    idx = PrefixIndex(capacity=10)
    idx.add(0, "y" * (CHUNK * 50))
    assert len(idx._lru[0]) == 10
    s = Sessions(capacity=2)
    s.put("u1", 0)
    s.put("u2", 1)
    s.put("u3", 1)
    assert s.get("u1") is None and s.get("u3") == 1 and s.get(None) is None


def test_the_front_end_sends_a_shared_prefix_and_a_session_to_one_engine():
    import asyncio

    from tests.unit.test_frontend import _stack

    async def go():
        fakes, front, client, runners = await _stack(n=2, dispatch="cache-aware")
        try:
            system = "Answer briefly. " * 40
            for q in ("one", "two", "three"):
                r = await client.post("/v1/completions", json={"model": "m", "prompt": system + q, "max_tokens": 2})
                assert r.status_code == 200
            where = [len(f.requests) for f in fakes]
            assert sorted(where) == [0, 3], where          # every prompt with the long prefix on one engine
            for i in range(4):                              # a session stays on its engine, prompts unlike
                r = await client.post("/v1/completions", json={"model": "m", "prompt": f"q{i}", "max_tokens": 2,
                                                               "user": "alice"})
                assert r.status_code == 200
            alice = [sum(1 for q in f.requests if q.get("user") == "alice") for f in fakes]
            assert sorted(alice) == [0, 4], alice
        finally:
            await client.aclose()
            await front.close()
            for r in runners:
                await r.cleanup()
    asyncio.run(go())
