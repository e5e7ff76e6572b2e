"""The OpenAI-compatible gateway, called with the official ``openai`` package, in front of a real cluster.

The cluster requires an API key (the gateway passes the caller's on); greedy outputs through the gateway are
compared with the same requests through the gRPC client, and a client that disconnects mid-stream must leave
no block in use.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.client import Client
from splitserve.common.sampling_params import SamplingParams
from tests.cluster_helpers import all_blocks_free, running_gateway, wait_until
from tests.e2e.conftest import TOOLS_TEMPLATE
from tests.e2e.test_metrics import scrape, value

pytestmark = pytest.mark.timeout(600)

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    """The e2e tier's shared cluster (tests/e2e/conftest.py): it requires an API key and its router renders chats
    through the ChatML template with tools."""
    return shared_cluster


@pytest.fixture(scope="module")
def gateway_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gateway") / "gateway.log"


@pytest.fixture(scope="module")
def gateway(cluster, gateway_log):
    """The gateway's base URL (its metrics on a port of their own); the process is stopped (SIGTERM) after the
    module."""
    with running_gateway(cluster.router.address, gateway_log, "--max-body-bytes", "100000", "--metrics-port", "0",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as url:
        yield url


@pytest.fixture(scope="module")
def api(gateway, cluster):
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=cluster.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with Client(cluster.router.address, api_key=cluster.api_key) as client:
        yield client


def test_models_lists_the_router_model(api, grpc_client):
    [model] = api.models.list().data
    assert model.id == grpc_client.model_info().model_name and model.owned_by == "splitserve"
    assert api.models.retrieve(model.id) == model  # OpenAI's GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError) as caught:
        api.models.retrieve("org/no-such-model")  # a name with a "/", as Hugging Face's
    assert caught.value.code == "model_not_found" and "'org/no-such-model' does not exist" in caught.value.message


def test_completion_is_the_grpc_paths_greedy_output(api, grpc_client):
    model = api.models.list().data[0].id
    expected = grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))
    completion = api.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    [choice] = completion.choices
    assert choice.text == expected.text and choice.finish_reason == "length"
    assert completion.usage.prompt_tokens == expected.usage.prompt_tokens
    assert completion.usage.completion_tokens == len(expected.token_ids) == 24
    # Streamed, with the usage asked for: the same text in pieces, then the usage in a chunk of its own.
    stream = api.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    # Token ids as a prompt, and logprobs: the sampled tokens' texts make up the text.
    token_ids = grpc_client.tokenize(PROMPT)
    with_logprobs = api.completions.create(model=model, prompt=token_ids, max_tokens=5, temperature=0, logprobs=2)
    logprobs = with_logprobs.choices[0].logprobs
    assert "".join(logprobs.tokens) == with_logprobs.choices[0].text == expected.text[:len(with_logprobs.choices[0].text)]
    assert all(len(top) <= 3 for top in logprobs.top_logprobs) and all(lp <= 0 for lp in logprobs.token_logprobs)


def test_echo_scores_the_prompt_as_lm_evaluation_harness_asks(api, grpc_client):
    """echo with logprobs (what lm-evaluation-harness's loglikelihood sends: token ids, max_tokens 1, logprobs 1):
    the prompt's tokens come first, the first unscored, the rest with the gRPC path's prompt logprobs."""
    model = api.models.list().data[0].id
    ids = grpc_client.tokenize(PROMPT + " Paris, and that of Spain is Madrid.")
    expected = grpc_client.generate(ids, SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1),
                                    echo=True)
    [choice] = api.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                      echo=True).choices
    assert choice.text == expected.prompt_text + expected.text and expected.prompt_text.startswith(PROMPT)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(
        [entry.sampled.logprob for entry in [*expected.prompt_logprobs[1:], *expected.logprobs]], abs=1e-6)
    assert all(len(top) in (1, 2) for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset[0] == 0 and all(
        later - earlier == len(token)
        for earlier, later, token in zip(logprobs.text_offset, logprobs.text_offset[1:], logprobs.tokens))
    # Streamed: the same text and logprobs in pieces, the prompt's with the first token.
    chunks = [chunk.choices[0] for chunk in api.completions.create(
        model=model, prompt=ids, max_tokens=3, temperature=0, logprobs=1, echo=True, stream=True)]
    assert chunks[0].text.startswith(expected.prompt_text + expected.text)
    streamed = [value for chunk in chunks if chunk.logprobs for value in chunk.logprobs.token_logprobs]
    assert streamed[:len(ids) + 1] == logprobs.token_logprobs
    offsets = [value for chunk in chunks if chunk.logprobs for value in chunk.logprobs.text_offset]
    assert offsets == sorted(offsets) and len(offsets) == len(ids) + 3
    # max_tokens 0: the prompt alone, scored, nothing generated.
    scored = api.completions.create(model=model, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    [only] = scored.choices
    assert only.text == PROMPT and only.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(only.logprobs.tokens) == scored.usage.prompt_tokens == len(grpc_client.tokenize(PROMPT))
    # Without logprobs, echo is the text alone.
    [plain] = api.completions.create(model=model, prompt=[PROMPT, ids], max_tokens=2, temperature=0,
                                     echo=True).choices[:1]
    assert plain.text.startswith(PROMPT) and plain.logprobs is None


def test_vllms_prompt_logprobs_come_on_whole_answers(gateway, cluster, grpc_client):
    """vLLM's prompt_logprobs field: each completion choice (a chat answer once, at its top level) gets the prompt's
    tokens scored in vLLM's shape, {token id: {logprob, rank, decoded_token}}, the gRPC path's values."""
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    ids = grpc_client.tokenize(PROMPT)
    expected = grpc_client.generate(ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    answer = httpx.post(f"{gateway}/v1/completions", headers=headers, timeout=60, json={
        "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2, "n": 2}).json()
    for choice in answer["choices"]:
        scored = choice["prompt_logprobs"]
        assert scored[0] is None and len(scored) == len(ids)
        for position, (entry, reference) in enumerate(zip(scored[1:], expected.prompt_logprobs[1:]), start=1):
            first, *alternatives = entry.items()
            assert first[0] == str(ids[position]) and first[1]["rank"] == reference.sampled.rank >= 1
            assert first[1]["logprob"] == pytest.approx(reference.sampled.logprob, abs=1e-6)
            assert all(value["rank"] in (1, 2) and value["decoded_token"] for _, value in alternatives)
    chat = httpx.post(f"{gateway}/v1/chat/completions", headers=headers, timeout=60, json={
        "messages": QUESTION, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
    streamed = httpx.post(f"{gateway}/v1/completions", headers=headers, timeout=60, json={
        "prompt": PROMPT, "max_tokens": 2, "stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400 and "not available with stream" in streamed.json()["error"]["message"]


def test_truncate_prompt_tokens_serves_the_prompts_last_tokens(api, grpc_client, tokenizer):
    """vLLM's truncate_prompt_tokens on completions and chats: the router keeps the prompt's (or rendered chat's)
    last tokens, counted as the usage's prompt tokens, and the answer is the one those tokens alone get."""
    model = api.models.list().data[0].id
    prompt = "Once upon a time, in a land far away, there lived a king who loved to count. The capital of France is"
    token_ids = grpc_client.tokenize(prompt)
    expected = grpc_client.generate(token_ids[-6:], SamplingParams(temperature=0, max_tokens=6)).text
    cut = {"truncate_prompt_tokens": 6}
    answer = api.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, extra_body=cut)
    assert answer.usage.prompt_tokens == 6 and answer.choices[0].text == expected
    chat_ids = list(tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    chat_expected = grpc_client.generate(chat_ids[-9:], SamplingParams(temperature=0, max_tokens=6)).text
    chat = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0,
                                       extra_body={"truncate_prompt_tokens": 9})
    assert chat.usage.prompt_tokens == 9 and chat.choices[0].message.content == chat_expected
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model=model, prompt=prompt, max_tokens=2, extra_body={"truncate_prompt_tokens": 0})
    assert "truncate_prompt_tokens" in refused.value.message


def test_continue_final_message_continues_the_assistants_answer(api, gateway, cluster, grpc_client, tokenizer):
    """vLLM's continue_final_message (with add_generation_prompt false, as vLLM asks, or left out): the chat's
    prompt ends inside the assistant's begun answer, as transformers renders it, and the model continues it
    token for token as a completion of that prompt does; /tokenize renders the same; both flags, or a value that
    is not a boolean, are refused naming the field. With vLLM's echo the answer starts with the begun answer (a
    stream's chunk after the role's), and a chat ending in a user's message echoes nothing."""
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    model = api.models.list().data[0].id
    messages = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    expected = list(tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    tokenized = httpx.post(f"{gateway}/tokenize", headers=headers,
                           json={"messages": messages, "continue_final_message": True}).json()
    assert tokenized["tokens"] == expected
    continued = grpc_client.generate(expected, SamplingParams(temperature=0, max_tokens=8)).text
    for flags in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False}):
        answer = api.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                             extra_body=flags)
        assert answer.choices[0].message.content == continued
    reopened = api.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert reopened.choices[0].message.content != continued  # by default a new assistant turn opens
    echo = {"continue_final_message": True, "echo": True}
    echoed = api.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, n=2,
                                         extra_body=echo)
    assert [choice.message.content for choice in echoed.choices] == ["The capital of France is" + continued] * 2
    chunks = list(api.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                              stream=True, extra_body=echo))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == "The capital of France is"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed.choices[0].message.content
    asked = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
    assert api.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0,
                                       extra_body={"echo": True}).choices[0].message.content == asked.choices[0].message.content
    for flags, field in (({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
                         ({"continue_final_message": "yes"}, "continue_final_message"),
                         ({"add_generation_prompt": 0}, "add_generation_prompt")):
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body=flags)
        assert refused.value.body["param"] == field, flags


def test_tokenize_and_detokenize_are_vllms(gateway, cluster, grpc_client, tokenizer):
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    tokenized = httpx.post(f"{gateway}/tokenize", headers=headers, json={"prompt": PROMPT}).json()
    assert tokenized["tokens"] == grpc_client.tokenize(PROMPT) and tokenized["count"] == len(tokenized["tokens"])
    assert "token_strs" not in tokenized
    # vLLM's add_special_tokens reaches the router (this tokenizer adds nothing, so the ids are the same either way;
    # tests/unit/test_router_frontend.py shows one that adds a BOS); anything but true or false is 400.
    model = httpx.get(f"{gateway}/v1/models", headers=headers).json()["data"][0]["id"]
    for route, body in (("/tokenize", {"prompt": PROMPT}), ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
                        ("/v1/embeddings", {"input": PROMPT}), ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1})):
        body = {"model": model, **body}
        assert httpx.post(f"{gateway}{route}", headers=headers, json={**body, "add_special_tokens": False}).is_success
        refused = httpx.post(f"{gateway}{route}", headers=headers, json={**body, "add_special_tokens": "no"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "add_special_tokens", route
    # vLLM's return_token_strs: each token as the tokenizer spells it, for text and chats.
    for body in ({"prompt": PROMPT}, {"messages": QUESTION}):
        spelled = httpx.post(f"{gateway}/tokenize", headers=headers, json={**body, "return_token_strs": True}).json()
        assert spelled["token_strs"] == tokenizer.convert_ids_to_tokens(spelled["tokens"])
        assert len(spelled["token_strs"]) == spelled["count"] > 1
    assert tokenized["max_model_len"] == grpc_client.model_info().max_model_len
    chat = httpx.post(f"{gateway}/tokenize", headers=headers, json={"messages": QUESTION}).json()
    chat_text = httpx.post(f"{gateway}/detokenize", headers=headers, json={"tokens": chat["tokens"]}).json()["prompt"]
    assert chat_text.startswith("<|im_start|>") and "What is the capital of France?" in chat_text
    assert httpx.post(f"{gateway}/detokenize", headers=headers,
                      json={"tokens": tokenized["tokens"]}).json() == {"prompt": PROMPT}
    for route, body, words in (("/detokenize", {"tokens": [1, 10**9]}, "outside the vocabulary"),
                               ("/detokenize", {"tokens": "1 2"}, "tokens must be a list of token ids"),
                               ("/tokenize", {"prompt": [1, 2]}, "prompt must be a string"),
                               # Negative or past uint32: the gateway says so (it was a 500 before, found by the
                               # random bodies below); ids past the vocabulary are the router's to refuse.
                               ("/v1/completions", {"prompt": [-1], "max_tokens": 1}, "outside the vocabulary"),
                               ("/v1/completions", {"prompt": [[5], [2**32]], "max_tokens": 1},
                                "outside the vocabulary"),
                               ("/v1/embeddings", {"input": [17, -5]}, "outside the vocabulary")):
        refused = httpx.post(f"{gateway}{route}", headers=headers, json=body)
        assert refused.status_code == 400 and words in refused.json()["error"]["message"], refused.text
    stranger = httpx.post(f"{gateway}/detokenize", headers={"authorization": "Bearer not-the-key"},
                          json={"tokens": [1]})
    assert stranger.status_code == 401


def test_chat_template_kwargs_are_taken_and_checked(api, gateway, cluster):
    """vLLM's chat_template_kwargs on /tokenize and chats reach the router (this template reads none of them, so
    the prompt is the same; tests/unit/test_router_frontend.py renders them); what the renderer sets itself, or a
    value that is not simple, is refused with 400 and a sentence."""
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    kwargs = {"enable_thinking": False, "style": "short", "depth": 2, "temperature_hint": 0.5}
    plain = httpx.post(f"{gateway}/tokenize", headers=headers, json={"messages": QUESTION}).json()
    assert httpx.post(f"{gateway}/tokenize", headers=headers,
                      json={"messages": QUESTION, "chat_template_kwargs": kwargs}).json() == plain
    model = api.models.list().data[0].id
    chat = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, temperature=0,
                                       extra_body={"chat_template_kwargs": kwargs})
    assert chat.usage.prompt_tokens == plain["count"]
    for bad, words in (({"add_generation_prompt": False}, "may not set 'add_generation_prompt'"),
                       ({"messages": []}, "may not set 'messages'"), ({"enable_thinking": None}, "must be a boolean"),
                       ([1], "must be an object")):
        refused = httpx.post(f"{gateway}/tokenize", headers=headers,
                             json={"messages": QUESTION, "chat_template_kwargs": bad})
        assert refused.status_code == 400 and words in refused.json()["error"]["message"], refused.text
        with pytest.raises(openai.BadRequestError) as refused_chat:
            api.chat.completions.create(model=model, messages=QUESTION, max_tokens=2,
                                        extra_body={"chat_template_kwargs": bad})
        assert words in refused_chat.value.message and refused_chat.value.param == "chat_template_kwargs"


def test_chat_is_the_grpc_paths_greedy_output(api, grpc_client):
    model = api.models.list().data[0].id
    expected = grpc_client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=64))
    chat = api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=64)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected.text == "The capital of France is Paris."
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == len(expected.token_ids)
    assert chat.choices[0].stop_reason is None  # the end-of-sequence token, as vLLM says it
    # A stop string and a stop token id say which matched (vLLM's stop_reason), whole and streamed.
    stopped = api.chat.completions.create(model=model, messages=QUESTION, temperature=0, stop=[" Paris"])
    assert stopped.choices[0].message.content == "The capital of France is"
    assert stopped.choices[0].stop_reason == " Paris"
    stop_id = grpc_client.tokenize(" France")[0]
    streamed = list(api.chat.completions.create(model=model, messages=QUESTION, temperature=0, stream=True,
                                                extra_body={"stop_token_ids": [stop_id]}))
    assert [c.choices[0].stop_reason for c in streamed if c.choices[0].finish_reason] == [stop_id]
    stream = api.chat.completions.create(model=model, messages=QUESTION, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_return_tokens_as_token_ids_names_each_token_by_its_id(api, grpc_client):
    """vLLM's return_tokens_as_token_ids: the logprobs name every token, sampled and alternatives, as
    "token_id:N" (the gRPC path's ids), on completions and chats, whole and streamed; the text offsets, bytes and
    log probabilities stay those of the tokens' text."""
    model = api.models.list().data[0].id
    expected = grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, logprobs=2))
    names = [f"token_id:{token_id}" for token_id in expected.token_ids]
    by_id = {"return_tokens_as_token_ids": True}
    request = {"model": model, "prompt": PROMPT, "temperature": 0, "max_tokens": 12, "logprobs": 2}
    plain = api.completions.create(**request).choices[0].logprobs
    named = api.completions.create(**request, extra_body=by_id).choices[0].logprobs
    assert named.tokens == names and named.text_offset == plain.text_offset
    assert named.token_logprobs == plain.token_logprobs
    assert [list(top) for top in named.top_logprobs] == [[f"token_id:{top.token_id}" for top in position.top]
                                                         for position in expected.logprobs]
    streamed = [token for chunk in api.completions.create(**request, stream=True, extra_body=by_id)
                for token in (chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else [])]
    assert streamed == names
    chat_request = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 12, "logprobs": True,
                    "top_logprobs": 2}
    chat_ids = list(grpc_client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=12)).token_ids)
    plain_chat = api.chat.completions.create(**chat_request).choices[0].logprobs.content
    named_chat = api.chat.completions.create(**chat_request, extra_body=by_id).choices[0].logprobs.content
    assert [entry.token for entry in named_chat] == [f"token_id:{token_id}" for token_id in chat_ids]
    assert [entry.bytes for entry in named_chat] == [entry.bytes for entry in plain_chat]
    assert all(top.token.startswith("token_id:") for entry in named_chat for top in entry.top_logprobs)
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(**request, extra_body={"return_tokens_as_token_ids": "yes"})
    assert refused.value.body["param"] == "return_tokens_as_token_ids"


