"""LoRA adapters through a whole disaggregated cluster (``--lora-modules``): prefill and decode workers load them at
start and register their names, the router lists them (GetModelInfo) and routes requests naming one
(GenerateRequest.lora_name) to workers that serve it, and greedy output is PEFT's token for token, prompts prefilled
remotely (their KV over p2p) and locally; the OpenAI gateway takes an adapter as its ``model``. Unknown and malformed
names are refused with NOT_FOUND and INVALID_ARGUMENT (404 and 400 over HTTP), and nothing is left behind. An adapter
put in the workers' --lora-dir while they run is served within seconds, and one taken out is served no more."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import grpc
import openai
import pytest

from splitserve.client import Client
from splitserve.common.sampling_params import SamplingParams
from tests.cluster_helpers import all_blocks_free, running_gateway, start_cluster, wait_until
from tests.e2e.test_metrics import metrics_url, scrape, value
from tests.lora_helpers import LORA_MAX_TOKENS

pytestmark = pytest.mark.timeout(900)

GREEDY = SamplingParams(max_tokens=LORA_MAX_TOKENS, temperature=0.0)
LOCAL_PREFILL_THRESHOLD = 8  # shorter prompts prefill on the decode worker, longer ones on the prefill worker


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """The workers' --lora-dir: empty at start."""
    return tmp_path_factory.mktemp("lora-dir")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, lora_adapters, lora_dir):
    modules = [f"{name}={adapter.lora_path}" for name, adapter in lora_adapters.items()]
    cluster = start_cluster("p2p", tmp_path_factory.mktemp("lora-logs"),
                            router_args=["--local-prefill-threshold", str(LOCAL_PREFILL_THRESHOLD)],
                            worker_args=["--max-loras", "2", "--metrics-port", "0", "--lora-modules", *modules,
                                         "--lora-dir", str(lora_dir)])
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.router.address) as client:
        yield client


def test_the_router_lists_the_adapters_its_workers_serve(client):
    assert list(client.model_info().lora_names) == ["attention", "every"]


def test_adapters_through_the_cluster_are_peft_token_for_token(client, prompt_token_ids, lora_references):
    """Both adapters and the base model, prompts below and above the local prefill threshold (KV over p2p)."""
    lengths = [len(ids) for ids in prompt_token_ids[:6]]
    assert min(lengths) < LOCAL_PREFILL_THRESHOLD < max(lengths)
    for name in ("every", "attention", None):
        for index, ids in enumerate(prompt_token_ids[:6]):
            chunks = list(client.generate_stream(ids, GREEDY, lora_name=name or "", timeout=300))
            assert [token for chunk in chunks for token in chunk.token_ids] == lora_references[name][index], \
                (name, index)
            assert chunks[-1].usage.completion_tokens == len(lora_references[name][index])
    wait_until(lambda: all_blocks_free(client), timeout=30, message="every block free")


def test_the_command_line_sends_an_adapters_name(cluster, tmp_path, prompt_token_ids, lora_references):
    out = tmp_path / "out.jsonl"
    subprocess.run([sys.executable, "-m", "splitserve.cli", "generate", "--server", cluster.router.address, "--lora",
                    "attention", "--max-tokens", str(LORA_MAX_TOKENS), "--output", str(out), "Once upon a time, in a "
                    "land far away,"], check=True, capture_output=True, timeout=120)
    assert json.loads(out.read_text())["token_ids"] == lora_references["attention"][3]


def test_embeddings_with_an_adapter_are_pefts(client, model_dir, prompt_token_ids, lora_adapters):
    """The router's Embed with lora_name: PEFT's final hidden state of the prompt's last token with that adapter,
    normalized (1e-4), on a worker serving it; the base model's differs from it."""
    import torch

    from tests.lora_helpers import peft_last_hidden_state

    ids = prompt_token_ids[5]
    for name in ("every", "attention"):
        expected = torch.nn.functional.normalize(
            peft_last_hidden_state(str(model_dir), lora_adapters[name].lora_path, ids), dim=-1)
        vector = torch.tensor(client.embed(ids, lora_name=name))
        assert torch.allclose(vector, expected, atol=1e-4), (vector - expected).abs().max()
        assert not torch.allclose(torch.tensor(client.embed(ids)), expected, atol=1e-3)


def test_an_adapter_no_worker_serves_is_not_found_and_a_bad_name_invalid(client):
    with pytest.raises(grpc.RpcError) as error:
        client.generate("Hi", lora_name="nowhere")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND and "No worker serves LoRA adapter 'nowhere'" in \
        error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        client.generate("Hi", lora_name="../../etc/passwd")
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[A-Za-z0-9._-]" in error.value.details()
    assert client.generate("Hi").usage.completion_tokens > 0  # the cluster serves on
    wait_until(lambda: all_blocks_free(client), timeout=30, message="every block free")


def test_the_gateway_takes_an_adapter_as_its_model(cluster, tmp_path, client, prompt_token_ids, lora_references,
                                                   tokenizer):
    with running_gateway(cluster.router.address, tmp_path / "gateway.log") as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        models = {model.id: model for model in api.models.list().data}
        base = client.model_info().model_name
        assert list(models) == [base, "attention", "every"]
        assert models["every"].parent == base and models[base].parent is None
        completion = api.completions.create(model="every", prompt=prompt_token_ids[1], max_tokens=LORA_MAX_TOKENS,
                                            temperature=0)
        assert completion.model == "every"
        assert completion.choices[0].text == tokenizer.decode(lora_references["every"][1])
        with pytest.raises(openai.NotFoundError, match="'nowhere' does not exist here.*LoRA adapters attention, every"):
            api.completions.create(model="nowhere", prompt="Hi", max_tokens=2)
    wait_until(lambda: all_blocks_free(client), timeout=30, message="every block free")


