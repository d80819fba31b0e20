"""PLAS composed with TTL retention (agentrt/policies/autellix.py TTL_SETTINGS) and the TTL choice."""

from __future__ import annotations

import random

import pytest

from agentrt._errors import ConfigError
from agentrt._retention import choose_ttl
from agentrt.engine.request import Request
from agentrt.engine.sampling_params import SamplingParams
from agentrt.policies import PLAS
from agentrt.policies.autellix import TTL_SETTINGS


def _req(rid: str, program: str, now: float, policy: PLAS) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), program_id=program, arrival_time=now)
    policy.on_arrival(r, now)
    return r


def test_victim_newest_preempts_the_latest_started_program_whatever_its_queue():
    old_prog = {"victim": "priority"}, {"victim": "newest"}
    for kwargs, expect in zip(old_prog, ("old", "new")):
        p = PLAS(service="tokens", **kwargs)
        old = _req("old", "a", 0.0, p)
        p.on_step([old], [0.0], [10_000], 1.0)  # a long program: the lowest queue
        new = _req("new", "b", 2.0, p)  # a new program: the top queue
        assert p.level(old) > p.level(new)
        assert p.pick_victim([old, new]).request_id == expect
    with pytest.raises(ConfigError, match="victim"):
        PLAS(victim="oldest")


def test_ttl_settings_are_plas_kwargs():
    p = PLAS(**TTL_SETTINGS)
    assert p.pinned_first and p.protect_pins and not p.preemptive and p.victim == "newest"
    # plain PLAS has the admission control too (a KV-bound engine otherwise thrashes: issue 47), within a horizon
    assert not PLAS().pinned_first and PLAS().protect_pins and PLAS().admit_output_tokens == 256


def _choose_ttl_loop(durations: list[float], gain_s: float) -> float:
    """The definition, one candidate at a time (choose_ttl is its vectorized form)."""
    best, best_value, n = 0.0, 0.0, len(durations)
    for i, tau in enumerate(durations):
        if i + 1 < n and durations[i + 1] == tau:
            continue  # ties: P counts them all at the last one
        value = (i + 1) / n * gain_s - tau
        if value > best_value:
            best, best_value = tau, value
    return best


def test_choose_ttl_equals_the_definition_ties_and_zero_gain_included():
    rng = random.Random(3)
    for _ in range(3000):
        d = sorted(rng.choice([rng.random() * 5, round(rng.random() * 3, 1), 0.0]) for _ in range(rng.randrange(60)))
        gain = rng.choice([0.0, 1.0, rng.random() * 10])
        assert choose_ttl(d, gain) == _choose_ttl_loop(d, gain)
    assert choose_ttl([], 5.0) == 0.0 and choose_ttl([1.0, 1.0, 2.0], 10.0) == 2.0


@pytest.mark.parametrize("name", ["plas+ttl", "atlas+ttl"])
def test_ttl_compositions_are_registered_by_name(name):
    """`--policy plas+ttl` (serve, run) is PLAS with TTL_SETTINGS; given arguments override them."""
    from agentrt.engine.policy import make_policy
    from agentrt.policies import ATLAS, POLICY_NAMES

    cls = PLAS if name == "plas+ttl" else ATLAS
    p = make_policy(name)
    assert type(p) is cls and name in POLICY_NAMES
    assert (p.pinned_first, p.protect_pins, p.preemptive, p.victim) == (True, True, False, "newest")
    q = make_policy(name, protect_pins=False, num_queues=2)
    assert type(q) is cls and q.protect_pins is False and q.pinned_first is True and q.num_queues == 2
    plain = make_policy(name.removesuffix("+ttl"))
    assert (plain.pinned_first, plain.protect_pins, plain.preemptive, plain.displaces_for_seats) == (False, True, False, True)
