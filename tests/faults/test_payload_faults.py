"""Bad KV payloads and failing transfers, injected in the prefill worker's sender (SPLITSERVE_INJECT_KV_FAULTS).

One cluster (a router and one decode worker, KV over p2p); each test starts a prefill worker with its own
faults and stops it afterwards. The decode worker must refuse what does not verify (checksum, model fingerprint)
and recompute the prompt, so every request still gets the right tokens; an abort storm while transfers fail
ends every request as documented; client deadlines expiring mid-transfer free everything.
"""

from __future__ import annotations

import random
import threading
import uuid

import grpc
import pytest

from splitserve.client import Client
from splitserve.common.sampling_params import SamplingParams
from splitserve.prefill_service.faults import KV_FAULTS_ENV
from splitserve.v1 import inference_pb2
from tests.cluster_helpers import wait_until, worker_status
from tests.fault_helpers import Load, Outcome, assert_nothing_lost, assert_settled, cluster_workers
from tests.faults.conftest import MAX_TOKENS, PROMPTS, expected_tokens, start_fault_cluster
from tests.reference import hf_prompt_logprobs

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, ledger):
    # KV for the storm's twelve prompts at once (about 40 blocks each) on the one decode worker. The decode worker
    # waits 60 s for KV, not the suite's 10: the refusal test counts one refused payload per request, and on a Zen 1
    # host under CI the third prompt's KV came after 10 s (its prefill shared the two cores with the decode worker
    # recomputing the first two), so it was recomputed as late before its payload could be refused. A failed send
    # does not wait on this: the prefill worker answers ABORTED and the router has the decode worker prefill.
    cluster = start_fault_cluster("p2p", tmp_path_factory.mktemp("payload-faults"), prefill=0, decode=1, ledger=ledger,
                                  worker_args=["--kv-cache-gb", "0.5"], router_args=["--kv-timeout", "60"])
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def expected(cluster):
    """Undisturbed tokens, prefilled on the decode worker itself (no prefill worker yet)."""
    return expected_tokens(cluster.router.address)


@pytest.fixture
def faulty_prefill(cluster, client, ledger, request):
    """A prefill worker started with ``SPLITSERVE_INJECT_KV_FAULTS`` = the test's parameter; stopped after it."""
    [process] = cluster.start_workers("prefill", 1, env={KV_FAULTS_ENV: request.param})
    ledger.note(cluster)
    wait_until(lambda: len(cluster_workers(client)) == 2, 20, message="the prefill worker registered")
    yield process
    process.stop()
    wait_until(lambda: len(cluster_workers(client)) == 1, 20, message="the prefill worker deregistered")


def decode_counters(cluster):
    decode = next(p for p in cluster.workers if p.name.startswith("decode"))
    return worker_status(decode.address, "decode").counters, decode


@pytest.mark.parametrize(
    "faulty_prefill, refusal",
    [("corrupt=1,seed=1", "Checksum mismatch"), ("foreign=1,seed=2", "model fingerprint")],
    indirect=["faulty_prefill"], ids=["corrupted-payload", "foreign-model-payload"],
)
def test_a_refused_payload_is_recomputed_with_the_right_tokens(cluster, client, expected, faulty_prefill, refusal):
    before, decode = decode_counters(cluster)
    outcomes = Load(cluster.router.address, PROMPTS, [0, 1, 2], MAX_TOKENS, timeout=90).start().join()
    assert_nothing_lost(outcomes, expected, at_least_completed=3)
    after, _ = decode_counters(cluster)
    why = [line[-300:] for line in decode.log().splitlines() if "recomputing the prompt" in line]
    assert after.num_kv_payloads_refused - before.num_kv_payloads_refused >= 3, "\n".join(why[-6:])
    assert after.num_kv_recomputes - before.num_kv_recomputes == 3
    assert after.num_kv_transfers_received == before.num_kv_transfers_received
    assert refusal in decode.log()
    assert "KV fault injection is ON" in faulty_prefill.log()
    assert_settled(cluster, client, num_workers=2)