def test_chat_logprobs_are_the_grpc_paths_and_spell_the_answer(api, grpc_client):
    model = api.models.list().data[0].id
    expected = grpc_client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=64, logprobs=2))
    chat = api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=64, logprobs=True,
                                       top_logprobs=2)
    [choice] = chat.choices
    content = choice.logprobs.content
    # An entry per generated token, the end of sequence last (its text left out of the answer's).
    tokens = [entry.token for entry in content]
    assert len(tokens) == len(expected.token_ids) and choice.finish_reason == "stop"
    assert "".join(tokens[:-1]) == choice.message.content == expected.text
    assert tokens == [position.sampled.text for position in expected.logprobs]
    assert [entry.logprob for entry in content] == pytest.approx([position.sampled.logprob
                                                                  for position in expected.logprobs])
    for entry, position in zip(content, expected.logprobs):
        assert entry.bytes == list(entry.token.encode("utf-8")) and entry.logprob <= 0
        assert [top.token for top in entry.top_logprobs] == [top.text for top in position.top]
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
    # Streamed, without alternatives: each chunk's tokens, which together spell the answer; no logprobs unasked.
    stream = api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=64, stream=True,
                                         logprobs=True)
    entries = [entry for chunk in stream for choice in chunk.choices if choice.logprobs
               for entry in choice.logprobs.content]
    assert "".join(entry.token for entry in entries[:-1]) == expected.text and len(entries) == len(tokens)
    assert all(entry.top_logprobs == [] for entry in entries)
    # OpenAI's defaults, as some clients send them: no logprobs, zero alternatives, a text response format.
    plain = api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=4, logprobs=False,
                                        top_logprobs=0, response_format={"type": "text"})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == expected.text[:len(
        plain.choices[0].message.content)]
    for fields in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}, {"logprobs": "yes"},
                   {"response_format": {"type": "xml"}}):
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, **fields)
        assert refused.value.param in ("logprobs", "top_logprobs", "response_format"), fields


def test_n_choices_are_generations_of_their_own(api, grpc_client):
    model = api.models.list().data[0].id
    expected = grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))
    completion = api.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, n=3)
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    assert all(choice.text == expected.text and choice.finish_reason == "length" for choice in completion.choices)
    assert completion.usage.prompt_tokens == expected.usage.prompt_tokens  # the prompt counted once
    assert completion.usage.completion_tokens == 3 * 12
    # Seeded sampling: choice i samples as a request of its own with seed + i would.
    sampled = {"temperature": 1.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    pair = api.completions.create(model=model, prompt=PROMPT, n=2, seed=5, **sampled)
    alone = [api.completions.create(model=model, prompt=PROMPT, seed=seed, **sampled).choices[0].text
             for seed in (5, 6)]
    assert [choice.text for choice in pair.choices] == alone and alone[0] != alone[1]
    # A streamed chat of two choices: each index gets its role, its text and its finish; the usage covers both.
    answer = grpc_client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=64))
    stream = api.chat.completions.create(model=model, messages=QUESTION, temperature=0, n=2, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [choice for chunk in chunks for choice in chunk.choices]
    for index in (0, 1):
        mine = [choice for choice in deltas if choice.index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(choice.delta.content or "" for choice in mine) == answer.text
        assert [choice.finish_reason for choice in mine if choice.finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(answer.token_ids)
    for fields in ({"n": 0}, {"n": 17}, {"n": 1.5}, {"best_of": 2}):
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model=model, prompt=PROMPT, max_tokens=4, **fields)
        assert refused.value.param in ("n", "best_of"), fields


def test_continuous_usage_counts_each_choices_tokens_in_every_chunk(api, grpc_client):
    """vLLM's stream_options.continuous_usage_stats: every chunk (a chat's role chunks too) carries its choice's
    prompt tokens and the tokens it was sent so far, here counted off the chunks' logprobs; the usage chunk at the
    end stays the request's. Without include_usage, or without the flag, chunks carry none."""
    model = api.models.list().data[0].id
    expected = grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10))
    prompt_tokens = expected.usage.prompt_tokens
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(api.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, n=2, logprobs=0,
                                         stream=True, stream_options=options))
    sent: collections.Counter = collections.Counter()
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        sent[choice.index] += len(choice.logprobs.tokens) if choice.logprobs else 0
        usage = chunk.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, sent[choice.index]), chunk
        assert usage.total_tokens == prompt_tokens + sent[choice.index]
    assert sent == {0: 10, 1: 10}
    last = chunks[-1]
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_tokens, 20)
    # A chat: its role chunk counts the prompt and nothing sent yet.
    chat = grpc_client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=8))
    chunks = list(api.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0,
                                              logprobs=True, stream=True, stream_options=options))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (chunks[0].usage.prompt_tokens, chunks[0].usage.completion_tokens) == (chat.usage.prompt_tokens, 0)
    num_sent = 0
    for chunk in chunks[1:-1]:
        num_sent += len(chunk.choices[0].logprobs.content) if chunk.choices[0].logprobs else 0
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (chat.usage.prompt_tokens, num_sent)
    assert num_sent == len(chat.token_ids) and chunks[-1].usage.completion_tokens == num_sent
    # Continuous usage needs include_usage (as in vLLM); include_usage alone puts the usage in the last chunk only.
    for options in ({"continuous_usage_stats": True}, {"include_usage": True}):
        chunks = list(api.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, stream=True,
                                             stream_options=options))
        assert all(chunk.usage is None for chunk in chunks[:-1]), options
    for fields in ({"stream_options": {"include_usage": True}}, {"stream": True, "stream_options": "usage"},
                   {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}}):
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model=model, prompt=PROMPT, max_tokens=2, **fields)
        assert refused.value.param == "stream_options", fields


def test_a_cache_salt_keeps_cached_prefixes_among_its_own_requests(api, grpc_client):
    """vLLM's cache_salt, through the gateway (completions, chat, embeddings) and gRPC: a prompt's cached blocks are
    found again by requests with the same salt only (none by other salts or unsalted ones, and a salted request
    finds none of theirs); the answers stay the unsalted greedy ones; bad salts are refused."""
    model = api.models.list().data[0].id
    prompt = "A ledger of salted requests: " + " ".join(f"entry {number} balanced." for number in range(60))
    expected = grpc_client.generate(prompt, SamplingParams(temperature=0, max_tokens=4))  # now cached unsalted

    def cached_tokens(salt: str | None, route: str = "completions") -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        if route == "completions":
            answer = api.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)
            assert answer.choices[0].text == expected.text, salt
        elif route == "chat":
            answer = api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=4, temperature=0, extra_body=extra)
        else:  # the openai package keeps the embeddings usage's details as sent (a dict)
            return api.embeddings.create(model=model, input=prompt, extra_body=extra).usage.prompt_tokens_details[
                "cached_tokens"]
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached_tokens(None) > 0
    assert cached_tokens("tenant-a") == 0 and cached_tokens("tenant-b") == 0
    assert cached_tokens("tenant-a") > 0
    assert cached_tokens("tenant-c", "chat") == 0 and cached_tokens("tenant-c", "chat") > 0
    assert cached_tokens(None, "embeddings") > 0
    assert cached_tokens("tenant-e", "embeddings") == 0 and cached_tokens("tenant-e", "embeddings") > 0
    answer = grpc_client.generate(prompt, SamplingParams(temperature=0, max_tokens=4), cache_salt="tenant-b")
    assert answer.usage.cached_tokens > 0 and answer.text == expected.text
    for salt in ("", 7, "x" * 257):
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={"cache_salt": salt})
        assert refused.value.param == "cache_salt" and "cache_salt" in refused.value.message, salt
    with pytest.raises(grpc.RpcError) as refused:
        grpc_client.generate(PROMPT, SamplingParams(max_tokens=2), cache_salt="")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in refused.value.details()


