"""Dispatch over immutable instance loads (``policy.dispatch``)."""

import pytest

from vllm_kunserve.policy.dispatch import InstanceLoad, choose_instance

pytestmark = pytest.mark.unit


def units():
    return [
        # a pipeline group: more memory, but a deep prefill queue (2000 tokens over 2 GPUs)
        InstanceLoad(0, used_blocks=0, queued_blocks=130, capacity_blocks=300, queued_prefill_tokens=2000,
                     requests=5, k=2),
        InstanceLoad(1, used_blocks=60, queued_blocks=0, capacity_blocks=100, requests=3),  # idle compute
        InstanceLoad(2, used_blocks=95, queued_blocks=0, capacity_blocks=100, requests=1),  # prompt does not fit
    ]


def test_least_load_is_the_lowest_demand_share():
    assert choose_instance(units(), "least-load", prompt_blocks=13) == 0  # 130/300 < 60/100


def test_least_work_prefers_idle_compute_where_the_prompt_fits():
    assert choose_instance(units(), "least-work", prompt_blocks=13) == 1
    # nothing fits: the least demand share
    assert choose_instance(units(), "least-work", prompt_blocks=500) == 0


def test_least_work_divides_the_queue_by_the_pipeline_width():
    a = InstanceLoad(0, 0, 0, 100, queued_prefill_tokens=300, k=4)
    b = InstanceLoad(1, 0, 0, 100, queued_prefill_tokens=100)
    assert choose_instance([a, b], "least-work") == 0  # 75 tokens per GPU < 100


def test_ties_break_on_requests_then_id():
    a, b = InstanceLoad(7, 10, 0, 100, requests=4), InstanceLoad(3, 10, 0, 100, requests=2)
    assert choose_instance([a, b], "least-load") == 3
    assert choose_instance([a, InstanceLoad(3, 10, 0, 100, requests=4)], "least-load") == 3


def test_round_robin_cycles_over_accepting_instances():
    us = [InstanceLoad(i, 0, 0, 10, alive=i != 1) for i in range(3)]
    assert [choose_instance(us, "round-robin", turn=t) for t in range(4)] == [0, 2, 0, 2]


def test_dead_instances_are_skipped_unless_all_are_dead():
    us = units()
    dead = [InstanceLoad(u.instance_id, u.used_blocks, u.queued_blocks, u.capacity_blocks, alive=u.instance_id != 1)
            for u in us]
    assert choose_instance(dead, "least-work", prompt_blocks=13) != 1
    none = [InstanceLoad(i, i, 0, 10, alive=False) for i in range(2)]
    assert choose_instance(none, "least-load") == 0


def test_bad_mode_and_empty_cluster():
    with pytest.raises(ValueError, match="dispatch 'fastest'"):
        choose_instance(units(), "fastest")
    with pytest.raises(ValueError, match="no instance"):
        choose_instance([], "least-load")


# ---- mell: MELL's placement on a fixed cluster (every instance an open bin: spread by KV headroom)

def test_mell_is_least_load_on_identical_instances():
    import random

    rnd = random.Random(7)
    for _ in range(200):
        us = [InstanceLoad(i, rnd.randint(0, 90), rnd.randint(0, 30), 100, requests=rnd.randint(0, 9),
                           alive=rnd.random() > 0.1) for i in range(rnd.randint(1, 8))]
        b = rnd.randint(0, 20)
        fits = [u for u in us if u.alive and u.fits(b)]
        if fits and any(u.alive for u in us):
            # the prompt fits somewhere: the same unit as least-load, which then fits too
            assert choose_instance(us, "mell", prompt_blocks=b) == choose_instance(us, "least-load", prompt_blocks=b)


def test_mell_never_packs_and_prefers_a_unit_the_prompt_fits():
    # packing (best fit) would take the fullest unit that fits; on a fixed cluster MELL spreads
    us = [InstanceLoad(0, 70, 0, 100), InstanceLoad(1, 10, 0, 100), InstanceLoad(2, 40, 0, 100)]
    assert choose_instance(us, "mell", prompt_blocks=5) == 1
    # heterogeneous units: least-load takes the lowest share even where the prompt does not fit
    big = InstanceLoad(0, 25, 0, 100)  # share 0.25, but 80 blocks do not fit
    group = InstanceLoad(1, 120, 0, 400, k=2)  # share 0.30, 280 blocks free
    assert choose_instance([big, group], "least-load", prompt_blocks=80) == 0
    assert choose_instance([big, group], "mell", prompt_blocks=80) == 1
    # the share after placement decides between units that both take it
    a, b = InstanceLoad(0, 20, 0, 100), InstanceLoad(1, 45, 0, 200)
    assert choose_instance([a, b], "mell", prompt_blocks=40) == 1  # 0.425 < 0.60
    # nothing fits: the lowest demand share, dead units skipped
    full = [InstanceLoad(0, 99, 0, 100), InstanceLoad(1, 90, 0, 100), InstanceLoad(2, 0, 0, 100, alive=False)]
    assert choose_instance(full, "mell", prompt_blocks=50) == 1


def test_mell_is_a_dispatch_mode():
    from vllm_kunserve.policy.dispatch import DISPATCH, check_mode

    assert "mell" in DISPATCH and check_mode("mell") == "mell"


