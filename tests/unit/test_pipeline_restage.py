"""A regroup keeping the KV, over the real stage links: four pipeline-group members in one process
(stand-in workers over real layer residencies) form two pairs by the usual join, then restage at
once into one group of four. Every (request owner, layer) KV block must end at its new holder with
the bytes it had, whatever the move (kept in place, own KV to a peer, a peer's KV to a third member,
a peer's KV back to its owner, which reloads that layer); a member failing at the restage's first
barrier leaves every member's layers and KV as they were."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from tests.unit.test_residency_groups import BASE, L, PAGE, _residency, _stack
from vllm_kunserve.integration.vllm import pipeline as P
from vllm_kunserve.policy.drop import balanced_stages

pytestmark = pytest.mark.unit

HELD = [1, 2, 5]             # the block ids each member's requests use
NAMES = ["e0", "e1", "e2", "e3"]


def _value(owner: str, layer: int, block: int) -> int:
    return (NAMES.index(owner) * 50 + layer * 7 + block) % 251 + 1


def _member(name: str) -> P.GroupMember:
    res = _residency(_stack())
    for k in res.kv:   # this member's requests' KV: a value naming (owner, layer, block)
        for b in HELD:
            k.region.view(torch.uint8)[b * PAGE:(b + 1) * PAGE].fill_(_value(name, k.layer, b))
    runner = SimpleNamespace(_kunserve_memory=res, _kunserve_kv_view=lambda name, region: region,
                             model=SimpleNamespace(model=SimpleNamespace(layers=res.layers)))
    worker = SimpleNamespace(model_runner=runner, vllm_config=SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={})))
    m = P.GroupMember(worker)
    m.name = name
    return m


def _all(calls):
    """Run ``calls`` (name -> thunk) at once, as the controller asks every member; name -> result or error."""
    out = {}

    def run(n, f):
        try:
            out[n] = f()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[n] = exc
    ts = [threading.Thread(target=run, args=(n, f)) for n, f in calls.items()]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out


def _pairs(members):
    """e0 + e1 and e2 + e3 join by the usual protocol: layers [0, 3) on the first, [3, 6) on the second."""
    halves = {"e0": (0, 3), "e1": (3, 6), "e2": (0, 3), "e3": (3, 6)}
    partner = {"e0": "e1", "e1": "e0", "e2": "e3", "e3": "e2"}

    def body(n):
        lo, hi = halves[n]
        p = partner[n]
        return {"name": n, "drop": [i for i in range(L) if not lo <= i < hi], "spans": [[*halves[p], p]],
                "peers": {p: {"stage": members[p].server.address, "blocks": BASE}}, "held": HELD,
                "timeout_s": 20, "join_id": f"pair-{min(n, p)}"}
    out = _all({n: (lambda n=n: members[n].join(body(n))) for n in NAMES})
    assert not [o for o in out.values() if isinstance(o, Exception)], out
    return halves


def _restage_bodies(members, ranges):
    order = sorted(NAMES, key=lambda n: ranges[n])
    holders = {o: [[*ranges[h], h] for h in order] for o in NAMES}
    return {n: {"spans": [[*ranges[h], h] for h in order if h != n],
                "peers": {h: {"stage": members[h].server.address, "blocks": members[h].res.mapped_blocks}
                          for h in NAMES if h != n},
                "members": {h: members[h].server.address for h in NAMES if h != n}, "holders": holders,
                "held": HELD, "timeout_s": 20, "restage_id": "four"} for n in NAMES}


def _kv_at(m, owner, layer):
    place = m.res.place(f"kv{layer}", "" if owner == m.name else owner)
    return [int(place.region.view(torch.uint8)[b * PAGE]) for b in HELD] + \
        [int(place.region.view(torch.uint8)[(b + 1) * PAGE - 1]) for b in HELD]


@pytest.fixture
def four():
    members = {n: _member(n) for n in NAMES}
    yield members
    for m in members.values():
        m._close()
        m.server.close()


def test_two_pairs_restage_into_four_and_every_kv_block_reaches_its_new_holder(four):
    halves = _pairs(four)
    for n in NAMES:   # after the joins: the pair's layout, the peer's KV where the join put it
        lo, hi = halves[n]
        assert four[n].res.dropped == tuple(i for i in range(L) if not lo <= i < hi)
    quarters = balanced_stages(L, 4)    # pipeline order e0, e2, e1, e3 (as the controller orders them)
    ranges = dict(zip(["e0", "e2", "e1", "e3"], quarters))
    assert ranges["e2"] == (2, 4)       # e2 gives up layers 0-1 and takes layer 3 back: a reload
    bodies = _restage_bodies(four, ranges)
    out = _all({n: (lambda n=n: four[n].restage(bodies[n])) for n in NAMES})
    assert not [o for o in out.values() if isinstance(o, Exception)], out
    for n, m in four.items():
        lo, hi = ranges[n]
        assert m.res.dropped == tuple(i for i in range(L) if not lo <= i < hi), n
        assert m.res.peers == tuple(sorted(h for h in NAMES if h != n)), n
        assert sorted(m.act) == sorted(h for h in NAMES if h != n) and m.spans == [tuple(s) for s in bodies[n]["spans"]]
        assert set(m.views) == {(o, f"kv{i}") for o in NAMES if o != n for i in range(lo, hi)}
        assert m.res.check_invariants() == [] and m.res.mapped_blocks >= BASE
    for owner in NAMES:
        for layer in range(L):
            holder = next(h for h, (lo, hi) in ranges.items() if lo <= layer < hi)
            want = [_value(owner, layer, b) for b in HELD] * 2
            assert _kv_at(four[holder], owner, layer) == want, (owner, layer, holder)
    moved = {n: out[n]["moved_regions"] for n in NAMES}
    assert moved["e2"] > 0 and sum(moved.values()) > 0
    # the layer e2 took back has the weights of the model again (from its host copy)
    ref = _stack()
    assert all(torch.equal(a, b) for a, b in zip(four["e2"].res.layers[3].state_dict().values(),
                                                   ref[3].state_dict().values()))


def test_a_member_failing_at_the_first_barrier_leaves_every_member_as_it_was(four):
    halves = _pairs(four)
    before = {n: (m.res.dropped, m.res.peers, {o: _kv_at(m, o, lo) for o in ("e0", "e1", "e2", "e3")
                                               if o == n or o in m.res.peers for lo in [halves[n][0]]})
              for n, m in four.items()}
    four["e3"].res.faults.arm("restage_barrier")
    ranges = dict(zip(["e0", "e2", "e1", "e3"], balanced_stages(L, 4)))
    bodies = _restage_bodies(four, ranges)
    out = _all({n: (lambda n=n: four[n].restage(bodies[n])) for n in NAMES})
    assert all(isinstance(o, Exception) for o in out.values()), out
    for n, m in four.items():
        assert (m.res.dropped, m.res.peers) == before[n][:2], n
        assert {o: _kv_at(m, o, halves[n][0]) for o in before[n][2]} == before[n][2], n
        assert sorted(m.act) == [p for p in m.res.peers], n     # the links to the other pair are closed
        assert m.res.check_invariants() == [], n


def test_the_four_splits_back_into_two_pairs_keeping_the_kv(four):
    """The same primitive shrinks a group step by step (not yet driven by the controller): the four
    restage into two pairs at once, the KV first shrunk to the pairs' block count, each member
    taking back the layers its pair needs (reloaded from the host copies), every KV block at its
    pair's holder afterwards and the other pair's links closed."""
    _pairs(four)
    ranges = dict(zip(["e0", "e2", "e1", "e3"], balanced_stages(L, 4)))
    fours = _restage_bodies(four, ranges)
    out = _all({n: (lambda n=n: four[n].restage(fours[n])) for n in NAMES})
    assert not [o for o in out.values() if isinstance(o, Exception)], out
    halves = {"e0": (0, 3), "e1": (3, 6), "e2": (0, 3), "e3": (3, 6)}
    pair = {"e0": ("e0", "e1"), "e1": ("e0", "e1"), "e2": ("e2", "e3"), "e3": ("e2", "e3")}
    bodies = {}
    for n in NAMES:
        p = next(h for h in pair[n] if h != n)
        bodies[n] = {"spans": [[*halves[p], p]], "peers": {p: {"stage": four[p].server.address, "blocks": BASE}},
                     "members": {h: four[h].server.address for h in NAMES if h != n},
                     "holders": {o: [[*halves[h], h] for h in pair[o]] for o in NAMES},
                     "held": HELD, "kv_blocks": BASE, "timeout_s": 20, "restage_id": "pairs"}
    out = _all({n: (lambda n=n: four[n].restage(bodies[n])) for n in NAMES})
    assert not [o for o in out.values() if isinstance(o, Exception)], out
    for n, m in four.items():
        lo, hi = halves[n]
        assert m.res.dropped == tuple(i for i in range(L) if not lo <= i < hi), n
        assert m.res.peers == tuple(h for h in pair[n] if h != n) and sorted(m.act) == list(m.res.peers), n
        assert m.res.check_invariants() == [], n
    for owner in NAMES:
        for layer in range(L):
            holder = next(h for h in pair[owner] if halves[h][0] <= layer < halves[h][1])
            assert _kv_at(four[holder], owner, layer) == [_value(owner, layer, b) for b in HELD] * 2, \
                (owner, layer, holder)


def test_a_live_pair_and_two_lone_members_restage_into_four(four):
    """The plan that merges lone instances into a pair and that pair with a live one, in one
    transition: the lone members restage from every layer (a join whose KV goes to whichever member
    holds it), the pair's members keep sub-ranges; every KV block ends at its new holder."""
    halves = {"e0": (0, 3), "e1": (3, 6)}
    bodies = {n: {"name": n, "drop": [i for i in range(L) if not halves[n][0] <= i < halves[n][1]],
                  "spans": [[*halves[p], p]], "peers": {p: {"stage": four[p].server.address, "blocks": BASE}},
                  "held": HELD, "timeout_s": 20, "join_id": "pair"} for n, p in (("e0", "e1"), ("e1", "e0"))}
    out = _all({n: (lambda n=n: four[n].join(bodies[n])) for n in ("e0", "e1")})
    assert not [o for o in out.values() if isinstance(o, Exception)], out
    ranges = dict(zip(["e0", "e2", "e3", "e1"], balanced_stages(L, 4)))
    bodies = _restage_bodies(four, ranges)
    out = _all({n: (lambda n=n: four[n].restage({**bodies[n], "name": n})) for n in NAMES})
    assert not [o for o in out.values() if isinstance(o, Exception)], out
    for n, m in four.items():
        lo, hi = ranges[n]
        assert m.name == n and m.res.dropped == tuple(i for i in range(L) if not lo <= i < hi), n
        assert m.res.peers == tuple(sorted(h for h in NAMES if h != n)) and m.res.check_invariants() == [], n
    for owner in NAMES:
        for layer in range(L):
            holder = next(h for h, (lo, hi) in ranges.items() if lo <= layer < hi)
            assert _kv_at(four[holder], owner, layer) == [_value(owner, layer, b) for b in HELD] * 2, \
                (owner, layer, holder)


def test_a_member_that_left_its_group_before_the_regroup_tells_the_others_at_once(four):
    """e3 abandoned its pair (its abandon clears the words already sent to it) before the regroup
    reached it: it refuses and tells every member, so none waits out the barrier's timeout."""
    import time

    _pairs(four)
    four["e3"].leave({"kv_blocks": BASE, "held": [], "abandon": True})
    ranges = dict(zip(["e0", "e2", "e1", "e3"], balanced_stages(L, 4)))
    bodies = _restage_bodies(four, ranges)
    t0 = time.monotonic()
    out = _all({n: (lambda n=n: four[n].restage({**bodies[n], "name": n, "grouped": True})) for n in NAMES})
    assert time.monotonic() - t0 < 10 < bodies["e0"]["timeout_s"]
    assert all(isinstance(o, Exception) for o in out.values()), out
    assert "left its group" in str(out["e3"]) and four["e3"].res.dropped == ()
    for n in ("e0", "e1", "e2"):
        assert len(four[n].res.dropped) == 3 and four[n].res.check_invariants() == [], n
