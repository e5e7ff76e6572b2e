"""The fault-injection switch itself: SPLITSERVE_INJECT_KV_FAULTS parsed into KVFaults, and the draws it makes."""

from __future__ import annotations

import pytest

from splitserve.prefill_service.faults import KV_FAULTS_ENV, KVFault, KVFaultInjector, KVFaults


def test_the_spec_parses_into_probabilities_and_a_seed():
    faults = KVFaults.parse("corrupt=0.5, foreign=0,fail=0.2,seed=7")
    assert faults == KVFaults(corrupt_probability=0.5, foreign_probability=0.0, fail_probability=0.2, seed=7)
    assert faults.enabled and faults.describe() == "corrupt=0.5, foreign=0, fail=0.2, seed=7"


@pytest.mark.parametrize("spec, message", [
    ("corupt=0.5", "is not one of"), ("fail", "is not one of"), ("fail=often", "not a number"),
    ("corrupt=1.5", "must be in [0, 1]"), ("seed=1.5", "not a number"),
])
def test_a_bad_spec_is_refused_with_a_sentence(spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        KVFaults.parse(spec)


def test_the_environment_turns_it_on_only_with_a_fault_to_inject():
    assert KVFaults.from_environment({}) is None
    assert KVFaults.from_environment({KV_FAULTS_ENV: " "}) is None
    assert KVFaults.from_environment({KV_FAULTS_ENV: "fail=0,seed=3"}) is None
    assert KVFaults.from_environment({KV_FAULTS_ENV: "foreign=1"}) == KVFaults(foreign_probability=1.0)


def test_draws_follow_the_seed_and_the_probabilities():
    faults = KVFaults(corrupt_probability=0.5, fail_probability=0.25, seed=7)
    first, second = KVFaultInjector(faults), KVFaultInjector(faults)
    draws = [first.draw() for _ in range(400)]
    assert draws == [second.draw() for _ in range(400)]
    assert KVFault.FOREIGN_MODEL not in draws
    assert 70 < draws.count(KVFault.FAIL_SEND) < 130  # 1/4 of 400
    assert 120 < draws.count(KVFault.CORRUPT_PAYLOAD) < 180  # 1/2 of the 3/4 left
    assert first.num_injected[KVFault.FAIL_SEND] == draws.count(KVFault.FAIL_SEND)
    always = KVFaultInjector(KVFaults(corrupt_probability=1.0))
    assert {always.draw() for _ in range(20)} == {KVFault.CORRUPT_PAYLOAD}