def test_the_decode_workers_metrics_count_each_adapters_requests(cluster, client):
    decode = next(worker for worker in cluster.workers if worker.name.startswith("decode"))
    url = metrics_url(decode)

    def running(name: str) -> float:
        return value(scrape(url), "splitserve_worker_lora_requests_running", role="decode", lora_name=name)

    stream = client.generate_stream("Hi", SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                                    lora_name="every", timeout=300)
    next(stream)  # running now
    wait_until(lambda: running("every") == 1, timeout=30, message="one 'every' request running")
    assert running("attention") == 0
    stream.cancel()
    wait_until(lambda: running("every") == 0, timeout=30, message="no 'every' request running")
    wait_until(lambda: all_blocks_free(client), timeout=30, message="every block free")


def test_an_adapter_put_in_the_lora_dir_is_served_by_its_name_and_one_taken_out_is_not(
        cluster, client, lora_dir, tmp_path, prompt_token_ids, lora_references, lora_adapters):
    """The 'attention' adapter's files copied in under a hidden name, then renamed "late": every worker checks it and
    heartbeats its name, the router lists it, and it gives PEFT's tokens prefilled remotely (KV over p2p, once the
    prefill worker serves it) and locally. Taken out, it is refused with NOT_FOUND; the base model serves on."""
    prefill = next(worker for worker in cluster.workers if worker.name.startswith("prefill"))

    url = metrics_url(prefill)

    def prefill_serves(name: str) -> bool:  # its metrics have a gauge per adapter it serves
        return ("splitserve_worker_lora_requests_running", (("lora_name", name), ("role", "prefill"))) in scrape(url)

    shutil.copytree(lora_adapters["attention"].lora_path, lora_dir / ".copying")
    (lora_dir / ".copying").rename(lora_dir / "late")
    wait_until(lambda: "late" in client.model_info().lora_names, timeout=30, message="the router lists 'late'")
    wait_until(lambda: prefill_serves("late"), timeout=30, message="the prefill worker serves 'late'")
    assert list(client.model_info().lora_names) == ["attention", "every", "late"]
    lengths = [len(ids) for ids in prompt_token_ids[:6]]
    for index in (lengths.index(min(lengths)), lengths.index(max(lengths))):  # prefilled locally, then remotely
        chunks = list(client.generate_stream(prompt_token_ids[index], GREEDY, lora_name="late", timeout=300))
        assert [token for chunk in chunks for token in chunk.token_ids] == lora_references["attention"][index], index

    shutil.rmtree(lora_dir / "late")
    wait_until(lambda: "late" not in client.model_info().lora_names, timeout=30, message="'late' listed no more")
    with pytest.raises(grpc.RpcError) as error:
        client.generate("Hi", lora_name="late")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    wait_until(lambda: not prefill_serves("late"), timeout=30, message="the prefill worker lets 'late' go")
    assert client.generate("Hi").usage.completion_tokens > 0
    wait_until(lambda: all_blocks_free(client), timeout=30, message="every block free")


def test_a_router_polling_static_workers_routes_their_adapters(cluster, lora_dir, lora_adapters, prompt_token_ids,
                                                               lora_references, tmp_path):
    """A second router given the same workers on its command line (static: polled, never registered) learns
    their adapters from GetStatus, those of --lora-dir too, and routes requests naming them."""
    from splitserve.launcher import LocalCluster
    from tests.cluster_helpers import ROUTER_ARGS

    prefill = next(worker for worker in cluster.workers if worker.name.startswith("prefill"))
    decode = next(worker for worker in cluster.workers if worker.name.startswith("decode"))
    static = LocalCluster(router_args=[*ROUTER_ARGS, "--prefill-worker", prefill.address, "--decode-worker",
                                       decode.address], log_dir=tmp_path / "static")
    try:
        static.start_router()
        with Client(static.router.address) as via_static:
            wait_until(lambda: list(via_static.model_info().lora_names) == ["attention", "every"], 20,
                       message="the static workers' adapters polled")
            ids = prompt_token_ids[5]
            chunks = list(via_static.generate_stream(ids, GREEDY, lora_name="every", timeout=300))
            assert [token for chunk in chunks for token in chunk.token_ids] == lora_references["every"][5]
            shutil.copytree(lora_adapters["attention"].lora_path, lora_dir / ".copying")
            (lora_dir / ".copying").rename(lora_dir / "polled")
            wait_until(lambda: "polled" in via_static.model_info().lora_names, 30, message="'polled' listed")
            chunks = list(via_static.generate_stream(ids, GREEDY, lora_name="polled", timeout=300))
            assert [token for chunk in chunks for token in chunk.token_ids] == lora_references["attention"][5]
            shutil.rmtree(lora_dir / "polled")
            wait_until(lambda: "polled" not in via_static.model_info().lora_names, 30, message="'polled' gone")
    finally:
        static.stop()
