"""The router's front door: where its model directory comes from, and the one prompt check (no weights loaded)."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest

from splitserve.common.errors import InvalidRequest
from splitserve.common.model_info import find_model_dir
from splitserve.common.prompt import validate_prompt_token_ids
from splitserve.v1 import inference_pb2

METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "chat_template.jinja")


def test_the_prompt_check_names_what_is_wrong():
    assert validate_prompt_token_ids((1, 2, 3), vocab_size=10, max_model_len=4) == [1, 2, 3]
    with pytest.raises(InvalidRequest, match=r"^The prompt is empty: give at least one token\.$"):
        validate_prompt_token_ids([], vocab_size=10, max_model_len=4)
    with pytest.raises(InvalidRequest, match=r"^Prompt token id 10 is outside the vocabulary \[0, 10\)\.$"):
        validate_prompt_token_ids([1, 10, -1], vocab_size=10, max_model_len=8)
    with pytest.raises(InvalidRequest, match=r"^Prompt token id -1 is outside"):
        validate_prompt_token_ids([-1], vocab_size=10, max_model_len=8)
    with pytest.raises(InvalidRequest, match=r"^The prompt has 4 tokens; max_model_len is 4, which must leave room "
                                             r"for at least one generated token\.$"):
        validate_prompt_token_ids([1, 2, 3, 4], vocab_size=10, max_model_len=4)


def test_without_model_the_router_asks_for_prepare_model_and_converts_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not prepared in .*: run `splitserve prepare-model` once"):
        find_model_dir(None, cache=tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        find_model_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_model_dir(tmp_path / "missing")


@pytest.fixture(scope="module")
def metadata_dir(tmp_path_factory, model_dir):
    """The default model's tokenizer files and config.json, without its weights."""
    source = model_dir
    target = tmp_path_factory.mktemp("SmolLM2-metadata")
    for name in METADATA_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    return target


@pytest.fixture(scope="module")
def frontend(metadata_dir):
    from splitserve.router.frontend import Frontend

    return Frontend(str(metadata_dir), max_model_len=64)


def test_a_directory_without_weights_is_enough(frontend, metadata_dir):
    assert (frontend.model_fingerprint, frontend.max_model_len, frontend.model_config.vocab_size) == (None, 64, 49152)
    prompt = frontend.prompt_of(inference_pb2.GenerateRequest(text="The capital of France is"))
    assert (prompt.token_ids, prompt.text) == ([504, 3575, 282, 4649, 314], "The capital of France is")
    ids = frontend.prompt_of(inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=[1, 2])))
    assert (ids.token_ids, ids.text) == ([1, 2], None)
    chat = frontend.prompt_of(inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatPrompt(messages=[inference_pb2.ChatMessage(role="user", content="hi")])))
    assert chat.text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    info = frontend.model_info()
    assert (info.model_name, info.vocab_size, info.has_chat_template, info.max_logprobs) == (
        metadata_dir.name, 49152, True, 20)


@pytest.mark.parametrize("request_fields, sentence", [
    (dict(), "The request has no prompt: set text, token_ids or chat."),
    (dict(text=""), "The prompt is empty: give at least one token."),
    (dict(token_ids=inference_pb2.TokenIds(ids=[1, 49152])), "Prompt token id 49152 is outside the vocabulary"),
    (dict(token_ids=inference_pb2.TokenIds(ids=[1] * 64)), "The prompt has 64 tokens; max_model_len is 64"),
    (dict(chat=inference_pb2.ChatPrompt()), "The chat prompt has no messages."),
])
def test_bad_prompts_are_invalid_requests_with_a_sentence(frontend, request_fields, sentence):
    with pytest.raises(InvalidRequest) as refused:
        frontend.prompt_of(inference_pb2.GenerateRequest(**request_fields))
    assert str(refused.value).startswith(sentence)


