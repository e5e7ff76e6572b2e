"""The offline API end to end: sampling through the engine, stop conditions, errors, aborts."""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_kv_blocks=256, max_model_len=1024)


def assert_all_blocks_free(llm: LLM) -> None:
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks
    assert not llm.engine.has_unfinished_requests()


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    (alone,) = llm.generate(PROMPTS[1], seeded, use_tqdm=False)
    others = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    batch = llm.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]], [others, others, seeded, others], use_tqdm=False
    )
    assert batch[2].outputs[0].token_ids == alone.outputs[0].token_ids
    (other_seed,) = llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_a_continuation_with_its_resumed_tokens_penalizes_as_the_whole_generation_did(llm):
    """A prompt ending in tokens this generation made before, with num_resumed_tokens saying how many (what the
    router sends a migrated stream's new decode worker), goes on as the generation would have: presence and
    frequency penalties count those tokens. Without the count they are prompt tokens, and the tokens differ."""
    penalties = dict(temperature=0, frequency_penalty=1.0, presence_penalty=0.5, ignore_eos=True)
    (whole,) = llm.generate(PROMPTS[0], SamplingParams(max_tokens=24, **penalties), use_tqdm=False)
    prompt, tokens = whole.prompt_token_ids, whole.outputs[0].token_ids
    for cut in (1, 10):
        continued = SamplingParams(max_tokens=24 - cut, num_resumed_tokens=cut, **penalties)
        (rest,) = llm.generate({"prompt_token_ids": prompt + tokens[:cut]}, continued, use_tqdm=False)
        assert rest.outputs[0].token_ids == tokens[cut:], cut
    forgetful = SamplingParams(max_tokens=14, **penalties)
    (rest,) = llm.generate({"prompt_token_ids": prompt + tokens[:10]}, forgetful, use_tqdm=False)
    assert rest.outputs[0].token_ids != tokens[10:]
    with pytest.raises(ValueError, match="num_resumed_tokens"):
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(num_resumed_tokens=len(prompt) + 1), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_logit_bias_bans_a_token_in_a_batch_and_an_id_outside_the_vocabulary_is_refused(llm):
    greedy = SamplingParams(temperature=0, max_tokens=8)
    plain = [output.outputs[0].token_ids for output in llm.generate(PROMPTS[:2], greedy, use_tqdm=False)]
    banned_id = plain[0][0]
    biased = SamplingParams(temperature=0, max_tokens=8, logit_bias={banned_id: -100})
    outputs = llm.generate(PROMPTS[:2], [biased, greedy], use_tqdm=False)  # one row biased, the other not
    assert banned_id not in outputs[0].outputs[0].token_ids and outputs[1].outputs[0].token_ids == plain[1]
    vocab_size = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias token id {vocab_size} is outside the vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={vocab_size: 1.0}), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_bad_words_and_allowed_token_ids_give_transformers_tokens(llm, model_dir):
    """bad_words (one word of two tokens, one of one) and allowed_token_ids, each beside a plain request in one
    batch, give transformers' greedy tokens under its own processors for the same bans (bad_words_ids, and
    prefix_allowed_tokens_fn); each changes what the plain request would have said."""
    from splitserve.engine.logits_processors import bad_words_token_ids
    from tests.reference import hf_greedy

    greedy = SamplingParams(temperature=0, max_tokens=24)
    plain = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    tokenizer = llm.engine.tokenizer
    allowed = sorted(set(plain[1]) - {plain[1][3]})  # the plain answer's own tokens, but for its fourth
    cases = [(PROMPTS[2], ["fibonacci"], None), (PROMPTS[0], ["Paris"], None), (PROMPTS[1], [], allowed)]
    params = [SamplingParams(temperature=0, max_tokens=24, bad_words=words, allowed_token_ids=allowed_ids)
              for _, words, allowed_ids in cases]
    outputs = llm.generate([prompt for prompt, _, _ in cases] + [PROMPTS[3]], params + [greedy], use_tqdm=False)
    assert outputs[3].outputs[0].token_ids == plain[3]
    for (_, words, allowed_ids), output, plain_ids in zip(cases, outputs, (plain[2], plain[0], plain[1])):
        ours = output.outputs[0].token_ids
        kwargs = ({"bad_words_ids": [list(sequence) for sequence in bad_words_token_ids(tokenizer, words)]} if words
                  else {"prefix_allowed_tokens_fn": lambda batch, ids, allowed_ids=allowed_ids: allowed_ids})
        assert ours == hf_greedy(str(model_dir), output.prompt_token_ids, 24, **kwargs) and ours != plain_ids
    assert "fibonacci" not in outputs[0].outputs[0].text and "Paris" not in outputs[1].outputs[0].text
    assert set(outputs[2].outputs[0].token_ids) <= set(allowed)
    assert_all_blocks_free(llm)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    """vLLM's truncate_prompt_tokens: a prompt longer than max_model_len (1,024 here) is served as its last
    tokens, the same tokens as those last tokens sent alone; without it the prompt is refused."""
    token_ids = (llm.engine.tokenizer.encode(" ".join(["The capital of France is Paris."] * 200)))
    assert len(token_ids) > 1024
    cut = SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=100)
    (truncated,) = llm.generate({"prompt_token_ids": token_ids}, cut, use_tqdm=False)
    (alone,) = llm.generate({"prompt_token_ids": token_ids[-100:]}, SamplingParams(temperature=0, max_tokens=6),
                            use_tqdm=False)
    assert truncated.prompt_token_ids == token_ids[-100:] and truncated.outputs[0].token_ids == alone.outputs[0].token_ids
    with pytest.raises(ValueError, match="1024"):
        llm.generate({"prompt_token_ids": token_ids}, SamplingParams(max_tokens=6), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    top1 = llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in top1] == [o.outputs[0].token_ids for o in greedy]


