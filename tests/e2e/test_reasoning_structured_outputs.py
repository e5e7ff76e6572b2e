"""End to end: structured outputs on an engine with a reasoning parser wait out the think block, as vLLM's do.

The model writes its thought freely; the grammar constrains the tokens after ``</think>``. SmolLM2 has no think
tokens of its own, but a few-shot prompt makes it write ``<think> ... </think>`` and then a JSON answer, with
``</think>`` spelled in its own three tokens, which the engine's watch matches. Greedy decoding is
token-identical to transformers under the same rule (no mask until the generated tokens spell ``</think>``),
beside a prompt that closed its block (constrained from its first token), a thought cut short by max_tokens
(never constrained) and a plain request; a migration's resumed tokens and the prefill / decode handover cross the
block's end; a cluster whose workers and gateway take --reasoning-parser gives a chat answer's thought as its
reasoning and a JSON content that follows the schema.
"""

from __future__ import annotations

import json

import openai
import pytest

from splitserve import LLM, SamplingParams
from splitserve.client import Client
from splitserve.common.structured_outputs import StructuredOutputsParams
from tests.cluster_helpers import all_blocks_free, running_gateway, start_cluster, wait_until
from tests.e2e.test_llm_correctness import assert_all_blocks_free
from tests.e2e.test_structured_outputs import assert_handover_is_one_engines
from tests.reference import hf_greedy, hf_greedy_constrained

ANIMAL = {"type": "object", "properties": {"animal": {"type": "string"}, "legs": {"type": "integer"}},
          "required": ["animal", "legs"], "additionalProperties": False}
# Two examples teach the model to think, close the block and answer in JSON; it then thinks about dogs.
FEW_SHOT = ('Answer in JSON.\n<think>The user likes cats.</think>{"animal": "cat", "legs": 4}\n'
            '<think>The user likes birds.</think>{"animal": "bird", "legs": 2}\n<think>')
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_kv_blocks=128, max_model_len=512, reasoning_parser="deepseek_r1")


def _schema() -> StructuredOutputsParams:
    return StructuredOutputsParams(json=ANIMAL)


def _think_end(llm) -> list[int]:
    return llm.engine.tokenizer.encode("</think>", add_special_tokens=False)


def _split(text: str) -> tuple[str, str]:
    thought, tag, answer = text.partition("</think>")
    assert tag, text
    return thought, answer


def test_the_grammar_waits_for_the_end_of_the_think_block(llm, model_dir, prompt_token_ids):
    engine = llm.engine
    eos = sorted(engine.eos_token_ids)
    thinking = engine.tokenize(FEW_SHOT)
    closed = engine.tokenize(FEW_SHOT + "The user likes dogs.</think>")  # the prompt ends the block itself
    plain = prompt_token_ids[1]
    constrained = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=_schema())
    cut_short = SamplingParams(temperature=0.0, max_tokens=3, structured_outputs=_schema())
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in (thinking, closed, thinking, plain)],
        [constrained, constrained, cut_short, SamplingParams(temperature=0.0, max_tokens=12)], use_tqdm=False)
    after_thought, after_closed, short, unconstrained = (output.outputs[0] for output in outputs)

    grammar = _schema().to_grammar()
    assert after_thought.token_ids == hf_greedy_constrained(str(model_dir), thinking, MAX_TOKENS, grammar, eos,
                                                            think_end=_think_end(llm))
    assert after_thought.finish_reason == "stop"
    thought, answer = _split(after_thought.text)
    assert thought and json.loads(answer).keys() == {"animal", "legs"}
    # The thought is the model's own: the same tokens as without any grammar, up to </think>.
    free = hf_greedy(str(model_dir), thinking, MAX_TOKENS)
    end = after_thought.text.index("</think>")
    assert engine.tokenizer.decode(free)[:end] == thought

    # A block closed in the prompt: constrained from the first token, as an engine without the parser does.
    assert after_closed.token_ids == hf_greedy_constrained(str(model_dir), closed, MAX_TOKENS, grammar, eos)
    assert after_closed.text.startswith("{") and json.loads(after_closed.text).keys() == {"animal", "legs"}
    # A thought cut short by max_tokens was never constrained.
    assert short.token_ids == free[:3] and short.finish_reason == "length"
    assert unconstrained.token_ids == hf_greedy(str(model_dir), plain, 12)
    assert_all_blocks_free(llm)


def test_resumed_tokens_cross_the_end_of_the_think_block(llm):
    """A migration's continuation with num_resumed_tokens cut inside the thought, right after </think>, and inside
    the answer: the rest is the whole request's."""
    prompt = llm.engine.tokenize(FEW_SHOT)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=_schema())
    whole = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    end = _think_end(llm)
    after_tag = next(i + len(end) for i in range(len(whole)) if whole[i:i + len(end)] == end)
    for cut in (2, after_tag - 1, after_tag, after_tag + 3):
        resumed = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - cut,
                                 structured_outputs=StructuredOutputsParams(json=ANIMAL, num_resumed_tokens=cut))
        rest = llm.generate([{"prompt_token_ids": prompt + whole[:cut]}], resumed, use_tqdm=False)[0].outputs[0]
        assert rest.token_ids == whole[cut:], cut
        assert rest.finish_reason == "stop"
    assert_all_blocks_free(llm)