def test_a_prompt_too_large_for_max_model_len_is_refused_before_tokenizing(frontend):
    # SmolLM2's longest token is 162 bytes in UTF-8; 64 tokens cover at most 64 * 162 bytes.
    limit = frontend.max_model_len * frontend.max_token_bytes
    assert (frontend.max_token_bytes, limit) == (162, 10368)
    sentence = (f"The text prompt is {limit + 1} bytes, more than max_model_len tokens can hold: {limit} bytes "
                f"(max_model_len 64 x 162 bytes, the longest token).")
    started = time.monotonic()
    with pytest.raises(InvalidRequest) as refused:
        frontend.prompt_of(inference_pb2.GenerateRequest(text="é" * (limit // 2) + "a"))
    assert time.monotonic() - started < 0.5
    assert str(refused.value) == sentence
    with pytest.raises(InvalidRequest, match=r"^The prompt has \d+ tokens; max_model_len is 64"):  # tokenized
        frontend.prompt_of(inference_pb2.GenerateRequest(text="é" * (limit // 2)))


def test_a_huge_prompt_is_refused_in_well_under_a_second(frontend):
    request = inference_pb2.GenerateRequest(text="a" * 50_000_000)  # tokenizing it would take minutes
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match=r"^The text prompt is 50000000 bytes, more than max_model_len"):
        frontend.prompt_of(request)
    assert time.monotonic() - started < 0.5


def test_a_chat_too_large_is_refused_before_rendering(frontend):
    limit = frontend.max_model_len * frontend.max_token_bytes
    messages = [inference_pb2.ChatMessage(role="user", content="a" * (limit // 2)),
                inference_pb2.ChatMessage(role="assistant", content="b" * (limit // 2 + 1))]
    started = time.monotonic()
    num_bytes = limit + 1 + len("user") + len("assistant")  # roles count too
    with pytest.raises(InvalidRequest, match=rf"^The chat's messages are {num_bytes} bytes, more than max_model_len"):
        frontend.prompt_of(inference_pb2.GenerateRequest(chat=inference_pb2.ChatPrompt(messages=messages)))
    assert time.monotonic() - started < 0.5
    messages[1].content = "b" * (limit // 2 - 100)
    with pytest.raises(InvalidRequest, match=r"^The (prompt has \d+ tokens|rendered chat is \d+ bytes)"):
        frontend.prompt_of(inference_pb2.GenerateRequest(chat=inference_pb2.ChatPrompt(messages=messages)))


def test_a_huge_role_is_refused_before_rendering(frontend):
    messages = [inference_pb2.ChatMessage(role="r" * 5_000_000, content="hi")]
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match=r"^The chat's messages are 5000002 bytes, more than max_model_len"):
        frontend.prompt_of(inference_pb2.GenerateRequest(chat=inference_pb2.ChatPrompt(messages=messages)))
    assert time.monotonic() - started < 0.5


def test_tokenize_is_not_held_to_the_generation_limits(frontend):
    text = "hello" * 100  # 100 tokens, over max_model_len 64
    request = inference_pb2.TokenizeRequest(text=text)
    assert frontend.tokenize(request).token_ids == [28120] * 100
    assert frontend.tokenize(inference_pb2.TokenizeRequest(text="")).token_ids == []
    with pytest.raises(InvalidRequest, match=r"^The prompt has 100 tokens; max_model_len is 64"):
        frontend.prompt_of(inference_pb2.GenerateRequest(text=text))
    with pytest.raises(InvalidRequest, match=r"^The request has no prompt"):
        frontend.tokenize(inference_pb2.TokenizeRequest())
    with pytest.raises(InvalidRequest, match=r"^The text prompt is 50000000 bytes"):
        frontend.tokenize(inference_pb2.TokenizeRequest(text="a" * 50_000_000))


def test_a_chat_the_template_refuses_is_an_invalid_request_with_its_reason(frontend, monkeypatch):
    template = ("{% for message in messages %}{% if message['role'] not in ['user', 'assistant'] %}"
                "{{ raise_exception('Only user and assistant roles are supported: ' + message['role']) }}"
                "{% endif %}{{ message['content'] }}{% endfor %}")
    monkeypatch.setattr(frontend.tokenizer, "chat_template", template)
    messages = [inference_pb2.ChatMessage(role="x" * 1000, content="hi")]
    with pytest.raises(InvalidRequest) as refused:
        frontend.prompt_of(inference_pb2.GenerateRequest(chat=inference_pb2.ChatPrompt(messages=messages)))
    sentence = str(refused.value)
    assert sentence.startswith("The model's chat template refused these messages: Only user and assistant roles "
                               "are supported: xxx")
    assert sentence.endswith("x.") and len(sentence) < 250  # the template's error is cut, the client's role with it


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_refused(frontend, monkeypatch):
    """vLLM's chat_template_kwargs: more template variables (Qwen3's enable_thinking here), from the client's
    Chat through the proto to the template; the router refuses what it must not render with (a name the renderer
    sets itself, a value that is not simple) with a sentence, whoever sent the proto."""
    from splitserve.common.chat import Chat
    from splitserve.rpc.convert import chat_to_pb

    template = ("{{ messages[0]['content'] }}|{% if enable_thinking is defined and enable_thinking is false %}"
                "<think>\n\n</think>\n\n{% endif %}{{ greeting | default('') }}{{ times | default('') }}")
    monkeypatch.setattr(frontend.tokenizer, "chat_template", template)
    messages = [{"role": "user", "content": "hi"}]

    def rendered(kwargs) -> str:
        chat = chat_to_pb(Chat.from_openai(messages, chat_template_kwargs=kwargs))
        return frontend.tokenizer.decode(frontend.tokenize(inference_pb2.TokenizeRequest(chat=chat)).token_ids)

    assert rendered(None) == rendered({"enable_thinking": True}) == "hi|"
    assert rendered({"enable_thinking": False, "greeting": "hello", "times": 2}) == "hi|<think>\n\n</think>\n\nhello2"
    assert chat_to_pb(Chat.from_openai(messages, chat_template_kwargs={"x": 1.5})).chat_template_kwargs[
        "x"].float_value == 1.5
    for kwargs, sentence in (
            ({"add_generation_prompt": False}, "chat_template_kwargs may not set 'add_generation_prompt'"),
            ({"tools": "[]"}, "may not set 'tools'"), ({"chat_template": "{{ 1 }}"}, "may not set 'chat_template'"),
            ({"tokenize": True}, "may not set 'tokenize'"), ({"bos_token": "x"}, "may not set 'bos_token'"),
            ({"enable thinking": False}, "'enable thinking' is not a template variable's name"),
            ({"depth": [1]}, "chat_template_kwargs.depth must be a boolean, an integer, a finite number or a string"),
            ({"x": float("nan")}, "must be a boolean"), ({"x": "y" * 1025}, "is 1025 characters, more than the 1024"),
            ({f"k{index}": 1 for index in range(17)}, "has 17 variables, more than the 16"),
            ("enable_thinking", "must be an object of template variables")):
        with pytest.raises(InvalidRequest, match=re.escape(sentence)):
            Chat.from_openai(messages, chat_template_kwargs=kwargs)
    # The same refusals from a proto no Python client checked, before anything is rendered.
    for name, value in (("messages", inference_pb2.ChatTemplateValue(string_value="x")),
                        ("x", inference_pb2.ChatTemplateValue())):
        chat = inference_pb2.ChatPrompt(messages=[inference_pb2.ChatMessage(role="user", content="hi")])
        chat.chat_template_kwargs[name].CopyFrom(value)
        with pytest.raises(InvalidRequest, match=r"^chat_template_kwargs"):
            frontend.prompt_of(inference_pb2.GenerateRequest(chat=chat))


def test_continue_final_message_ends_the_prompt_inside_the_assistants_answer(frontend):
    """vLLM's and transformers' continue_final_message: the model's own template rendered up to the last
    message's text, its end of turn left out, as transformers renders it; with add_generation_prompt it is
    refused, by the Chat and, from a proto no Python client checked, by the router."""
    from splitserve.common.chat import Chat
    from splitserve.rpc.convert import chat_from_pb, chat_to_pb

    messages = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "The city of"}]
    chat = Chat.from_openai(messages, add_generation_prompt=False, continue_final_message=True)
    assert chat_from_pb(chat_to_pb(chat)) == chat
    token_ids = frontend.tokenize(inference_pb2.TokenizeRequest(chat=chat_to_pb(chat))).token_ids
    expected = frontend.tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert frontend.tokenizer.decode(token_ids) == expected and expected.endswith("assistant\nThe city of")
    closed = chat_to_pb(Chat.from_openai(messages, add_generation_prompt=False))
    assert frontend.tokenizer.decode(frontend.tokenize(inference_pb2.TokenizeRequest(chat=closed)).token_ids) \
        .endswith("The city of<|im_end|>\n")
    with pytest.raises(InvalidRequest, match="^Set add_generation_prompt or continue_final_message, not both"):
        Chat.from_openai(messages, continue_final_message=True)
    both = chat_to_pb(chat)
    both.add_generation_prompt = True
    with pytest.raises(InvalidRequest, match="not both"):
        frontend.prompt_of(inference_pb2.GenerateRequest(chat=both))


@pytest.fixture(scope="module")
def bos_frontend(tmp_path_factory, metadata_dir):
    """The default model's metadata with a tokenizer that puts a beginning-of-sequence token (``<|endoftext|>``,
    id 0) before what it encodes, as Llama's does."""
    from splitserve.router.frontend import Frontend

    target = tmp_path_factory.mktemp("SmolLM2-with-bos")
    for item in metadata_dir.iterdir():
        shutil.copy(item, target / item.name)
    tokenizer = json.loads((target / "tokenizer.json").read_text())
    bos, first, second = ({"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                          {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}})
    tokenizer["post_processor"] = {"type": "TemplateProcessing", "single": [bos, first], "pair": [bos, first, second],
                                   "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                        "tokens": ["<|endoftext|>"]}}}
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    return Frontend(str(target), max_model_len=64)


def test_add_special_tokens_chooses_whether_the_tokenizer_adds_its_bos(bos_frontend, frontend):
    """vLLM's add_special_tokens: unset, a text prompt gets the tokenizer's BOS and a rendered chat only what its
    template wrote; set, either way for both, on Generate, Tokenize and Embed alike. Token ids are taken as sent,
    and a tokenizer that adds nothing gives the same ids either way."""
    text = "Hi there"
    words = bos_frontend.tokenizer.encode(text, add_special_tokens=False)
    chat = inference_pb2.ChatPrompt(messages=[inference_pb2.ChatMessage(role="user", content=text)])
    rendered = bos_frontend.tokenizer.encode(bos_frontend.render_chat(chat), add_special_tokens=False)
    assert rendered[0] != 0 and words[0] != 0
    for kind in (inference_pb2.GenerateRequest, inference_pb2.TokenizeRequest, inference_pb2.EmbedRequest):
        def ids(special=None, kind=kind, **prompt):
            request = kind(**prompt) if special is None else kind(**prompt, add_special_tokens=special)
            return list(bos_frontend.tokenize(request).token_ids)

        assert ids(text=text) == ids(text=text, special=True) == [0, *words], kind
        assert ids(text=text, special=False) == words
        assert ids(chat=chat) == ids(chat=chat, special=False) == rendered
        assert ids(chat=chat, special=True) == [0, *rendered]
    token_ids = inference_pb2.TokenIds(ids=words)
    assert list(bos_frontend.tokenize(inference_pb2.GenerateRequest(token_ids=token_ids,
                                                                    add_special_tokens=True)).token_ids) == words
    for special in (True, False):
        request = inference_pb2.TokenizeRequest(text=text, add_special_tokens=special)
        assert list(frontend.tokenize(request).token_ids) == words