def test_stop_string_ends_generation_and_is_left_out(llm):
    (free_run,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    text = free_run.outputs[0].text  # " Paris.\n\nThe answer is: ..."
    assert "." in text
    (stopped,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop=["."]), use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.text == text[: text.index(".")]
    assert completion.finish_reason == "stop" and completion.stop_reason == "."
    assert len(completion.token_ids) < len(free_run.outputs[0].token_ids)
    kept = SamplingParams(temperature=0, max_tokens=20, stop=["."], include_stop_str_in_output=True)
    (included,) = llm.generate(PROMPTS[0], kept, use_tqdm=False)
    assert included.outputs[0].text == text[: text.index(".") + 1] and included.outputs[0].stop_reason == "."
    assert included.outputs[0].token_ids == completion.token_ids


def test_stop_token_id_ends_generation_and_is_kept_in_ids(llm):
    (free_run,) = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    ids = free_run.outputs[0].token_ids
    stop_id = ids[3]
    (stopped,) = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]), use_tqdm=False)
    first = ids.index(stop_id)
    assert stopped.outputs[0].token_ids == ids[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_id
    # min_tokens keeps it going past the stop id.
    (longer,) = llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id], min_tokens=first + 2), use_tqdm=False
    )
    assert len(longer.outputs[0].token_ids) > first + 1


def test_max_tokens_gives_length_finish_and_logprobs(llm):
    (output,) = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3), use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.token_ids) == 5 and completion.finish_reason == "length"
    assert len(completion.logprobs) == 5
    for token_id, step in zip(completion.token_ids, completion.logprobs):
        assert token_id in step and 3 <= len(step) <= 4
        # Greedy: the chosen token is the most likely one.
        assert step[token_id] == max(step.values())
    assert completion.cumulative_logprob == pytest.approx(sum(s[t] for s, t in zip(completion.logprobs, completion.token_ids)))


def test_chat_applies_the_template(llm):
    (output,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=16))
    assert "<|im_start|>assistant" in output.prompt
    assert "Paris" in output.outputs[0].text