def test_least_work_orders_by_requests_before_kv():
    # the unit with less KV has more requests (young ones, their KV still to come): the smaller batch
    young = InstanceLoad(0, used_blocks=40, queued_blocks=0, capacity_blocks=400, requests=14)
    old = InstanceLoad(1, used_blocks=60, queued_blocks=0, capacity_blocks=400, requests=9)
    assert choose_instance([young, old], "least-work", prompt_blocks=2) == 1
    # members of a pipeline group: the same rule (a group's cycle is twice its larger microbatch)
    grouped = [InstanceLoad(u.instance_id, u.used_blocks, 0, 400, requests=u.requests, group=5) for u in (young, old)]
    assert choose_instance(grouped, "least-work", prompt_blocks=2) == 1
    # equal requests: the lesser KV demand
    even = [InstanceLoad(u.instance_id, u.used_blocks, 0, 400, requests=9) for u in (young, old)]
    assert choose_instance(even, "least-work", prompt_blocks=2) == 0
    # queued prefill still comes first
    busy = InstanceLoad(1, 60, 0, 400, queued_prefill_tokens=64, requests=9)
    assert choose_instance([young, busy], "least-work", prompt_blocks=2) == 0
    # a unit the prompt does not fit is not taken, however few its requests
    full = InstanceLoad(1, 399, 0, 400, requests=2)
    assert choose_instance([young, full], "least-work", prompt_blocks=2) == 0


def test_least_work_counts_requests_per_instance_of_compute():
    # a pipeline group of 4 with 20 requests runs 5 per GPU: fewer than a lone engine's 8
    group = InstanceLoad(0, 100, 0, 1000, requests=20, k=4)
    lone = InstanceLoad(1, 10, 0, 100, requests=8)
    assert choose_instance([group, lone], "least-work") == 0
    # the lone engine with the least queued prefill wins over an idle-but-prefilling group
    busy = InstanceLoad(0, 10, 0, 400, queued_prefill_tokens=512, requests=1, k=2)
    assert choose_instance([busy, lone], "least-work") == 1


def test_every_registered_name_resolves_to_its_policy():
    from vllm_kunserve.policy.dispatch import DEFAULT_DISPATCH, DISPATCH, POLICIES, DispatchPolicy, get_policy

    assert DISPATCH == ("least-work", "least-load", "round-robin", "mell", "cache-aware") and DEFAULT_DISPATCH in DISPATCH
    for name in DISPATCH:
        p = get_policy(name)
        assert isinstance(p, DispatchPolicy) and p.name == name and POLICIES[name] is p
        assert p.choose(units(), 13, 0) == choose_instance(units(), name, prompt_blocks=13)
    # only MELL acts every monitor period (the front end's migration planner); the others plan no moves
    assert [n for n in DISPATCH if get_policy(n).periodic] == ["mell"]
    assert [n for n in DISPATCH if get_policy(n).uses_prefix] == ["cache-aware"]
    assert get_policy("least-work").on_period(units(), [], None) == ()


def test_every_dispatch_help_lists_exactly_the_registrys_policies():
    """``kunserve serve``, ``simulate`` and ``compare``'s ``--dispatch`` help texts name every policy of
    the registry, in its order, each with its summary, and nothing else (``registry.describe``): a
    policy registered is listed without editing any help text."""
    import argparse
    import re

    from vllm_kunserve.cli.main import build_parser
    from vllm_kunserve.cli.serve import _options
    from vllm_kunserve.policy.dispatch import DEFAULT_DISPATCH, DISPATCH, POLICIES, describe

    def dispatch(parser: argparse.ArgumentParser) -> argparse.Action:
        return next(a for a in parser._actions if "--dispatch" in a.option_strings)

    def command(name: str) -> argparse.ArgumentParser:
        subs = next(a for a in build_parser([name])._actions if isinstance(a, argparse._SubParsersAction))
        return subs.choices[name]

    actions = {"serve": dispatch(_options()), "simulate": dispatch(command("simulate")),
               "compare": dispatch(command("compare"))}
    for name, action in actions.items():
        listed = re.findall(r"(?:: |\| )([a-z][a-z-]*) \(", action.help)
        assert listed == list(DISPATCH), name
        for policy in POLICIES.values():
            assert policy.summary and policy.summary in action.help, (name, policy.name)
    assert actions["serve"].choices == DISPATCH and actions["serve"].default == DEFAULT_DISPATCH
    assert actions["simulate"].default == DEFAULT_DISPATCH
    assert f"{DEFAULT_DISPATCH} (default; " in describe() and "(default; " not in describe(None)


@pytest.mark.parametrize("bad", ["fastest", "", "LEAST-WORK", None, 3, ["mell"], {"mode": "mell"}])
def test_an_unknown_name_is_a_value_error_listing_the_names(bad):
    from vllm_kunserve.policy.dispatch import check_mode, get_policy

    for call in (lambda: get_policy(bad), lambda: check_mode(bad), lambda: choose_instance(units(), bad)):
        with pytest.raises(ValueError, match="one of least-work, least-load, round-robin, mell") as e:
            call()
        assert repr(bad) in str(e.value)


def test_mell_on_period_is_the_bounded_migration_planner():
    from vllm_kunserve.config import PlacementConfig
    from vllm_kunserve.policy.dispatch import get_policy
    from vllm_kunserve.policy.migration import RequestLoad, plan_migrations

    over = [InstanceLoad(0, 95, 0, 100, requests=2), InstanceLoad(1, 10, 0, 100, requests=1)]
    reqs = [RequestLoad("a", 0, 40, 640, 10), RequestLoad("b", 0, 55, 880, 10)]
    cfg = PlacementConfig()
    got = get_policy("mell").on_period(over, reqs, cfg, kv_bytes_per_block=1 << 16, link_bytes_per_s=1e9)
    assert got and got == plan_migrations(over, reqs, cfg, kv_bytes_per_block=1 << 16, link_bytes_per_s=1e9)
