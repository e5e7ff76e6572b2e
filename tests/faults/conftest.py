"""Shared pieces of the fault-injection suite: its prompts, its clusters, the expected tokens of each prompt.

Workers run without prefix caching, so every request ships its whole prompt's KV (a repeat of a prompt would
otherwise find its blocks cached on the decode worker and send almost nothing, leaving no transfer to break),
and the same prompt always gives the same greedy tokens: they are computed once, undisturbed, on the first
cluster that needs them (``expected_tokens``).
"""

from __future__ import annotations

import pytest

from tests.cluster_helpers import start_cluster
from tests.fault_helpers import Load, ProcessLedger

# Workers of the fault suite: no prefix cache (see above); the router has a decode worker recompute a prompt
# whose KV has not arrived in 10 s.
FAULT_WORKER_ARGS = ["--no-prefix-caching"]
FAULT_ROUTER_ARGS = ["--kv-timeout", "10"]
MAX_TOKENS = 16

_ANIMALS = ["fox", "owl", "whale", "tiger", "heron", "otter", "lynx", "crane", "bison", "gecko"]
_PLACES = ["river", "forest", "desert", "harbor", "valley", "glacier", "meadow", "canyon"]


def _journal(number: int, num_days: int) -> str:
    """A prompt of about 30 tokens a day, different from the others from its first tokens on."""
    lines = [f"Journal number {number} of a naturalist who counts {_ANIMALS[number % 10]}s.\n"]
    for day in range(num_days):
        animal = _ANIMALS[(day + number) % len(_ANIMALS)]
        place = _PLACES[(day * 3 + number) % len(_PLACES)]
        lines.append(f"Day {day + 1}: near the {place} I watched a {animal} for {(day + number) % 7 + 2} hours; "
                     f"it ate {(day * number) % 5 + 1} times.")
    lines.append("\nWhat I learned, in one sentence:")
    return "\n".join(lines)


# Long enough that prefill goes remote in two chunks (512-token steps) and the transfer takes a while.
PROMPTS = [_journal(number, 24) for number in range(4)]


def start_fault_cluster(kv_transfer: str, log_dir, prefill: int, decode: int, ledger: ProcessLedger,
                        router_args=(), worker_args=()):
    cluster = start_cluster(kv_transfer, log_dir, prefill=prefill, decode=decode,
                            worker_args=[*FAULT_WORKER_ARGS, *worker_args],
                            router_args=[*FAULT_ROUTER_ARGS, *router_args])
    ledger.note(cluster)
    return cluster


_UNDISTURBED: dict[int, list[int]] = {}


def expected_tokens(address: str) -> dict[int, list[int]]:
    """Each prompt's greedy tokens from an undisturbed run (the requests run together): on the first fault
    cluster that asks, then kept for the session. Every cluster of this suite serves the model in float32, whose
    greedy tokens are the same over every KV connector (each is token-identical to transformers, tests/e2e), so
    later clusters are held to the first's tokens: a run of the four prompts less per module (15-20 s on a Zen 3)."""
    if not _UNDISTURBED:
        outcomes = Load(address, PROMPTS, list(range(len(PROMPTS))), MAX_TOKENS, timeout=180,
                        label="undisturbed").start().join()
        for outcome in outcomes:
            assert outcome.completed and len(outcome.token_ids) == MAX_TOKENS, outcome.describe()
        _UNDISTURBED.update((outcome.prompt_index, outcome.token_ids) for outcome in outcomes)
    return dict(_UNDISTURBED)


@pytest.fixture(scope="module")
def ledger():
    """Every process this module's clusters started; none may be left once they stopped."""
    ledger = ProcessLedger()
    yield ledger
    ledger.assert_none_left()