def test_chat_shows_tools_and_calls_through_a_template_given_as_text(llm, tokenizer):
    """LLM.chat(tools=..., chat_template=...) renders as transformers does, a call's arguments as an object; the
    tool's answer is in the prompt the model continues; malformed tools are refused with a sentence."""
    from pathlib import Path

    template = (Path(__file__).resolve().parents[2] / "examples" / "chat-templates" / "chatml-tools.jinja").read_text()
    tools = [{"type": "function", "function": {"name": "get_time", "description": "The time now."}}]
    conversation = [{"role": "user", "content": "What time is it?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "It is 10:42."}]
    (output,) = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=8), tools=tools,
                         chat_template=template)
    expected = tokenizer.apply_chat_template(
        [conversation[0], {**conversation[1], "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {}}}]}, conversation[2]],
        tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert output.prompt == expected
    assert '{"name": "get_time", "arguments": {}}' in expected and "It is 10:42." in expected
    assert output.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    with pytest.raises(ValueError, match="Two tools are named 'get_time'"):
        llm.chat(conversation, tools=tools * 2, chat_template=template)


def test_chat_template_kwargs_reach_the_template_and_are_checked(llm, tokenizer):
    """LLM.chat(chat_template_kwargs=...) renders with the template's variables as transformers does (vLLM's
    offline chat_template_kwargs, e.g. Qwen3's enable_thinking); what the renderer sets itself is refused."""
    template = ("{% for message in messages %}{{ message['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                "{% else %}<think>{% endif %}")
    conversation = [{"role": "user", "content": "What is 7 times 8?"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    thinking, quiet = (llm.chat(conversation, params, chat_template=template, chat_template_kwargs=kwargs)[0]
                       for kwargs in (None, {"enable_thinking": False}))
    assert thinking.prompt == "What is 7 times 8?<think>"
    assert quiet.prompt == tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                         enable_thinking=False) == "What is 7 times 8?<think>\n\n</think>\n\n"
    with pytest.raises(ValueError, match="chat_template_kwargs may not set 'tools'"):
        llm.chat(conversation, params, chat_template=template, chat_template_kwargs={"tools": []})
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks


def test_a_priority_needs_the_priority_policy_and_nothing_is_queued_when_refused(llm):
    with pytest.raises(ValueError, match="needs the priority scheduling policy"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=1), priority=[0, 2])
    with pytest.raises(ValueError, match="Got 1 priorities for 2 prompts"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=1), priority=[0])
    assert not llm.engine.has_work()
    (output,) = llm.generate("a", SamplingParams(max_tokens=1), priority=[0])
    assert output.outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": 100}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused_and_others_go_on(llm):
    engine = llm.engine
    engine.add_request("good", PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    with pytest.raises(ValueError, match="max_model_len is 1024"):
        engine.add_request("long", None, SamplingParams(), prompt_token_ids=[100] * 1024)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", None, SamplingParams(), prompt_token_ids=[])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("oov", None, SamplingParams(), prompt_token_ids=[5, 10**6])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", PROMPTS[1], SamplingParams())
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert outputs[-1].request_id == "good" and outputs[-1].outputs[0].text.startswith(" Paris")
    assert_all_blocks_free(llm)
    # generate() checks every prompt first: a bad one queues nothing.
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([PROMPTS[0], {"prompt_token_ids": [100] * 2000}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_abort_mid_generation_frees_blocks_and_reports_abort(llm):
    engine = llm.engine
    engine.add_request("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort_request("a")
    assert not engine.abort_request("a")
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    finished = {output.request_id: output for output in outputs if output.finished}
    assert finished["a"].outputs[0].finish_reason == "abort"
    assert finished["b"].outputs[0].finish_reason == "length"
    assert len(finished["b"].outputs[0].token_ids) == 6
    assert_all_blocks_free(llm)


def test_streaming_deltas_add_up_to_the_text(llm):
    engine = llm.engine
    engine.add_request("s", PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, stop=["\n\n"]))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas.append(output.outputs[0].delta_text)
            final = output
    assert "".join(deltas) == final.outputs[0].text
    assert final.finished and final.outputs[0].finish_reason in ("stop", "length")


def test_engine_config_errors_are_clear(model_dir):
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(model_dir), block_size=0)
    with pytest.raises(ValueError, match="fewer than one request"):
        LLM(str(model_dir), num_kv_blocks=4, max_model_len=1024)
    with pytest.raises(ValueError, match="exceeds the model's maximum"):
        LLM(str(model_dir), num_kv_blocks=8, max_model_len=100_000)


def test_unsupported_architecture_is_named(tmp_path, model_dir):
    import json
    import shutil

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Unsupported model architecture GPT2LMHeadModel.*Llama"):
        LLM(str(tmp_path), num_kv_blocks=8, max_model_len=64)


def test_the_offline_step_budget_is_twice_a_servers_unless_given(model_dir, llm):
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS

    assert EngineConfig().max_num_batched_tokens == 2048  # workers and `up`
    assert OFFLINE_MAX_NUM_BATCHED_TOKENS == 4096 and llm.engine.config.max_num_batched_tokens == 4096
    given = LLM(str(model_dir), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=512)
    assert given.engine.config.max_num_batched_tokens == 512
    many = LLM(str(model_dir), num_kv_blocks=64, max_model_len=256, max_num_seqs=5000)
    assert many.engine.config.max_num_batched_tokens == 5000  # every running request can still decode each step


def test_the_offline_block_size_is_vllm_cpus_where_the_cpu_kernels_attend(model_dir, llm):
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm import OFFLINE_CPU_BLOCK_SIZE

    assert EngineConfig().block_size == 16  # workers and `up`: a cluster's workers must agree on it
    assert OFFLINE_CPU_BLOCK_SIZE == 128 and llm.engine.config.block_size == 128
    given = LLM(str(model_dir), num_kv_blocks=64, max_model_len=256, block_size=32)
    assert given.engine.config.block_size == 32
    reference = LLM(str(model_dir), num_kv_blocks=64, max_model_len=256, attention_backend="torch")
    assert reference.engine.config.block_size == 16  # the references keep EngineConfig's
    # Greedy tokens do not depend on the block size: the same prompts through 128- and 16-token blocks.
    prompts = ["The capital of France is", "def fibonacci(n):" * 12]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    small_blocks = LLM(str(model_dir), num_kv_blocks=64, max_model_len=512, block_size=16)
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in small_blocks.generate(prompts, params, use_tqdm=False)])


def test_the_small_batch_head_is_made_at_load_and_gives_the_heads_logits(llm):
    import resource

    import torch
    import torch.nn.functional as F

    model = llm.engine.model_runner.model
    # Made at load on CPU, not inside a request's first token: the head in the C++ small GEMM's panels where that
    # runs (then no transposed copy is kept), else its transposed copy.
    assert (model._head_panels is None) != (model._transposed_head is None)
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    small = model.compute_logits(hidden)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 1000, f"{faults} page faults: the small-batch head was made on first use"
    torch.testing.assert_close(small, F.linear(hidden, model._head_weight()).float(), rtol=1e-4, atol=1e-4)


def test_the_last_layer_projects_only_the_rows_asked_for(llm):
    """A prompt step reads only its sampled rows' hidden states, so the runner asks the model for those rows
    alone: the last layer's attention output projection and MLP then run on them, and every row's K/V is
    still written (the cache is the same bit for bit)."""
    import torch

    from splitserve.engine.model_runner import _layer_views, allocate_kv_cache
    from splitserve.engine.request import Request
    from splitserve.engine.scheduler import ScheduledRequest

    runner = llm.engine.model_runner
    model, size = runner.model, runner.block_size
    lengths, scheduled, block_tables, first = [37, 5, 130], [], {}, 0
    for index, length in enumerate(lengths):
        request = Request(f"rows-{index}", [(7 * index + 3 * t) % 1000 + 100 for t in range(length)], SamplingParams())
        scheduled.append(ScheduledRequest(request, length, sample=index != 1))
        block_tables[request.request_id] = list(range(first, first + -(-length // size)))
        first += -(-length // size)
    inputs = runner._prepare(scheduled, block_tables)
    assert inputs.sample_rows == [36, 171]
    caches = [allocate_kv_cache(runner._cache_shape(first), runner.dtype) for _ in range(3)]  # all zeros
    o_proj = model.model.layers[-1].self_attn.o_proj
    rows_seen = []
    original = o_proj.forward
    o_proj.forward = lambda x: rows_seen.append(x.shape[0]) or original(x)
    try:
        with torch.inference_mode():
            full = model(inputs.input_ids, inputs.positions, _layer_views(caches[0]), inputs.metadata)
            rows = torch.tensor([171, 0, 36])
            part = model(inputs.input_ids, inputs.positions, _layer_views(caches[1]), inputs.metadata, rows)
            none = model(inputs.input_ids, inputs.positions, _layer_views(caches[2]), inputs.metadata,
                         torch.empty(0, dtype=torch.int64))
    finally:
        o_proj.forward = original
    assert rows_seen == [sum(lengths), 3, 0]
    assert part.shape == (3, model.config.hidden_size) and none.shape == (0, model.config.hidden_size)
    # The same rows through fewer-row GEMMs: equal up to the GEMMs' float32 rounding.
    torch.testing.assert_close(part, full[rows], rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[1], caches[0]) and torch.equal(caches[2], caches[0])