def test_a_batch_of_prompts_gets_n_choices_each_numbered_prompt_by_prompt(api, grpc_client):
    model = api.models.list().data[0].id
    token_ids = grpc_client.tokenize("Water boils at")
    batch = [PROMPT, "Once upon a time,", token_ids]
    expected = [grpc_client.generate(prompt, SamplingParams(temperature=0, max_tokens=6)) for prompt in batch]
    completion = api.completions.create(model=model, prompt=batch, max_tokens=6, temperature=0, n=2)
    assert [choice.index for choice in completion.choices] == list(range(6))
    assert [choice.text for choice in completion.choices] == [answer.text for answer in expected for _ in range(2)]
    assert completion.usage.prompt_tokens == sum(answer.usage.prompt_tokens for answer in expected)
    assert completion.usage.completion_tokens == 6 * 6
    stream = api.completions.create(model=model, prompt=batch, max_tokens=6, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(stream)
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index)
             for index in range(3)]
    assert texts == [answer.text for answer in expected]
    assert chunks[-1].usage.prompt_tokens == completion.usage.prompt_tokens
    for prompt, fields in (([PROMPT] * 17, {}), ([PROMPT] * 9, {"n": 2}), ([PROMPT, ""], {}), ([PROMPT, [1, "x"]], {}),
                           ([], {})):
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model=model, prompt=prompt, max_tokens=2, **fields)
        assert refused.value.param in ("prompt", "n"), (prompt, fields)


def test_logit_bias_bans_and_forces_tokens_on_both_workers(api, grpc_client):
    model = api.models.list().data[0].id
    plain = grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))
    first = plain.token_ids[0]
    banned = grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logit_bias={first: -100}))
    assert first not in banned.token_ids and len(banned.token_ids) == 6
    # The prefill worker samples the first token, the decode worker the rest: the bias holds on both.
    forced_id = plain.token_ids[2]
    forced = grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logit_bias={forced_id: 100}))
    assert list(forced.token_ids) == [forced_id] * 4
    # Through the gateway, whose JSON keys are strings: the same tokens.
    completion = api.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                        logit_bias={str(first): -100})
    assert completion.choices[0].text == banned.text != plain.text
    vocab_size = grpc_client.model_info().vocab_size
    for logit_bias in ({"x": 1}, {str(vocab_size): 1}, {"5": 101}, [1]):
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model=model, prompt=PROMPT, max_tokens=2, logit_bias=logit_bias)
        assert "logit_bias" in refused.value.message, logit_bias


def test_bad_words_allowed_token_ids_and_kept_stop_strings_hold_on_both_workers(api, grpc_client, model_dir,
                                                                               tokenizer):
    """vLLM's bad_words, allowed_token_ids and include_stop_str_in_output, through gRPC and the gateway's JSON: the
    prefill worker samples the first token and the decode worker the rest under the same bans, giving
    transformers' greedy tokens; bad values are refused with 400 naming the field."""
    from splitserve.engine.logits_processors import bad_words_token_ids
    from tests.reference import hf_greedy

    model = api.models.list().data[0].id
    plain = grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))  # " Paris.\n\nThe answer is:"
    words = ["Paris", "answer is"]  # the first token (the prefill's), then two of the decode worker's
    banned = grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, bad_words=words))
    prompt_ids = tokenizer.encode(PROMPT)
    bans = [list(sequence) for sequence in bad_words_token_ids(tokenizer, words)]
    assert list(banned.token_ids) == hf_greedy(str(model_dir), prompt_ids, 8, bad_words_ids=bans)
    assert banned.token_ids[0] != plain.token_ids[0] and "Paris" not in banned.text
    decode_only = grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, bad_words=["answer is"]))
    assert " answer is" in plain.text and " answer is" not in decode_only.text
    assert decode_only.token_ids[:5] == plain.token_ids[:5]
    allowed = sorted(set(plain.token_ids[1:]))
    limited = grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed))
    assert set(limited.token_ids) <= set(allowed) and limited.token_ids[0] != plain.token_ids[0]
    assert list(limited.token_ids) == hf_greedy(str(model_dir), prompt_ids, 8,
                                                prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    extra = {"bad_words": words}
    completion = api.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=extra)
    assert completion.choices[0].text == banned.text
    extra = {"allowed_token_ids": allowed}
    completion = api.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=extra)
    assert completion.choices[0].text == limited.text
    kept = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop": ["."],
            "extra_body": {"include_stop_str_in_output": True}}
    assert api.completions.create(**kept).choices[0].text == plain.text[:plain.text.index(".") + 1]
    streamed = "".join(chunk.choices[0].text for chunk in api.completions.create(**kept, stream=True))
    assert streamed == plain.text[:plain.text.index(".") + 1]
    vocab_size = grpc_client.model_info().vocab_size
    for field, bad in (("allowed_token_ids", [vocab_size]), ("allowed_token_ids", []), ("bad_words", [" "]),
                       ("bad_words", "x" * 300), ("include_stop_str_in_output", "yes")):
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={field: bad})
        assert field.split("_")[0] in refused.value.message, (field, bad)


def test_structured_outputs_are_the_grpc_paths_and_keep_their_shape(api, grpc_client):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs (choice, regex, grammar):
    greedy, the gRPC path's tokens under the same constraint (the prefill worker's first token and the decode
    worker's rest both masked); streamed too. Refused with 400 and a sentence: other response formats, vLLM's
    removed guided_* fields, unknown constraint fields, both fields at once, and a constraint that does not build
    (the router's check)."""
    model = api.models.list().data[0].id
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
              "required": ["city", "population"], "additionalProperties": False}
    chat = api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=60,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "city", "schema": schema}})
    answer = json.loads(chat.choices[0].message.content)
    assert set(answer) == {"city", "population"} and 0 <= answer["population"] <= 10**8
    assert chat.choices[0].finish_reason == "stop"
    expected = grpc_client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=60,
                                                             structured_outputs={"json": schema}))
    assert chat.choices[0].message.content == expected.text
    compact = api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=60,
                                          extra_body={"structured_outputs": {"json": schema,
                                                                             "disable_any_whitespace": True}})
    assert json.loads(compact.choices[0].message.content) and "\n" not in compact.choices[0].message.content
    anything = api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=30,
                                           response_format={"type": "json_object"})
    assert anything.choices[0].message.content.startswith("{")  # this small model's object outruns 30 tokens
    assert anything.choices[0].message.content == grpc_client.generate(QUESTION, SamplingParams(
        temperature=0, max_tokens=30, structured_outputs={"json_object": True})).text
    for constraint, check in (({"choice": ["Paris", "Lyon", "Nice"]}, lambda text: text in ("Paris", "Lyon", "Nice")),
                              ({"regex": "[0-9]{3}"}, lambda text: re.fullmatch("[0-9]{3}", text)),
                              ({"grammar": 'root ::= " " ("a" | "b")+'}, lambda text: re.fullmatch(" [ab]+", text))):
        completion = api.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=8,
                                            extra_body={"structured_outputs": constraint})
        text = completion.choices[0].text
        assert check(text), (constraint, text)
        assert text == grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8,
                                                                   structured_outputs=constraint)).text
        stream = api.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=8, stream=True,
                                        extra_body={"structured_outputs": constraint})
        assert "".join(choice.text for chunk in stream for choice in chunk.choices) == text
    for extra, field, words in (
            ({"response_format": {"type": "xml"}}, "response_format", "text, json_object or json_schema"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
             '"schema"'),
            ({"guided_json": schema}, "guided_json", 'structured_outputs: {"json": ...}'),
            ({"structured_outputs": {"json": schema, "structural_tag": "{}"}}, "structured_outputs",
             "structural_tag is not supported"),
            ({"structured_outputs": {"regex": "[0-9]+"}, "response_format": {"type": "json_object"}},
             "structured_outputs", "not both"),
            ({"structured_outputs": {"regex": "[0-"}}, None, "regex is not valid"),
            ({"structured_outputs": {"choice": "Paris"}}, "structured_outputs", "list of strings")):
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body=extra)
        assert words in refused.value.message and refused.value.param == field, extra


def test_bad_requests_get_openai_errors(api, gateway, cluster):
    model = api.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model=model, prompt=PROMPT, temperature=-1)
    assert bad.value.status_code == 400 and "temperature" in bad.value.message
    with pytest.raises(openai.NotFoundError) as unknown:
        api.completions.create(model="gpt-4", prompt=PROMPT)
    assert "does not exist" in unknown.value.message and unknown.value.code == "model_not_found"
    stranger = openai.OpenAI(base_url=f"{gateway}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.completions.create(model=model, prompt=PROMPT)
    too_long = "word " * 5000  # over the router's limit on a prompt's length: its INVALID_ARGUMENT, as 400
    for num_choices in (1, 2):  # with two choices, both calls refused and the answer one 400
        with pytest.raises(openai.BadRequestError):
            api.completions.create(model=model, prompt=too_long, max_tokens=1, n=num_choices)
    big = httpx.post(f"{gateway}/v1/completions", content=b"{" + b" " * 200_000 + b"}",
                     headers={"authorization": f"Bearer {cluster.api_key}", "content-type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
    broken = httpx.post(f"{gateway}/v1/chat/completions", content=b"{not json",
                        headers={"authorization": f"Bearer {cluster.api_key}"})
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    deep = httpx.post(f"{gateway}/v1/completions", content=b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
                      headers={"authorization": f"Bearer {cluster.api_key}"})
    assert deep.status_code == 400 and deep.json()["error"]["message"] == "The request body is nested too deeply."
    schema = {"type": "integer"}
    for _ in range(900):  # within the parser's depth, beyond what the constraint's checks read
        schema = {"type": "array", "items": schema}
    deep_schema = httpx.post(f"{gateway}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "structured_outputs":
                                                                 {"json": schema}},
                             headers={"authorization": f"Bearer {cluster.api_key}"})
    assert deep_schema.status_code == 400 and "json is not valid" in deep_schema.json()["error"]["message"]
    for field in ("stream", "echo"):  # a flag is true or false: 1.0 or "yes" is refused, not taken as truthy
        flagged = httpx.post(f"{gateway}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, field: "yes"},
                             headers={"authorization": f"Bearer {cluster.api_key}"})
        assert flagged.status_code == 400 and flagged.json()["error"]["message"] == f"{field} must be true or false."
    assert httpx.get(f"{gateway}/v2/nothing").status_code == 404
    # vLLM's priority: these workers serve first come, first served, and refuse any but 0 with a sentence.
    assert api.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={"priority": 0}).choices
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={"priority": 3})
    assert "needs the priority scheduling policy (--scheduling-policy priority)" in refused.value.message
    for priority in ("high", 2**31, 1.5):
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={"priority": priority})
        assert refused.value.param == "priority"


@pytest.mark.parametrize("num_choices", [1, 2])
def test_a_client_that_disconnects_frees_its_blocks(gateway, cluster, grpc_client, num_choices):
    body = {"prompt": PROMPT * 20, "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True,
            "n": num_choices}
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    started = time.monotonic()
    with httpx.stream("POST", f"{gateway}/v1/completions", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        events = response.iter_lines()
        first = next(line for line in events if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["choices"][0]["text"]
        wait_until(lambda: not all_blocks_free(grpc_client), 10, message="the request holds blocks while it runs")
    # The connection is closed: the request is aborted on the workers long before 1,500 tokens could finish.
    wait_until(lambda: all_blocks_free(grpc_client), 20, message="every block freed after the disconnect")
    assert time.monotonic() - started < 40
    status = grpc_client.cluster_status()
    assert all(worker.num_router_in_flight_requests == 0 for pool in status.pools for worker in pool.workers)


def test_health_and_version_need_no_key(gateway):
    import splitserve

    assert httpx.get(f"{gateway}/health").json() == {"status": "ok"}
    assert httpx.get(f"{gateway}/version").json() == {"version": splitserve.__version__}
    assert os.environ.get("SPLITSERVE_API_KEY") is None  # the gateway had no key of its own to fall back on


def test_the_async_client_streams_what_the_client_streams(cluster, grpc_client):
    import asyncio

    from splitserve.client import AsyncClient

    params = SamplingParams(temperature=0, max_tokens=12)
    expected = grpc_client.generate(PROMPT, params)

    async def run():
        async with AsyncClient(cluster.router.address, api_key=cluster.api_key) as client:
            chunks = [chunk async for chunk in client.generate_stream(PROMPT, params)]
            status = await client.cluster_status()
            return chunks, status, await client.tokenize(PROMPT)

    chunks, status, token_ids = asyncio.run(run())
    assert [t for c in chunks for t in c.token_ids] == list(expected.token_ids)
    assert "".join(c.text for c in chunks) == expected.text
    assert token_ids == grpc_client.tokenize(PROMPT)
    assert str(status).splitlines()[0].split()[:2] == ["pool", "worker"]


def test_metrics_count_requests_by_route_and_status_and_the_generations(api, gateway, gateway_log):
    url = wait_until(lambda: re.search(r"Prometheus metrics on (http://\S+/metrics)", gateway_log.read_text()), 30,
                     message="the gateway logs its metrics URL").group(1)
    assert url.startswith("http://127.0.0.1:") and url != f"{gateway}/metrics"
    before = scrape(url)
    model = api.models.list().data[0].id
    api.completions.create(model=model, prompt=[PROMPT, PROMPT + " a city"], max_tokens=2, temperature=0, n=2)
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=-1)
    assert httpx.get(f"{gateway}/v1/no-such-route/{'x' * 50}").status_code == 404
    api.models.retrieve(model)
    after = scrape(url)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("splitserve_gateway_requests_total", route="/v1/completions", status="200") == 1
    assert moved("splitserve_gateway_requests_total", route="/v1/completions", status="400") == 1
    assert moved("splitserve_gateway_requests_total", route="/v1/models", status="200") == 1
    assert moved("splitserve_gateway_requests_total", route="other", status="404") == 1  # no client path as a label
    assert moved("splitserve_gateway_requests_total", route="/v1/models/{model}", status="200") == 1  # not the name
    assert moved("splitserve_gateway_generations_total") == 4  # 2 prompts x n=2; the refused one made no call
    assert moved("splitserve_gateway_request_duration_seconds_count", route="/v1/completions") == 2
    assert value(after, "splitserve_gateway_requests_in_flight") == 0
    assert not any("no-such-route" in str(labels) or model in str(labels) for _, labels in after)


# ---- random bodies: only documented statuses, and nothing is lost ----------------------------------------------

_WILD = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.integers(-(2**64), 2**64),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                  st.lists(st.integers(-5, 60_000), max_size=4),
                  st.dictionaries(st.text(max_size=6), st.integers(-200, 200), max_size=3))