@pytest.mark.parametrize(
    "faulty_prefill, counter",
    [("corrupt=1,seed=4", "num_kv_recomputes"), ("fail=1,seed=5", "num_local_prefills")],
    indirect=["faulty_prefill"], ids=["payload-refused", "send-failed"],
)
def test_prompt_logprobs_survive_a_failed_transfer(cluster, client, expected, faulty_prefill, counter, model_dir):
    """A refused payload: the decode worker recomputes the prompt, and the prompt's logprobs are the prefill
    worker's. A failed send: the decode worker prefills the prompt itself, and computes them. Either way the client
    gets them with the first token, transformers' values, and the undisturbed tokens."""
    prompt = client.tokenize(PROMPTS[0])
    before, _ = decode_counters(cluster)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt_logprobs=1)
    response = client.generate(prompt, params, timeout=90)
    after, _ = decode_counters(cluster)
    assert getattr(after, counter) - getattr(before, counter) == 1
    assert list(response.token_ids) == expected[0]
    reference = hf_prompt_logprobs(str(model_dir), tuple(prompt))
    assert [entry.sampled.token_id for entry in response.prompt_logprobs] == prompt
    assert [entry.sampled.logprob for entry in response.prompt_logprobs[1:]] == pytest.approx(
        [reference[position - 1, prompt[position]].item() for position in range(1, len(prompt))], abs=2e-4)
    assert_settled(cluster, client, num_workers=2)


@pytest.mark.parametrize("faulty_prefill", ["fail=0.5,corrupt=0.2,seed=3"], indirect=True)
def test_abort_storm_while_transfers_fail(cluster, client, expected, faulty_prefill):
    """Twelve requests; four aborted by id and four cancelled by their client at random moments, while half the
    sends fail and a fifth arrive corrupted. Every one ends right or as documented; everything is freed."""
    rng = random.Random(11)
    plans = ["abort"] * 4 + ["cancel"] * 4 + ["run"] * 4
    rng.shuffle(plans)
    delays = [rng.uniform(0.05, 4.0) for _ in plans]
    outcomes: list[Outcome] = []
    timers: list[threading.Timer] = []
    lock = threading.Lock()

    def run(number: int, plan: str) -> None:
        index = number % len(PROMPTS)
        request_id = f"storm-{number}-{uuid.uuid4().hex[:8]}"
        outcome = Outcome(f"{plan} {number} (prompt {index})", index, request_id)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        with Client(cluster.router.address) as own:
            call = own.generate_stream(PROMPTS[index], params, request_id=request_id, timeout=90)
            timer = None
            if plan == "abort":
                outcome.aborted_by_test = True
                timer = threading.Timer(delays[number], lambda: own.abort(request_id))
            elif plan == "cancel":
                outcome.cancelled_by_client = True
                timer = threading.Timer(delays[number], call.cancel)
            if timer is not None:
                timers.append(timer)
                timer.start()
            try:
                for chunk in call:
                    outcome.token_ids.extend(chunk.token_ids)
                    if chunk.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED:
                        outcome.finish_reason, outcome.error_message = chunk.finish_reason, chunk.error_message
            except grpc.RpcError as error:
                outcome.status, outcome.details = error.code(), error.details() or ""
            outcome.ended = True
            if timer is not None:  # before the channel closes: an abort already under way finishes first
                timer.cancel()
                timer.join()
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=run, args=(number, plan), daemon=True) for number, plan in enumerate(plans)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for timer in timers:
        timer.cancel()
    assert not any(thread.is_alive() for thread in threads), "requests of the storm still running"
    assert len(outcomes) == len(plans)
    assert_nothing_lost(outcomes, expected, allow=frozenset({"abort"}))
    # The requests left alone complete, failed transfers or not.
    assert_nothing_lost([o for o in outcomes if o.label.startswith("run")], expected, at_least_completed=4)
    assert "Injecting KV fault 'fail'" in faulty_prefill.log()
    assert_settled(cluster, client, num_workers=2)


@pytest.mark.parametrize("faulty_prefill", ["fail=0.3,seed=4"], indirect=True)
def test_client_deadlines_expiring_mid_transfer(cluster, client, expected, faulty_prefill):
    """Deadlines from half a second to a few seconds: each request completes right or ends DEADLINE_EXCEEDED,
    and every block is freed on both workers."""
    loads = [Load(cluster.router.address, PROMPTS, [index % len(PROMPTS)], MAX_TOKENS, timeout=0.5 + index * 0.7,
                  label=f"deadline {0.5 + index * 0.7:.1f} s").start() for index in range(6)]
    outcomes = [outcome for load in loads for outcome in load.join()]
    tally = assert_nothing_lost(outcomes, expected)
    assert tally.documented.get("DEADLINE_EXCEEDED", 0) >= 1
    assert_settled(cluster, client, num_workers=2)


def test_nothing_of_the_cluster_is_left_after_stop(cluster, ledger):
    ledger.note(cluster)
    cluster.stop()
    ledger.assert_none_left()
