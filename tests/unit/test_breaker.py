"""The front end's circuit breaker per engine (cluster/frontend/breaker.py)."""

import pytest

from vllm_kunserve.cluster.frontend.breaker import Breakers

pytestmark = pytest.mark.unit


def test_open_after_failures_in_a_row_then_half_open_then_closed():
    now = [0.0]
    seen = []
    b = Breakers(threshold=3, cooldown_s=2.0, max_cooldown_s=5.0, clock=lambda: now[0],
                 on_change=lambda i, kind, info: seen.append((i, kind, info.get("cooldown_s"))))
    b.failure(1, "refused")
    b.failure(1, "refused")
    assert not b.is_open(1)
    b.success(1)                       # a success in between: the count starts again
    for _ in range(3):
        b.failure(1, "refused")
    assert b.is_open(1) and not b.is_open(0) and seen == [(1, "circuit_open", 2.0)]
    assert b.state(1) == "open" and b.view()["1"]["state"] == "open"
    now[0] = 2.5                       # cooled down: half open, the next request may go there
    assert b.state(1) == "half_open" and len(seen) == 1   # not reported before dispatch looks
    assert not b.is_open(1) and seen[-1] == (1, "circuit_half_open", 2.0)
    assert not b.is_open(1) and len(seen) == 2             # reported once per cool-down
    b.failure(1, "still broken")       # the probe failed: open again, for twice as long
    assert b.is_open(1) and seen[-1] == (1, "circuit_open", 4.0) and b.state(1) == "open"
    now[0] = 7.0
    b.failure(1)                       # capped at max_cooldown_s
    assert seen[-1] == (1, "circuit_open", 5.0)
    now[0] = 20.0
    assert not b.is_open(1) and seen[-1] == (1, "circuit_half_open", 5.0)
    b.success(1)
    assert not b.is_open(1) and seen[-1] == (1, "circuit_closed", None) and b.view() == {}
    assert b.state(1) == "closed"


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        Breakers(threshold=0)
    with pytest.raises(ValueError):
        Breakers(cooldown_s=5, max_cooldown_s=1)