def _body_fields(model: str, chat: bool, wild: bool):
    """A body's fields: valid values (small ones where they cost tokens), and with ``wild`` any JSON value too."""

    def pick(*valid):
        return st.one_of(st.sampled_from(valid), _WILD) if wild else st.sampled_from(valid)

    prompts = [PROMPT, [504, 1012, 17], [PROMPT, "Hi"], [[504, 1012], [17]], "", [PROMPT, ""]]
    fields = {
        "model": pick(model, "gpt-4"), "n": pick(1, 2), "temperature": pick(0, 0.7), "top_p": pick(0.9, 1),
        "top_k": pick(-1, 5), "seed": pick(3, -1), "stop": pick(".", [" Paris", "\n"]), "stream": pick(True, False),
        "logit_bias": pick({"504": -100}, {"17": 5.5}), "stop_token_ids": pick([2], []),
        "stream_options": pick({"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}),
        "response_format": pick({"type": "text"}, {"type": "json_object"}),
        "structured_outputs": pick({"choice": [" Paris", " Lyon"]}, {"regex": " [0-9]+"}),
        "best_of": pick(1),
    }
    if chat:
        fields |= {"logprobs": pick(True, False), "top_logprobs": pick(0, 2), "tools": pick([WEATHER, CLOCK], [CLOCK]),
                   "tool_choice": pick("none", "auto", "required", {"type": "function", "function": {"name": "get_time"}}),
                   "parallel_tool_calls": pick(True, False)}
        required = {"messages": pick(QUESTION, [{"role": "system", "content": "Be brief."}, *QUESTION], [])}
    else:
        fields |= {"logprobs": pick(0, 2), "echo": pick(False, True), "prompt_logprobs": pick(0, 1)}
        required = {"prompt": pick(*prompts)}
    # max_tokens always present and small when valid: a default would generate to the end of the context.
    required["max_tokens"] = st.one_of(st.sampled_from([1, 2, 4]), st.sampled_from([0, -1, 2.5, "2", True, 10**30])) \
        if wild else st.sampled_from([1, 2, 4])
    return st.fixed_dictionaries(required, optional=fields)


def _responses_and_embeddings_bodies(model: str, responses: bool, wild: bool):
    """Bodies for /v1/responses (messages, flat function tools and tool choices, call items, formats) or
    /v1/embeddings (texts, ids, batches, formats), valid values and with ``wild`` any JSON value too."""

    def pick(*valid):
        return st.one_of(st.sampled_from(valid), _WILD) if wild else st.sampled_from(valid)

    if not responses:
        fields = {"model": pick(model, "gpt-4"), "encoding_format": pick("float", "base64", "int8"),
                  "dimensions": pick(8, 576, 0, 10_000), "normalize": pick(True, False), "user": pick("u")}
        required = {"input": pick(PROMPT, [504, 1012, 17], [PROMPT, "Hi"], [[504], [17, 5]], "", [], [-1], [[]])}
        return st.fixed_dictionaries(required, optional=fields)
    weather = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}
    fields = {
        "model": pick(model, "gpt-4"), "instructions": pick("Be brief.", ""), "temperature": pick(0, 0.7),
        "top_p": pick(0.9, 1), "stream": pick(True, False), "store": pick(False, True),
        "tools": pick([weather], [weather, {"type": "function", "name": "get_time"}], [{"type": "web_search"}], []),
        "tool_choice": pick("auto", "none", "required", {"type": "function", "name": "get_weather"},
                            {"type": "function", "name": "nowhere"}),
        "parallel_tool_calls": pick(True, False),
        "text": pick({"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                     {"format": {"type": "json_schema", "name": "w", "schema": WEATHER["function"]["parameters"]}}),
        "include": pick([], ["message.output_text.logprobs"]), "reasoning": pick({"effort": "low"}),
        "metadata": pick({"k": "v"}), "truncation": pick("disabled", "auto"),
    }
    required = {
        "input": pick("What is the capital of France?", [{"role": "user", "content": "Hi"}],
                      [{"role": "user", "content": "Weather?"}, call, output], [call], [output], [],
                      [{"role": "tool", "content": "x"}], [{"type": "reasoning", "summary": []}]),
        # Always present and small when valid: a default would generate to the end of the context.
        "max_output_tokens": st.one_of(st.sampled_from([1, 3]), st.sampled_from([0, -1, 2.5, "2", True]))
        if wild else st.sampled_from([1, 3]),
    }
    return st.fixed_dictionaries(required, optional=fields)


def _post_random(gateway: str, route: str, body: dict, headers: dict, statuses: collections.Counter):
    """POST a random ``body`` to ``route`` and count its status: the response when it is 200, None after checking a
    refusal is documented (400, 404, 413, 429) and in OpenAI's error shape, or when the body is no JSON."""
    try:
        content = json.dumps(body, allow_nan=True)
    except (ValueError, OverflowError):
        return None
    response = httpx.post(f"{gateway}{route}", content=content, headers=headers, timeout=60)
    statuses[(route, response.status_code)] += 1
    if response.status_code == 200:
        return response
    assert response.status_code in (400, 404, 413, 429), (response.status_code, response.text, body)
    error = response.json()["error"]
    assert error["message"] and error["type"], body
    return None


def test_random_responses_and_embeddings_bodies_get_only_documented_statuses(api, gateway, cluster, grpc_client):
    """Hypothesis sends random JSON bodies to /v1/responses and /v1/embeddings: every answer is 200 (a whole
    response, a stream that ends with its last response event or an error event, embeddings) or a documented
    refusal in OpenAI's error shape, never a 500; afterwards every block is free and the cluster serves."""
    model = api.models.list().data[0].id
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    statuses: collections.Counter = collections.Counter()
    stop_at = time.monotonic() + 40

    @settings(max_examples=120, database=None, derandomize=True, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data(), responses=st.booleans())
    def check(data, responses):
        if time.monotonic() > stop_at:
            statuses["skipped (time budget)"] += 1
            return
        body = data.draw(_responses_and_embeddings_bodies(model, responses, wild=data.draw(st.booleans())))
        response = _post_random(gateway, "/v1/responses" if responses else "/v1/embeddings", body, headers, statuses)
        if response is None:
            return
        if not responses:
            assert response.json()["data"], body
        elif body.get("stream") is True:
            events = [json.loads(line[len("data: "):]) for line in response.text.splitlines()
                      if line.startswith("data: ")]
            assert events and events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed",
                                                     "error"), (events[-2:], body)
        else:
            assert response.json()["object"] == "response" and response.json()["output"], body

    check()
    for route in ("/v1/responses", "/v1/embeddings"):
        assert statuses[(route, 200)] >= 3 and statuses[(route, 400)] >= 3, statuses
    wait_until(lambda: all_blocks_free(grpc_client), 30, message="every block free after the random bodies")
    assert grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2)).token_ids


def test_random_score_and_rerank_bodies_get_only_documented_statuses(api, gateway, cluster, grpc_client):
    """Hypothesis sends random JSON bodies to /v1/score and /v1/rerank: every answer is 200 with a score per pair
    (at most top_n results, in descending order) or a documented refusal in OpenAI's error shape; afterwards every
    block is free."""
    model = api.models.list().data[0].id
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    statuses: collections.Counter = collections.Counter()
    stop_at = time.monotonic() + 20

    def pick(wild, *valid):
        return st.one_of(st.sampled_from(valid), _WILD) if wild else st.sampled_from(valid)

    @settings(max_examples=60, database=None, derandomize=True, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data(), rerank=st.booleans(), wild=st.booleans())
    def check(data, rerank, wild):
        if time.monotonic() > stop_at:
            statuses["skipped (time budget)"] += 1
            return
        texts = pick(wild, PROMPT, [PROMPT], [PROMPT, "Paris."], ["Hi", "Hi", "Paris."], [PROMPT] * 17)
        # Valid values only, unless wild (wild bodies bring the refusals).
        common = {"model": pick(wild, model), "truncate_prompt_tokens": pick(wild, 2, -1), "priority": pick(wild, 0)}
        if rerank:
            documents = pick(wild, [PROMPT], [PROMPT, "Paris."], ["Hi", "Hi", "Paris."], [PROMPT] * 17)
            body = data.draw(st.fixed_dictionaries({"query": pick(wild, PROMPT, "Paris?"), "documents": documents},
                                                   optional={
                **common, "top_n": pick(wild, 0, 1, 3, -1), "return_documents": pick(wild, True, False)}))
        else:
            body = data.draw(st.fixed_dictionaries({"text_1": texts, "text_2": texts}, optional=common))
        response = _post_random(gateway, "/v1/rerank" if rerank else "/v1/score", body, headers, statuses)
        if response is None:
            return
        if rerank:
            scores = [result["relevance_score"] for result in response.json()["results"]]
            assert scores == sorted(scores, reverse=True) and 0 < len(scores) <= len(body["documents"]), body
            assert len(scores) == min(len(body["documents"]), body.get("top_n") or len(body["documents"])), body
        else:
            assert all(-1.0001 <= item["score"] <= 1.0001 for item in response.json()["data"]), body

    check()
    for route in ("/v1/score", "/v1/rerank"):
        assert statuses[(route, 200)] >= 3 and statuses[(route, 400)] >= 3, statuses
    wait_until(lambda: all_blocks_free(grpc_client), 30, message="every block free after the random bodies")


def test_random_bodies_get_only_documented_statuses_and_lose_nothing(api, gateway, cluster, grpc_client):
    """Hypothesis sends random JSON bodies to both generation routes: every answer is 200 (a complete answer, or a
    stream that ends in [DONE] or an error event) or a documented refusal (400, 404, 413, 429) in OpenAI's error
    shape; afterwards the cluster serves and every block is free."""
    model = api.models.list().data[0].id
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    statuses: collections.Counter = collections.Counter()
    stop_at = time.monotonic() + 60

    @settings(max_examples=150, database=None, derandomize=True, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data(), chat=st.booleans())
    def check(data, chat):
        if time.monotonic() > stop_at:
            statuses["skipped (time budget)"] += 1
            return
        body = data.draw(_body_fields(model, chat, wild=data.draw(st.booleans())))
        route = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            content = json.dumps(body, allow_nan=True)
        except (ValueError, OverflowError):
            return
        response = httpx.post(f"{gateway}{route}", content=content, headers=headers, timeout=60)
        statuses[response.status_code] += 1
        if response.status_code != 200:
            assert response.status_code in (400, 404, 413, 429), (response.status_code, response.text, body)
            error = response.json()["error"]
            assert error["message"] and error["type"], body
            return
        if body.get("stream") is True:
            events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events and (events[-1] == "[DONE]" or "error" in json.loads(events[-1])), (events[-3:], body)
        else:
            assert response.json()["choices"], body

    check()
    assert statuses[200] >= 10 and sum(statuses[code] for code in (400, 404)) >= 10, statuses
    wait_until(lambda: all_blocks_free(grpc_client), 30, message="every block free after the random bodies")
    status = grpc_client.cluster_status()
    assert all(worker.num_router_in_flight_requests == 0 for pool in status.pools for worker in pool.workers)
    assert grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2)).token_ids


def _streamed_calls(stream) -> tuple[dict, str, str]:
    """A streamed chat's tool calls put together as OpenAI's clients do ({index: (id, name, arguments)}), its
    content and its finish reason."""
    calls: dict = {}
    content, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                known = calls.setdefault(call.index, ["", "", ""])
                known[0] = call.id or known[0]
                known[1] = (call.function.name if call.function and call.function.name else known[1])
                known[2] += call.function.arguments or "" if call.function else ""
    return {index: tuple(value) for index, value in calls.items()}, content, finish