def test_the_decode_side_takes_a_first_token_sampled_in_the_think_block(model_dir):
    """The prefill engine samples the first token, a thought's, without the mask; the decode engine's watch takes
    it and the grammar starts after </think>: the same tokens as one engine doing both. With a prompt that closed
    its block the first token is sampled under the grammar on both sides."""
    prefill, decode = (LLM(str(model_dir), num_kv_blocks=64, max_model_len=512, block_size=16,
                           reasoning_parser="qwen3").engine for _ in range(2))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=_schema())
    for text in (FEW_SHOT, FEW_SHOT + "The user likes dogs.</think>"):
        assert_handover_is_one_engines(prefill, decode, prefill.tokenize(text), params)
    assert decode.free_block_count == decode.num_kv_blocks
    assert prefill.free_block_count == prefill.num_kv_blocks


def test_an_unknown_reasoning_parser_is_refused_before_the_model_loads():
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        LLM("/nonexistent", reasoning_parser="granite")


CHAT = [
    {"role": "system", "content": "Think in <think> tags, then answer in JSON."},
    {"role": "user", "content": "I like cats."},
    {"role": "assistant", "content": '<think>The user likes cats.</think>{"animal": "cat", "legs": 4}'},
    {"role": "user", "content": "I like birds."},
    {"role": "assistant", "content": '<think>The user likes birds.</think>{"animal": "bird", "legs": 2}'},
    {"role": "user", "content": "I like dogs."},
]


# SmolLM2's ChatML with the think block opened in the generation prompt, as DeepSeek-R1's template opens it. (The
# earlier turns' blocks stay in the prompt, so without the open <think> the prompt's last tag would be a </think>:
# the block would count as ended, by vLLM's rule, and the grammar would start at once.)
THINKING_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                     "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}")


@pytest.fixture(scope="module")
def reasoning_cluster(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reasoning-cluster")
    (directory / "thinking.jinja").write_text(THINKING_TEMPLATE)
    cluster = start_cluster("p2p", directory, worker_args=["--reasoning-parser", "deepseek_r1"],
                            router_args=["--chat-template", str(directory / "thinking.jinja")])
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_cluster_with_a_reasoning_parser_answers_in_json_after_the_thought(reasoning_cluster, llm,
                                                                             tmp_path_factory):
    """Prefill and decode workers with --reasoning-parser, a router whose chat template opens the think block; a
    gateway without the flag follows the workers' parser (the router's model info reports it): a chat answer under a JSON schema has the model's thought as its reasoning and JSON
    that follows the schema as its content, whole and streamed; a forced tool call comes after the thought too;
    over gRPC the text is the offline engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=_schema())
    with Client(reasoning_cluster.router.address) as client:
        assert client.model_info().reasoning_parser == "deepseek_r1"
        text = client.generate(FEW_SHOT, params).text
    assert text == llm.generate(FEW_SHOT, params, use_tqdm=False)[0].outputs[0].text

    log = tmp_path_factory.mktemp("reasoning-gateway") / "gateway.log"
    with running_gateway(reasoning_cluster.router.address, log) as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        model = api.models.list().data[0].id
        response_format = {"type": "json_schema", "json_schema": {"name": "animal", "schema": ANIMAL}}
        message = api.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS,
                                              response_format=response_format).choices[0].message
        assert message.reasoning and "dogs" in message.reasoning
        assert json.loads(message.content).keys() == {"animal", "legs"}
        reasoning, content = "", ""
        for chunk in api.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS,
                                                 response_format=response_format, stream=True):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning", None) or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == (message.reasoning, message.content)

        tool = {"type": "function", "function": {"name": "record_animal", "parameters": ANIMAL}}
        called = api.chat.completions.create(
            model=model, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS, tools=[tool],
            tool_choice={"type": "function", "function": {"name": "record_animal"}}).choices[0].message
        assert called.reasoning and "dogs" in called.reasoning
        [call] = called.tool_calls
        assert call.function.name == "record_animal"
        assert json.loads(call.function.arguments).keys() == {"animal", "legs"}
    with Client(reasoning_cluster.router.address) as client:
        wait_until(lambda: all_blocks_free(client), 30, message="every block free")


def test_a_thought_speculates_and_the_grammar_starts_after_it(model_dir, llm):
    """With n-gram speculation a request in its think block drafts (its grammar masks nothing yet), short of the
    token that would end ``</think>``: the same tokens as one token a step, with drafts accepted in the thought,
    and the grammar's answer after it."""
    speculating = LLM(str(model_dir), num_kv_blocks=128, max_model_len=512, reasoning_parser="deepseek_r1",
                      speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})
    prompt = speculating.engine.tokenize(FEW_SHOT)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=_schema())
    output = speculating.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert output.token_ids == llm.generate([{"prompt_token_ids": prompt}], params,
                                            use_tqdm=False)[0].outputs[0].token_ids
    assert speculating.engine.stats.num_accepted_tokens > 0  # the thought repeats the examples': drafts were taken
    thought, answer = _split(output.text)
    assert thought and json.loads(answer).keys() == {"animal", "legs"}
    assert_all_blocks_free(speculating)
    # No draft that could end the block is kept: the step's own token ends it at the latest.
    grammar = speculating.engine.structured_outputs.matcher(_schema(), prompt)
    end = _think_end(speculating)
    assert grammar.thought_drafts([5, end[0], end[1], end[2], 7]) == [5, end[0], end[1]]
    assert grammar.thought_drafts([5, 6]) == [5, 6]