def test_a_named_tool_call_is_transformers_greedy_under_the_tools_schema(api, grpc_client, tokenizer, model_dir):
    """tool_choice naming a function: the answer is one call of it, its arguments the model's greedy tokens under
    the function's parameters schema, as transformers gives them on the prompt the template renders with the
    tools (finish "stop", as OpenAI says it for a named function); streamed, the arguments come in pieces."""
    from splitserve.common.chat import Chat
    from splitserve.common.structured_outputs import StructuredOutputsParams
    from tests.reference import hf_greedy_constrained

    model = api.models.list().data[0].id
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = api.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=[WEATHER, CLOCK],
                                       tool_choice=named, temperature=0, max_tokens=40)
    [choice] = chat.choices
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "stop" and choice.message.content is None
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    # The prompt: the router renders the tools into it exactly as transformers does with this template.
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(
        WEATHER_QUESTION, tools=[WEATHER, CLOCK], add_generation_prompt=True, chat_template=TOOLS_TEMPLATE.read_text(),
        tokenize=False), add_special_tokens=False)
    tokenized = httpx.post(f"{str(api.base_url).rstrip('/').removesuffix('/v1')}/tokenize",
                           json={"model": model, "messages": WEATHER_QUESTION, "tools": [WEATHER, CLOCK]},
                           headers={"authorization": f"Bearer {api.api_key}"}).json()
    assert tokenized["tokens"] == prompt_ids and "get_weather" in tokenizer.decode(prompt_ids)
    grammar = StructuredOutputsParams(json=WEATHER["function"]["parameters"]).to_grammar()
    expected = hf_greedy_constrained(str(model_dir), prompt_ids, 40, grammar, [tokenizer.eos_token_id])
    assert call.function.arguments == tokenizer.decode(expected)
    assert chat.usage.completion_tokens == len(expected)
    grpc_answer = grpc_client.generate(Chat.from_openai(WEATHER_QUESTION, [WEATHER, CLOCK]), SamplingParams(
        temperature=0, max_tokens=40, structured_outputs={"json": WEATHER["function"]["parameters"]}))
    assert list(grpc_answer.token_ids) == expected
    calls, content, finish = _streamed_calls(api.chat.completions.create(
        model=model, messages=WEATHER_QUESTION, tools=[WEATHER, CLOCK], tool_choice=named, temperature=0,
        max_tokens=40, stream=True))
    assert content == "" and finish == "stop" and len(calls) == 1
    assert calls[0][0].startswith("call_") and calls[0][1:] == ("get_weather", call.function.arguments)


def test_required_tool_calls_are_the_grpc_paths_and_a_conversation_goes_on(api, grpc_client, tokenizer):
    """tool_choice "required": one or more calls of the tools, each with arguments its schema allows, finish
    "tool_calls", the same streamed; parallel_tool_calls false makes it one. The calls and the tool's answer then
    go back in the conversation, rendered as transformers renders them."""
    model = api.models.list().data[0].id
    tools = [WEATHER, CLOCK]
    chat = api.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=tools, tool_choice="required",
                                       temperature=0, max_tokens=80)
    [choice] = chat.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time"), call
        if call.function.name == "get_weather":
            assert set(arguments) == {"city"}
    single = api.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=tools, tool_choice="required",
                                         parallel_tool_calls=False, temperature=0, max_tokens=80)
    assert len(single.choices[0].message.tool_calls) == 1
    calls, content, finish = _streamed_calls(api.chat.completions.create(
        model=model, messages=WEATHER_QUESTION, tools=tools, tool_choice="required", temperature=0, max_tokens=80,
        stream=True))
    assert finish == "tool_calls" and content == ""
    assert [value[1:] for _, value in sorted(calls.items())] == [
        (call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    # Cut short by max_tokens: no call, the JSON so far as content, finish "length".
    cut = api.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=tools, tool_choice="required",
                                      temperature=0, max_tokens=3)
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert cut.choices[0].message.content.startswith("[")
    # The conversation goes on: the assistant's calls and the tool's answer, then the model speaks again.
    conversation = [*WEATHER_QUESTION, choice.message.model_dump(exclude_none=True),
                    *({"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21, "sky": "clear"}'}
                      for call in choice.message.tool_calls)]
    rendered = tokenizer.apply_chat_template(
        [*WEATHER_QUESTION, {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                              "arguments": json.loads(call.function.arguments)}}
            for call in choice.message.tool_calls]}, *conversation[2:]],
        tools=tools, add_generation_prompt=True, chat_template=TOOLS_TEMPLATE.read_text(), tokenize=False)
    assert "<tool_response>" in rendered and '"arguments": {' in rendered
    tokenized = httpx.post(f"{str(api.base_url).rstrip('/').removesuffix('/v1')}/tokenize",
                           json={"model": model, "messages": conversation, "tools": tools},
                           headers={"authorization": f"Bearer {api.api_key}"}).json()
    assert tokenized["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    answer = api.chat.completions.create(model=model, messages=conversation, tools=tools, tool_choice="none",
                                         temperature=0, max_tokens=24)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    assert answer.choices[0].message.content == grpc_client.generate(
        _chat_of(conversation, tools), SamplingParams(temperature=0, max_tokens=24)).text


def _chat_of(messages: list, tools: list):
    from splitserve.common.chat import Chat

    return Chat.from_openai(messages, tools)


def test_auto_tool_choice_reads_hermes_calls_out_of_the_text(api, grpc_client):
    """tool_choice "auto" (the default with tools), with the gateway's hermes parser: a <tool_call> block in the
    answer (here forced by a regex, as this small model does not call tools by itself) is a call, finish
    "tool_calls", the text before it content, streamed as it comes; an answer without one is plain content."""
    model = api.models.list().data[0].id
    regex = r'Looking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>'
    forced = {"structured_outputs": {"regex": regex}}
    chat = api.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=[WEATHER, CLOCK],
                                       temperature=0, max_tokens=60, extra_body=forced)
    [choice] = chat.choices
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Looking.\n"
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    text = grpc_client.generate(_chat_of(WEATHER_QUESTION, [WEATHER, CLOCK]), SamplingParams(
        temperature=0, max_tokens=60, structured_outputs={"regex": regex})).text
    assert json.loads(call.function.arguments)["city"] == re.search(r'"city": "(\w+)"', text).group(1)
    calls, content, finish = _streamed_calls(api.chat.completions.create(
        model=model, messages=WEATHER_QUESTION, tools=[WEATHER, CLOCK], tool_choice="auto", temperature=0,
        max_tokens=60, stream=True, extra_body=forced))
    assert content == "Looking.\n" and finish == "tool_calls"
    assert calls[0][1:] == ("get_weather", call.function.arguments)
    plain = api.chat.completions.create(model=model, messages=QUESTION, tools=[CLOCK], temperature=0, max_tokens=16)
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content == grpc_client.generate(
        _chat_of(QUESTION, [CLOCK]), SamplingParams(temperature=0, max_tokens=16)).text


def test_bad_tool_requests_get_openai_errors(api):
    model = api.models.list().data[0].id
    named = {"type": "function", "function": {"name": "get_date"}}
    for fields, param, words in (
            ({"tools": [WEATHER], "tool_choice": named}, "tool_choice", "'get_date', which is not one of the tools"),
            ({"tools": []}, "tools", "non-empty list"),
            ({"tool_choice": "required"}, "tool_choice", "needs tools"),
            ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", "1 to 64 letters"),
            ({"tools": [WEATHER, WEATHER]}, "tools", "Two tools are named"),
            ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
             "tool_choice", "not both"),
            ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
            ({"functions": [WEATHER["function"]]}, "functions", "send tools instead")):
        extra = {key: value for key, value in fields.items() if key in ("functions", "parallel_tool_calls")}
        kwargs = {key: value for key, value in fields.items() if key not in extra}
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model=model, messages=WEATHER_QUESTION, max_tokens=2, extra_body=extra,
                                        **kwargs)
        assert words in refused.value.message and refused.value.param == param, fields
    # A tool schema llguidance cannot build is the router's refusal, with its sentence.
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                           "properties": {"x": {"type": "nothing"}}}}}
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model=model, messages=WEATHER_QUESTION, max_tokens=2, tools=[broken],
                                    tool_choice="required")
    assert "json" in refused.value.message


@pytest.fixture(scope="module")
def reasoning_api(cluster, tmp_path_factory):
    """A second gateway on the module's cluster, started with vLLM's --reasoning-parser qwen3 (and the hermes tool
    parser)."""
    log = tmp_path_factory.mktemp("reasoning-gateway") / "gateway.log"
    with running_gateway(cluster.router.address, log, "--reasoning-parser", "qwen3",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=cluster.api_key, max_retries=0, timeout=120)


def _streamed_reasoning(stream) -> tuple[str, str | None, str]:
    """A streamed chat's reasoning and content put together from its deltas (the reasoning field is vLLM's, an
    extra field to the openai package), and its finish reason."""
    reasoning, content, finish = "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


def test_the_reasoning_parser_splits_the_think_block_from_the_answer(reasoning_api, grpc_client):
    """With --reasoning-parser qwen3: the think block (forced by a regex: this small model writes none of its own)
    is the message's reasoning and the rest its content, which reassemble the gRPC path's text; streamed, the
    deltas add up to the same. A text without </think> is all reasoning (content null), as vLLM's qwen3 parser
    says it, unless the request turns thinking off in its chat_template_kwargs: then it is all content.
    /v1/completions is not split."""
    model = reasoning_api.models.list().data[0].id
    regex = "<think>[a-z ]{1,12}</think>[A-Za-z ]{1,12}"
    forced = {"structured_outputs": {"regex": regex}}
    text = grpc_client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=40,
                                                         structured_outputs={"regex": regex})).text
    assert re.fullmatch(regex, text)
    message = reasoning_api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=40,
                                                    extra_body=forced).choices[0].message
    assert message.reasoning and message.content
    assert f"<think>{message.reasoning}</think>{message.content}" == text
    reasoning, content, finish = _streamed_reasoning(reasoning_api.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=40, stream=True, extra_body=forced))
    assert (reasoning, content, finish) == (message.reasoning, message.content, "stop")
    plain = reasoning_api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=6)
    assert plain.choices[0].message.content is None
    plain_text = grpc_client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=6)).text
    assert plain.choices[0].message.reasoning == plain_text
    thinking_off = reasoning_api.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=6,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert (thinking_off.reasoning, thinking_off.content) == (None, plain_text)
    completion = reasoning_api.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=40,
                                                  extra_body=forced)
    assert completion.choices[0].text.startswith("<think>")


def test_the_usage_counts_the_think_blocks_tokens(reasoning_api, api, grpc_client, tokenizer):
    """With a reasoning parser the usage's reasoning tokens are the think block's tokens, tags left out (chat's
    completion_tokens_details, the Responses API's output_tokens_details), whole and streamed: here counted
    independently, by decoding the gRPC path's tokens. A block that never ends is every token; none with
    thinking off, and without a parser chat has no details and responses say 0."""
    model = reasoning_api.models.list().data[0].id
    regex = "<think>[a-z ]{1,12}</think>[A-Za-z ]{1,12}"
    forced = {"structured_outputs": {"regex": regex}}
    result = grpc_client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=40, structured_outputs=forced[
        "structured_outputs"]))
    ids = list(result.token_ids)
    opened = next(k for k in range(len(ids) + 1) if tokenizer.decode(ids[:k]) == "<think>")
    closed = max(k for k in range(len(ids) + 1) if len(tokenizer.decode(ids[:k])) <= result.text.index("</think>"))
    expected = closed - opened
    assert 0 < expected < len(ids) - 6  # the tags and the answer are not reasoning
    chat = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 40, "extra_body": forced}
    usage = reasoning_api.chat.completions.create(**chat).usage
    assert usage.completion_tokens == len(ids) and usage.completion_tokens_details.reasoning_tokens == expected
    [last] = [chunk for chunk in reasoning_api.chat.completions.create(
        **chat, stream=True, stream_options={"include_usage": True}) if chunk.usage is not None]
    assert last.usage.completion_tokens_details.reasoning_tokens == expected
    request = {"model": model, "input": QUESTION[0]["content"], "temperature": 0, "max_output_tokens": 40,
               "extra_body": forced}
    assert reasoning_api.responses.create(**request).usage.output_tokens_details.reasoning_tokens == expected
    events = list(reasoning_api.responses.create(**request, stream=True))
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == expected
    plain = reasoning_api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=6, n=2)
    assert plain.usage.completion_tokens_details.reasoning_tokens == 12  # no </think>: all of both choices
    thinking_off = reasoning_api.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=6,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thinking_off.usage.completion_tokens_details.reasoning_tokens == 0
    assert api.chat.completions.create(**chat).usage.completion_tokens_details is None
    assert api.responses.create(**request).usage.output_tokens_details.reasoning_tokens == 0


def test_tool_calls_come_from_the_content_after_the_think_block(reasoning_api):
    """With a reasoning parser, the hermes parser reads calls out of the content only: a <tool_call> after
    </think> is a call, the think block the reasoning (whole and streamed)."""
    model = reasoning_api.models.list().data[0].id
    regex = (r'<think>[a-z ]{1,12}</think><tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>')
    forced = {"structured_outputs": {"regex": regex}}
    [choice] = reasoning_api.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=[WEATHER, CLOCK],
                                                     temperature=0, max_tokens=60, extra_body=forced).choices
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.reasoning
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    stream = list(reasoning_api.chat.completions.create(model=model, messages=WEATHER_QUESTION,
                                                        tools=[WEATHER, CLOCK], temperature=0, max_tokens=60,
                                                        stream=True, extra_body=forced))
    assert _streamed_reasoning(stream)[0] == choice.message.reasoning
    calls, content, finish = _streamed_calls(stream)
    assert content == "" and finish == "tool_calls" and calls[0][1:] == ("get_weather", call.function.arguments)


def test_an_unknown_reasoning_parser_is_refused_at_start():
    for command in (["gateway", "--router", "127.0.0.1:1"], ["up", "--http-port", "0"]):
        refused = subprocess.run([sys.executable, "-m", "splitserve.cli", *command, "--reasoning-parser", "granite"],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2, refused.stderr
        assert "argument --reasoning-parser: invalid choice: 'granite' (choose from 'deepseek_r1', 'qwen3')" \
            in refused.stderr


# ---- the Responses API (/v1/responses) --------------------------------------------------------------------------

RESPONSE_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                   "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                   "response.content_part.done", "response.output_item.done"]


def _event_kinds(events: list) -> list[str]:
    """The events' types with each run of deltas as one."""
    kinds = [event.type for event in events]
    return [kind for index, kind in enumerate(kinds) if index == 0 or kind != kinds[index - 1]]


def test_a_response_is_the_grpc_paths_greedy_chat_whole_and_streamed(api, grpc_client):
    """client.responses.create: instructions are a system message first, input the user's; greedy, the text is
    the gRPC path's chat output for the same messages, whole and streamed (the SDK's events in its order, numbered
    from 0); message items with input_text parts are the same chat; max_output_tokens cuts it: incomplete."""
    model = api.models.list().data[0].id
    instructions = "Answer in one short sentence."
    expected = grpc_client.generate([{"role": "system", "content": instructions}, *QUESTION],
                                    SamplingParams(temperature=0, max_tokens=48))
    response = api.responses.create(model=model, instructions=instructions, input=QUESTION[0]["content"],
                                    temperature=0, max_output_tokens=48)
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == expected.text and [item.type for item in response.output] == ["message"]
    assert response.output[0].content[0].annotations == []
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.usage.output_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert (response.temperature, response.max_output_tokens, response.instructions) == (0, 48, instructions)
    events = list(api.responses.create(model=model, instructions=instructions, input=QUESTION[0]["content"],
                                       temperature=0, max_output_tokens=48, stream=True))
    assert _event_kinds(events) == [*RESPONSE_EVENTS, "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == expected.text
    assert events[-1].response.output_text == expected.text and events[-1].response.id == events[0].response.id
    # Message items with text parts: the chat of QUESTION, as /v1/chat/completions' greedy answer.
    chat = grpc_client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=48)).text
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the capital "},
                                                             {"type": "input_text", "text": "of France?"}]}]
    assert api.responses.create(model=model, input=items, temperature=0, max_output_tokens=48).output_text == chat
    cut = api.responses.create(model=model, input=QUESTION[0]["content"], temperature=0, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and chat.startswith(cut.output_text)
    cut_events = list(api.responses.create(model=model, input=QUESTION[0]["content"], temperature=0,
                                           max_output_tokens=3, stream=True))
    assert cut_events[-1].type == "response.incomplete" and cut_events[-1].response.output_text == cut.output_text


def test_a_response_takes_a_json_schema_text_format_and_refuses_what_needs_state(api, gateway, cluster, grpc_client):
    """text.format json_schema is the structured outputs constraint (the gRPC path's tokens under the same
    schema); what needs stored responses, server-side tools and encrypted reasoning are refused with OpenAI's
    error, 400, the field named."""
    model = api.models.list().data[0].id
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
              "additionalProperties": False}
    response = api.responses.create(model=model, input=QUESTION[0]["content"], temperature=0, max_output_tokens=40,
                                    text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                     "strict": True}})
    expected = grpc_client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=40,
                                                             structured_outputs={"json": schema}))
    assert response.output_text == expected.text and set(json.loads(response.output_text)) == {"city"}
    refused = {"previous_response_id": "resp_123", "background": True, "tools": [{"type": "web_search"}],
               "include": ["reasoning.encrypted_content"], "truncation": "auto"}
    for field, sent in refused.items():
        with pytest.raises(openai.BadRequestError) as bad:
            api.responses.create(model=model, input="Hi", **{field: sent})
        assert bad.value.status_code == 400 and bad.value.param == field
    answer = httpx.post(f"{gateway}/v1/responses", json={"model": model, "input": [{"role": "tool", "content": "x"}]},
                        headers={"authorization": f"Bearer {cluster.api_key}"})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["type"] == "invalid_request_error" and error["param"] == "input"
    assert error["message"].endswith(".") and error["code"] is None
    assert api.responses.create(model=model, input="Hi", max_output_tokens=2, store=True).status == "incomplete"
    wait_until(lambda: all_blocks_free(grpc_client), 20, message="every block free after the responses")


def test_a_responses_logprobs_are_the_grpc_paths_whole_and_streamed(api, grpc_client):
    """include message.output_text.logprobs with top_logprobs 2: the message's text part carries one entry per
    generated token (the end of sequence last, as the chat route's), the gRPC path's logprobs and alternatives;
    streamed, the deltas' entries add up to the same, and the done events carry them all. With function tools
    they are refused (400 naming include)."""
    model = api.models.list().data[0].id
    expected = grpc_client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=48, logprobs=2))
    asked = dict(model=model, input=QUESTION[0]["content"], temperature=0, max_output_tokens=48,
                 include=["message.output_text.logprobs"], top_logprobs=2)
    response = api.responses.create(**asked)
    assert response.output_text == expected.text and response.top_logprobs == 2
    entries = response.output[0].content[0].logprobs
    assert [entry.token for entry in entries] == [position.sampled.text for position in expected.logprobs]
    assert [entry.logprob for entry in entries] == pytest.approx([p.sampled.logprob for p in expected.logprobs])
    assert "".join(entry.token for entry in entries[:-1]) == expected.text
    for entry, position in zip(entries, expected.logprobs):
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert [top.token for top in entry.top_logprobs] == [top.text for top in position.top]
    events = list(api.responses.create(**asked, stream=True))
    streamed = [entry for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    done = next(event for event in events if event.type == "response.output_text.done")
    final = events[-1].response.output[0].content[0].logprobs
    assert [entry.token for entry in done.logprobs] == [entry.token for entry in final] == [e.token for e in entries]
    assert [entry.token for entry in streamed] == [e.token for e in entries][:len(streamed)]
    assert "".join(entry.token for entry in streamed) == expected.text  # the end of sequence has no delta of its own
    assert api.responses.create(model=model, input="Hi", max_output_tokens=2).output[0].content[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as bad:
        api.responses.create(**asked, tools=[{"type": "function", "name": "get_time"}])
    assert bad.value.param == "include" and "not available with function tools" in bad.value.message
    wait_until(lambda: all_blocks_free(grpc_client), 20, message="every block free after the responses")


def test_a_responses_stream_left_mid_way_frees_its_blocks(gateway, cluster, grpc_client):
    body = {"input": PROMPT * 20, "max_output_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", f"{gateway}/v1/responses", json=body, timeout=60,
                      headers={"authorization": f"Bearer {cluster.api_key}"}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("event: ")) == "event: response.created"
        next(line for line in lines if line == "event: response.output_text.delta")
        wait_until(lambda: not all_blocks_free(grpc_client), 10, message="the request holds blocks while it runs")
    wait_until(lambda: all_blocks_free(grpc_client), 20, message="every block freed after the disconnect")
    assert time.monotonic() - started < 40


def test_a_response_with_a_reasoning_parser_has_a_reasoning_item_first(reasoning_api, grpc_client):
    """With --reasoning-parser qwen3, the think block (forced by a regex) is a reasoning item of reasoning_text
    before the message, whole and streamed, and both reassemble the gRPC path's text."""
    model = reasoning_api.models.list().data[0].id
    regex = "<think>[a-z ]{1,12}</think>[A-Za-z ]{1,12}"
    text = grpc_client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=40,
                                                         structured_outputs={"regex": regex})).text
    request = {"model": model, "input": QUESTION[0]["content"], "temperature": 0, "max_output_tokens": 40,
               "extra_body": {"structured_outputs": {"regex": regex}}}
    response = reasoning_api.responses.create(**request)
    thought, message = response.output
    assert (thought.type, message.type) == ("reasoning", "message")
    assert f"<think>{thought.content[0].text}</think>{response.output_text}" == text
    events = list(reasoning_api.responses.create(**request, stream=True))
    reasoning = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    content = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert (reasoning, content) == (thought.content[0].text, response.output_text)
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    assert [event.sequence_number for event in events] == list(range(len(events)))


# Function tools as the Responses API writes them: flat, not nested under "function" (strict: the SDK's stream
# helper then parses the arguments).
RESPONSES_TOOLS = [{"type": "function", **WEATHER["function"], "strict": True}, {"type": "function", **CLOCK["function"]}]


def _call_items(response) -> list[tuple[str, str]]:
    """A response's function_call items as (name, arguments), after checking their ids and status."""
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    return [(call.name, call.arguments) for call in calls]


def test_a_named_function_call_response_is_the_chat_routes_call_whole_and_streamed(api):
    """tool_choice naming a function (the Responses API's flat form): the output is one function_call item whose
    arguments are JSON under the tool's schema, the same greedy arguments the chat route gives for the same forced
    call; streamed, the call's events come in the SDK's order and the SDK's stream helper puts the same call
    together."""
    model = api.models.list().data[0].id
    request = {"model": model, "input": WEATHER_QUESTION[0]["content"], "tools": RESPONSES_TOOLS,
               "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0, "max_output_tokens": 40}
    response = api.responses.create(**request)
    assert response.status == "completed" and [item.type for item in response.output] == ["function_call"]
    [(name, arguments)] = _call_items(response)
    assert name == "get_weather" and set(json.loads(arguments)) == {"city"}
    assert isinstance(json.loads(arguments)["city"], str) and len(json.loads(arguments)["city"]) <= 20
    assert response.tool_choice.name == "get_weather" and [tool.name for tool in response.tools] == [
        "get_weather", "get_time"]
    chat = api.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=[WEATHER, CLOCK], temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=40)
    assert chat.choices[0].message.tool_calls[0].function.arguments == arguments
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                           chat.usage.completion_tokens)
    events = list(api.responses.create(**request, stream=True))
    assert _event_kinds(events) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert (events[2].item.status, events[2].item.arguments) == ("in_progress", "")
    assert "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta") == \
        arguments == events[-3].arguments
    assert _call_items(events[-1].response) == [(name, arguments)]
    with api.responses.stream(**request) as stream:
        final = stream.get_final_response()
    assert _call_items(final) == [(name, arguments)] and final.output[0].parsed_arguments == json.loads(arguments)


def test_required_and_auto_calls_are_the_chat_routes_whole_and_streamed(api):
    """tool_choice "required": the calls are function_call items, the chat route's calls in order, the same
    streamed. "auto" with the hermes parser (the <tool_call> block forced by a regex, as in the chat test): the
    text before it is a message item, then the call, whole and streamed, the chat route's call."""
    model = api.models.list().data[0].id
    question = WEATHER_QUESTION[0]["content"]
    required = api.responses.create(model=model, input=question, tools=RESPONSES_TOOLS, tool_choice="required",
                                    temperature=0, max_output_tokens=80)
    chat = api.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=[WEATHER, CLOCK],
                                       tool_choice="required", temperature=0, max_tokens=80)
    expected = [(call.function.name, call.function.arguments) for call in chat.choices[0].message.tool_calls]
    assert _call_items(required) == expected and required.output_text == ""
    events = list(api.responses.create(model=model, input=question, tools=RESPONSES_TOOLS, tool_choice="required",
                                       temperature=0, max_output_tokens=80, stream=True))
    assert _call_items(events[-1].response) == expected
    assert [event.item.name for event in events if event.type == "response.output_item.done"] == [
        name for name, _ in expected]
    regex = r'Looking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>'
    forced = {"structured_outputs": {"regex": regex}}
    auto = api.responses.create(model=model, input=question, tools=RESPONSES_TOOLS, temperature=0,
                                max_output_tokens=60, extra_body=forced)
    [choice] = api.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=[WEATHER, CLOCK],
                                           temperature=0, max_tokens=60, extra_body=forced).choices
    assert [item.type for item in auto.output] == ["message", "function_call"] and auto.output_text == "Looking.\n"
    assert _call_items(auto) == [("get_weather", choice.message.tool_calls[0].function.arguments)]
    auto_events = list(api.responses.create(model=model, input=question, tools=RESPONSES_TOOLS, tool_choice="auto",
                                            temperature=0, max_output_tokens=60, stream=True, extra_body=forced))
    assert _event_kinds(auto_events) == [*RESPONSE_EVENTS, "response.output_item.added",
                                         "response.function_call_arguments.delta",
                                         "response.function_call_arguments.done", "response.output_item.done",
                                         "response.completed"]
    assert _call_items(auto_events[-1].response) == _call_items(auto)
    assert auto_events[-1].response.output_text == "Looking.\n"


def test_a_conversation_goes_on_with_the_function_call_and_its_output_sent_back(api, grpc_client):
    """The usual loop, stateless: the call the model made and the caller's function_call_output go back as input
    items, and the model answers with a message: greedy, the gRPC path's answer to the same conversation as chat
    messages (an assistant message with the tool call, then a tool message), and the chat route's."""
    model = api.models.list().data[0].id
    named = {"type": "function", "name": "get_weather"}
    first = api.responses.create(model=model, input=WEATHER_QUESTION[0]["content"], tools=RESPONSES_TOOLS,
                                 tool_choice=named, temperature=0, max_output_tokens=40)
    [call] = first.output
    output = '{"celsius": 21, "sky": "clear"}'
    items = [*WEATHER_QUESTION, *(item.model_dump(exclude_none=True) for item in first.output),
             {"type": "function_call_output", "call_id": call.call_id, "output": output}]
    answer = api.responses.create(model=model, input=items, tools=RESPONSES_TOOLS, tool_choice="none",
                                  temperature=0, max_output_tokens=24)
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    conversation = [*WEATHER_QUESTION, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": output}]
    assert answer.output_text == grpc_client.generate(_chat_of(conversation, [WEATHER, CLOCK]),
                                                      SamplingParams(temperature=0, max_tokens=24)).text
    chat = api.chat.completions.create(model=model, messages=conversation, tools=[WEATHER, CLOCK], tool_choice="none",
                                       temperature=0, max_tokens=24)
    assert chat.choices[0].message.content == answer.output_text
    assert answer.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens


def test_bad_function_tool_requests_get_openai_errors(api):
    """Tools the gateway would have to run itself, a tool_choice it cannot honour, an output for a call never made:
    400, OpenAI's error, the field named, a sentence saying what is wrong."""
    model = api.models.list().data[0].id
    question = WEATHER_QUESTION[0]["content"]
    for fields, param, words in (
            ({"tools": [{"type": "web_search"}]}, "tools", "tools[0] is a tool of type 'web_search'"),
            ({"tools": [*RESPONSES_TOOLS, {"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools",
             "tools[2] is a tool of type 'code_interpreter'"),
            ({"tools": [{"type": "function", "name": "get weather"}]}, "tools", "tools[0].name must be"),
            ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "get_date"}}, "tool_choice",
             "'get_date', which is not one of the tools"),
            ({"tool_choice": "required"}, "tool_choice", "needs tools"),
            ({"tools": RESPONSES_TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
             "tool_choice", "not both"),
            ({"input": [*WEATHER_QUESTION, {"type": "function_call_output", "call_id": "call_1", "output": "{}"}]},
             "input", "no function_call item before it"),
            ({"input": [{"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": {}}]},
             "input", "input[0].arguments must be a string")):
        with pytest.raises(openai.BadRequestError) as refused:
            api.responses.create(**{"model": model, "input": question, "max_output_tokens": 2, **fields})
        assert refused.value.status_code == 400 and refused.value.param == param, fields
        assert words in refused.value.message and refused.value.message.endswith("."), refused.value.message


def test_a_response_with_a_reasoning_parser_has_its_reasoning_item_before_the_call(reasoning_api):
    """With --reasoning-parser qwen3 and "auto": a think block then a <tool_call> (forced by a regex) is a
    reasoning item, then the call, no message; streamed the same."""
    model = reasoning_api.models.list().data[0].id
    regex = (r'<think>[a-z ]{1,12}</think><tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>')
    request = {"model": model, "input": WEATHER_QUESTION[0]["content"], "tools": RESPONSES_TOOLS, "temperature": 0,
               "max_output_tokens": 60, "extra_body": {"structured_outputs": {"regex": regex}}}
    response = reasoning_api.responses.create(**request)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    [(name, arguments)] = _call_items(response)
    assert name == "get_weather" and set(json.loads(arguments)) == {"city"}
    events = list(reasoning_api.responses.create(**request, stream=True))
    assert [item.type for item in events[-1].response.output] == ["reasoning", "function_call"]
    assert _call_items(events[-1].response) == [(name, arguments)]
    assert events[-1].response.output[0].content[0].text == response.output[0].content[0].text


def test_scores_and_rerank_are_the_embeddings_cosine_similarities(api, grpc_client, gateway, cluster):
    """vLLM's /score and /rerank for the served model as an embedding model: each pair's score is the cosine
    similarity of the router's Embed vectors of its texts, one against many or pairwise; rerank orders the
    documents by it and keeps top_n; every distinct text is embedded once and counted; bad bodies get 400."""
    import numpy

    model = api.models.list().data[0].id
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    query = "What is the capital of France?"
    documents = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "Paris is in France.",
                 "The capital of France is Paris."]  # a repeat: embedded once, ranked twice
    vectors = {text: numpy.array(grpc_client.embed(text), dtype=numpy.float64) for text in [query, *documents]}
    tokens = {text: len(grpc_client.tokenize(text)) for text in vectors}

    def cosine(first, second):
        return float(vectors[first] @ vectors[second] / numpy.linalg.norm(vectors[first])
                     / numpy.linalg.norm(vectors[second]))

    expected = [cosine(query, document) for document in documents]
    assert len({round(score, 6) for score in expected}) == 3  # the order below is the scores', not the input's
    for path in ("/score", "/v1/score"):
        reply = httpx.post(f"{gateway}{path}", headers=headers, json={"model": model, "text_1": query,
                                                                       "text_2": documents})
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["object"] == "list" and answer["id"].startswith("score-") and answer["model"] == model
        assert [item["index"] for item in answer["data"]] == [0, 1, 2, 3]
        assert numpy.allclose([item["score"] for item in answer["data"]], expected, atol=1e-5)
        assert answer["usage"]["prompt_tokens"] == sum(tokens[text] for text in [query, *documents[:3]])
    pairwise = httpx.post(f"{gateway}/v1/score", headers=headers,
                          json={"text_1": documents[:2], "text_2": [documents[2], query]}).json()
    assert numpy.allclose([item["score"] for item in pairwise["data"]],
                          [cosine(documents[0], documents[2]), cosine(documents[1], query)], atol=1e-5)
    one = httpx.post(f"{gateway}/score", headers=headers, json={"text_1": [query], "text_2": query}).json()
    assert abs(one["data"][0]["score"] - 1.0) < 1e-5 and one["usage"]["prompt_tokens"] == tokens[query]

    order = sorted(range(len(documents)), key=lambda index: -expected[index])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        reply = httpx.post(f"{gateway}{path}", headers=headers, json={"model": model, "query": query,
                                                                       "documents": documents})
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["id"].startswith("rerank-") and answer["model"] == model
        assert [result["index"] for result in answer["results"]] == order
        assert [result["document"]["text"] for result in answer["results"]] == [documents[i] for i in order]
        assert numpy.allclose([result["relevance_score"] for result in answer["results"]],
                              [expected[i] for i in order], atol=1e-5)
        assert answer["usage"]["total_tokens"] == sum(tokens[text] for text in [query, *documents[:3]])
    top = httpx.post(f"{gateway}/v1/rerank", headers=headers,
                     json={"query": query, "documents": documents, "top_n": 2, "return_documents": False}).json()
    assert [result["index"] for result in top["results"]] == order[:2]
    assert all("document" not in result for result in top["results"])
    truncated = httpx.post(f"{gateway}/v1/rerank", headers=headers,
                           json={"query": query, "documents": documents[:2], "truncate_prompt_tokens": 3}).json()
    assert truncated["usage"]["total_tokens"] == 9  # three texts, their last 3 tokens each

    for route, body, param in (
            ("/v1/score", {"text_1": query}, "text_2"), ("/v1/score", {"text_1": 5, "text_2": query}, "text_1"),
            ("/v1/score", {"text_1": [], "text_2": query}, "text_1"),
            ("/v1/score", {"text_1": [query, query], "text_2": documents}, "text_1"),
            ("/v1/score", {"text_1": query, "text_2": [str(n) for n in range(17)]}, "text_2"),
            ("/v1/rerank", {"documents": documents}, "query"), ("/v1/rerank", {"query": query}, "documents"),
            ("/v1/rerank", {"query": query, "documents": [query, 7]}, "documents"),
            ("/v1/rerank", {"query": query, "documents": documents, "top_n": -1}, "top_n"),
            ("/v1/rerank", {"query": query, "documents": documents, "return_documents": "no"}, "return_documents"),
            ("/v1/rerank", {"query": query, "documents": documents, "truncate_prompt_tokens": 0},
             "truncate_prompt_tokens"),
            ("/v1/rerank", {"query": query, "documents": documents, "model": "nope"}, "model")):
        refused = httpx.post(f"{gateway}{route}", headers=headers, json=body)
        assert refused.status_code in (400, 404), (route, body, refused.text)
        assert refused.json()["error"]["param"] == param, (route, body, refused.text)
    assert httpx.post(f"{gateway}/v1/rerank", json={"query": query, "documents": documents}).status_code == 401
    wait_until(lambda: all_blocks_free(grpc_client), 15, message="all KV blocks free")


def test_use_beam_search_answers_transformers_beams_through_the_router(api, gateway, cluster, grpc_client,
                                                                     model_dir, tokenizer):
    """vLLM's use_beam_search on completions and chats: n beams stepped through the router, best first, each
    transformers' beam (float32) in text and finish reason, the usage counted, with logprobs each token's
    transformers' log probability and the best 2 candidates; what a beam search cannot give is refused with the
    field named."""
    from tests.reference import hf_beams, hf_prompt_logprobs

    model = api.models.list().data[0].id
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    eos = set(grpc_client.model_info().eos_token_ids)

    def expected(ids: list[int], width: int, max_tokens: int) -> list[tuple[str, str, int]]:
        beams = hf_beams(str(model_dir), ids, width, max_tokens)
        return [(tokenizer.decode(beam[:-1] if beam[-1] in eos else beam, skip_special_tokens=True),
                 "stop" if beam[-1] in eos else "length", len(beam)) for beam in beams]

    ids = grpc_client.tokenize(PROMPT)
    reply = httpx.post(f"{gateway}/v1/completions", headers=headers, timeout=120, json={
        "model": model, "prompt": PROMPT, "n": 4, "max_tokens": 12, "use_beam_search": True, "logprobs": 2})
    assert reply.status_code == 200, reply.text
    answer, beams = reply.json(), expected(ids, 4, 12)
    for choice, beam_ids in zip(answer["choices"], hf_beams(str(model_dir), ids, 4, 12)):
        reference, logprobs = hf_prompt_logprobs(str(model_dir), tuple(ids + beam_ids)), choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(beam_ids) == len(logprobs["top_logprobs"])
        for offset, (logprob, top) in enumerate(zip(logprobs["token_logprobs"], logprobs["top_logprobs"])):
            assert logprob == pytest.approx(reference[len(ids) + offset - 1, beam_ids[offset]].item(), abs=1e-3)
            assert max(top.values()) == pytest.approx(reference[len(ids) + offset - 1].max().item(), abs=1e-3)
    assert [(choice["text"], choice["finish_reason"]) for choice in answer["choices"]] == [b[:2] for b in beams]
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2, 3]
    assert answer["usage"] == {"prompt_tokens": len(ids), "completion_tokens": sum(b[2] for b in beams),
                               "total_tokens": len(ids) + sum(b[2] for b in beams)}
    chat_ids = httpx.post(f"{gateway}/tokenize", headers=headers, json={"model": model, "messages": QUESTION}
                          ).json()["tokens"]
    reply = httpx.post(f"{gateway}/v1/chat/completions", headers=headers, timeout=120, json={
        "model": model, "messages": QUESTION, "n": 2, "max_completion_tokens": 10, "use_beam_search": True,
        "logprobs": True})
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["object"] == "chat.completion"
    assert [len(choice["logprobs"]["content"]) for choice in answer["choices"]] == [
        b[2] for b in expected(chat_ids, 2, 10)]
    assert [(choice["message"]["content"], choice["finish_reason"]) for choice in answer["choices"]] == [
        b[:2] for b in expected(chat_ids, 2, 10)]
    for body, param in (({"stream": True}, "stream"), ({"logprobs": 3}, "logprobs"), ({"n": 11}, "n"),
                        ({"max_tokens": 0}, "max_tokens"), ({"length_penalty": "long"}, "length_penalty"),
                        ({"use_beam_search": "yes"}, "use_beam_search")):
        refused = httpx.post(f"{gateway}/v1/completions", headers=headers, json={
            "model": model, "prompt": PROMPT, "use_beam_search": True, **body})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (body, refused.text)
    wait_until(lambda: all_blocks_free(grpc_client), 15, message="all KV blocks free")


def test_sagemakers_ping_and_invocations_are_vllms(api, gateway, cluster):
    """SageMaker's routes as vLLM serves them: /ping is /health (GET or POST, no key), and /invocations answers
    as the route its body's fields name, streams included; a body naming none is 400."""
    model = api.models.list().data[0].id
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    assert httpx.get(f"{gateway}/ping").json() == httpx.post(f"{gateway}/ping").json() == {"status": "ok"}

    def both(route: str, body: dict) -> tuple[dict, dict]:
        answers = [httpx.post(f"{gateway}{path}", headers=headers, json={"model": model, **body}, timeout=60)
                   for path in (route, "/invocations")]
        assert [answer.status_code for answer in answers] == [200, 200], [answer.text for answer in answers]
        return answers[0].json(), answers[1].json()

    direct, invoked = both("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4, "temperature": 0})
    assert invoked["object"] == "chat.completion"
    assert invoked["choices"][0]["message"] == direct["choices"][0]["message"]
    direct, invoked = both("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert invoked["object"] == "text_completion" and invoked["choices"][0]["text"] == direct["choices"][0]["text"]
    direct, invoked = both("/v1/embeddings", {"input": PROMPT})
    assert invoked["data"][0]["embedding"] == direct["data"][0]["embedding"]
    direct, invoked = both("/v1/score", {"text_1": PROMPT, "text_2": ["Paris.", "Rome."]})
    assert [item["score"] for item in invoked["data"]] == [item["score"] for item in direct["data"]]
    direct, invoked = both("/v1/rerank", {"query": PROMPT, "documents": ["Paris.", "Rome."]})
    assert invoked["results"] == direct["results"]
    streamed = httpx.post(f"{gateway}/invocations", headers=headers, json={
        "model": model, "messages": QUESTION, "max_tokens": 2, "temperature": 0, "stream": True}, timeout=60)
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    refused = httpx.post(f"{gateway}/invocations", headers=headers, json={"model": model, "text": PROMPT})
    assert refused.status_code == 400 and "names its kind by its fields" in refused.json()["error"]["message"]
    assert httpx.post(f"{gateway}/invocations", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 401


def test_embeddings_are_the_grpc_paths(api, grpc_client, gateway, cluster):
    """/v1/embeddings through the openai package (which asks for base64 and decodes it): each input's vector is
    the router's Embed, in order, with the prompt tokens counted; floats, a Matryoshka cut and token ids as well;
    bad requests get 400 with the field named, and the cluster serves on with every block free."""
    import numpy

    model = api.models.list().data[0].id
    texts = ["The capital of France is Paris.", "def add(a, b):\n    return a + b"]
    expected = [grpc_client.embed(text) for text in texts]
    counts = [len(grpc_client.tokenize(text)) for text in texts]
    reply = api.embeddings.create(model=model, input=texts)
    assert [item.index for item in reply.data] == [0, 1] and reply.model == model
    for item, vector in zip(reply.data, expected):
        assert numpy.allclose(item.embedding, vector, atol=1e-5)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(counts)
    ids = grpc_client.tokenize(texts[0])
    cut = api.embeddings.create(model=model, input=[ids], encoding_format="float", dimensions=64)
    assert numpy.allclose(cut.data[0].embedding, grpc_client.embed(ids, dimensions=64), atol=1e-5)
    assert len(cut.data[0].embedding) == 64
    last = api.embeddings.create(model=model, input=texts, encoding_format="float",
                                 extra_body={"truncate_prompt_tokens": 4})  # vLLM's: each input's last 4 tokens
    assert last.usage.prompt_tokens == 8
    for item, text in zip(last.data, texts):
        assert numpy.allclose(item.embedding, grpc_client.embed(grpc_client.tokenize(text)[-4:]), atol=1e-5)
    assert numpy.allclose(grpc_client.embed(texts[1], truncate_prompt_tokens=4), last.data[1].embedding, atol=1e-5)
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    for body, param in (({"input": []}, "input"), ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "x", "dimensions": 0}, "dimensions"), ({"input": "x", "dimensions": 100000}, None),
                        ({"input": ["x"] * 17}, "input"), ({"input": "x", "truncate_prompt_tokens": 0},
                                                           "truncate_prompt_tokens"),
                        ({"input": "x", "cache_salt": ""}, "cache_salt"),
                        ({"input": "x", "priority": "high"}, "priority"), ({"input": "x", "priority": 2}, None),
                        ({"input": "x", "messages": QUESTION}, "messages"), ({"messages": []}, "messages"),
                        ({"messages": QUESTION, "add_generation_prompt": "yes"}, "add_generation_prompt")):
        refused = httpx.post(f"{gateway}/v1/embeddings", headers=headers, json={"model": model, **body})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["message"] and (param is None or error["param"] == param), error
    assert "hidden size" in httpx.post(f"{gateway}/v1/embeddings", headers=headers,
                                       json={"input": "x", "dimensions": 100000}).json()["error"]["message"]
    # A priority reaches the workers, which serve first come, first served here and say so.
    assert "--scheduling-policy priority" in httpx.post(f"{gateway}/v1/embeddings", headers=headers,
                                                        json={"input": "x", "priority": 2}).json()["error"]["message"]
    assert numpy.allclose(api.embeddings.create(model=model, input=texts[1]).data[0].embedding, expected[1],
                          atol=1e-5)
    wait_until(lambda: all_blocks_free(grpc_client), 15, message="all KV blocks free")


def test_a_chat_is_embedded_as_the_grpc_path_embeds_it(api, grpc_client, gateway, cluster):
    """vLLM's messages in place of input: the chat through the template, without the assistant's opening unless
    add_generation_prompt asks for it (vLLM's default for embeddings), is the router's Embed of the same chat."""
    import numpy

    from splitserve.client import embed_request
    from splitserve.common.chat import Chat

    model = api.models.list().data[0].id
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    replies = {}
    for opening in (False, True):
        expected = grpc_client.stub.Embed(embed_request(Chat.from_openai(QUESTION, add_generation_prompt=opening)),
                                          timeout=60)
        body = {"model": model, "messages": QUESTION, "encoding_format": "float",
                **({"add_generation_prompt": True} if opening else {})}
        replies[opening] = httpx.post(f"{gateway}/v1/embeddings", headers=headers, json=body, timeout=60).json()
        [item] = replies[opening]["data"]
        assert numpy.allclose(item["embedding"], list(expected.embedding), atol=1e-5), opening
        assert replies[opening]["usage"]["prompt_tokens"] == expected.prompt_tokens
    # The opening is tokens more, and another last token: another vector.
    assert replies[True]["usage"]["prompt_tokens"] > replies[False]["usage"]["prompt_tokens"]
    assert not numpy.allclose(replies[True]["data"][0]["embedding"], replies[False]["data"][0]["embedding"],
                              atol=1e-3)
    wait_until(lambda: all_blocks_free(grpc_client), 15, message="all KV blocks free")


def test_return_token_ids_gives_the_prompts_ids_and_each_choices(api, gateway, cluster, grpc_client):
    """vLLM's return_token_ids: each completion choice carries its prompt's token ids (the router's Tokenize of it)
    and its generated ids (the gRPC path's greedy tokens, asked for the prompt's ids too), whole and streamed (the
    prompt's on a choice's first chunk, each chunk its new ids); a chat answer carries its prompt's ids once (its
    template rendered, as /tokenize gives them; a stream's first chunk) and each choice its own; without the field
    neither is there, and a value other than true or false is 400."""
    model = api.models.list().data[0].id
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = grpc_client.generate(PROMPT, params, return_prompt_token_ids=True)
    assert list(expected.prompt_token_ids) == grpc_client.tokenize(PROMPT) and len(expected.token_ids) > 1
    asked = {"return_token_ids": True}
    whole = api.completions.create(model=model, prompt=[PROMPT, PROMPT], max_tokens=12, temperature=0, extra_body=asked)
    assert [(c.prompt_token_ids, c.token_ids, c.text) for c in whole.choices] == [
        (list(expected.prompt_token_ids), list(expected.token_ids), expected.text)] * 2
    chunks = list(api.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                         extra_body=asked))
    assert [getattr(c.choices[0], "prompt_token_ids", None) is not None for c in chunks] == [True] + [False] * (
        len(chunks) - 1) and chunks[0].choices[0].prompt_token_ids == list(expected.prompt_token_ids)
    assert [token for c in chunks for token in c.choices[0].token_ids] == list(expected.token_ids)
    plain = api.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    assert getattr(plain.choices[0], "token_ids", None) is None and getattr(plain.choices[0], "prompt_token_ids",
                                                                            None) is None
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    rendered = httpx.post(f"{gateway}/tokenize", headers=headers, json={"model": model, "messages": QUESTION}).json()
    chat_expected = grpc_client.generate(QUESTION, params, return_prompt_token_ids=True)
    assert list(chat_expected.prompt_token_ids) == rendered["tokens"]
    chat = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0, n=2,
                                       extra_body=asked)
    assert chat.prompt_token_ids == rendered["tokens"]
    assert [c.token_ids for c in chat.choices] == [list(chat_expected.token_ids)] * 2
    assert chat.choices[0].message.content == chat_expected.text
    chat_chunks = list(api.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0,
                                                   stream=True, extra_body=asked))
    assert chat_chunks[0].prompt_token_ids == rendered["tokens"]
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chat_chunks[1:])
    streamed = [token for c in chat_chunks if c.choices for token in (getattr(c.choices[0], "token_ids", None) or [])]
    assert streamed == list(chat_expected.token_ids)
    assert getattr(api.chat.completions.create(model=model, messages=QUESTION, max_tokens=2), "prompt_token_ids",
                   None) is None
    refused = httpx.post(f"{gateway}/v1/completions", headers=headers,
                         json={"model": model, "prompt": PROMPT, "max_tokens": 1, "return_token_ids": "yes"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_token_ids", refused.text


def test_skip_special_tokens_false_keeps_them_in_the_text(api, gateway, cluster, grpc_client):
    """vLLM's skip_special_tokens (default true): a completion held to a special token (allowed_token_ids) shows
    nothing by default and the token's text with false, as the gRPC path's detokenizer gives it, on completions
    and chats, whole and streamed; a value other than true or false is 400."""
    model = api.models.list().data[0].id
    [special] = grpc_client.tokenize("<|im_start|>")
    held = {"allowed_token_ids": [special]}
    kept = grpc_client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[special],
                                                       skip_special_tokens=False))
    assert kept.text == "<|im_start|>" * 3 and list(kept.token_ids) == [special] * 3
    assert api.completions.create(model=model, prompt=PROMPT, max_tokens=3, extra_body=held).choices[0].text == ""
    shown = api.completions.create(model=model, prompt=PROMPT, max_tokens=3,
                                   extra_body={**held, "skip_special_tokens": False})
    assert shown.choices[0].text == kept.text
    chunks = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=3, stream=True,
                                         extra_body={**held, "skip_special_tokens": False})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == kept.text
    refused = httpx.post(f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {cluster.api_key}"},
                         json={"model": model, "messages": QUESTION, "max_tokens": 1, "skip_special_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "skip_special_tokens", refused.text


def test_a_request_id_names_the_answer_and_its_router_calls(api, gateway, cluster, grpc_client):
    """vLLM's ``request_id``: the answer's id is the route's prefix and it (a response's is it alone, as vLLM's),
    and the router's calls carry it, so a gRPC Abort by that id ends a streamed completion or response (``-N``
    after it for each of several choices); an id the router would refuse is 400 with the field named, and nothing
    else is lost."""
    model = api.models.list().data[0].id
    mine = f"mine.{uuid.uuid4().hex[:8]}"
    chat = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, extra_body={"request_id": mine})
    assert chat.id == f"chatcmpl-{mine}"
    embedded = api.embeddings.create(model=model, input=["a", "b"], extra_body={"request_id": mine})
    assert embedded.id == f"embd-{mine}" and len(embedded.data) == 2
    events = api.responses.create(model=model, input=PROMPT, max_output_tokens=300, stream=True,
                                  extra_body={"request_id": mine, "ignore_eos": True})
    assert next(events).response.id == mine and grpc_client.abort(mine)
    assert [event.type for event in events][-1] == "response.incomplete"
    stream = api.completions.create(model=model, prompt=PROMPT, max_tokens=300, temperature=0, stream=True, n=2,
                                    extra_body={"request_id": mine, "ignore_eos": True})
    chunks = [next(stream)]
    assert chunks[0].id == f"cmpl-{mine}"
    with pytest.raises(openai.BadRequestError, match="already in flight"):  # the same id while it runs
        api.completions.create(model=model, prompt=PROMPT, max_tokens=1, n=2, extra_body={"request_id": mine})
    assert grpc_client.abort(f"cmpl-{mine}")  # one router call for both choices of the prompt
    chunks += list(stream)
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0: "abort", 1: "abort"}, finished
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) < 2 * 300
    headers = {"authorization": f"Bearer {cluster.api_key}"}
    for route, body in (("completions", {"prompt": PROMPT}), ("chat/completions", {"messages": QUESTION}),
                        ("embeddings", {"input": "x"}), ("responses", {"input": "x"})):
        for bad in ("has space", "", "x" * (129 if route == "responses" else 124), 7):
            refused = httpx.post(f"{gateway}/v1/{route}", headers=headers,
                                 json={"model": model, "max_tokens": 1, **body, "request_id": bad})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "request_id", refused.text
    assert api.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={"request_id": "x" * 123})
    wait_until(lambda: all_blocks_free(grpc_client), 15, message="all KV blocks free")
