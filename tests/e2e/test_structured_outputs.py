"""End to end: structured outputs (vLLM's ``StructuredOutputsParams``) in the engine.

Greedy decoding under a grammar is token-identical to transformers' greedy decoding under the same grammar (its own
llguidance matcher, masking transformers' logits); constrained rows beside unconstrained ones leave those as
transformers has them; sampled outputs keep the shape; bad constraints are refused with a sentence; the prefill /
decode handover and a migration's resumed tokens continue the grammar where it was.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.common.errors import InvalidRequest
from splitserve.common.structured_outputs import MAX_CHOICES, StructuredOutputsParams
from splitserve.engine.kv_connector import KVTransferParams
from splitserve.engine.request import RequestStatus
from tests.e2e.test_llm_correctness import assert_all_blocks_free
from tests.reference import hf_greedy, hf_greedy_constrained

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "pets": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe (not sure)"]
# (prompt, constraint, max_tokens, check of a complete output's text)
CASES = [
    ("Describe a person as JSON with a name, an age and their pets.", StructuredOutputsParams(json=PERSON), 80,
     lambda text: set(json.loads(text)) == {"name", "age", "pets"} and isinstance(json.loads(text)["age"], int)),
    ("Write a JSON object about a cat.", StructuredOutputsParams(json_object=True), 60,
     lambda text: isinstance(json.loads(text), dict)),
    ("When did the first person walk on the moon? Give the date.", StructuredOutputsParams(regex=DATE), 20,
     lambda text: re.fullmatch(DATE, text) is not None),
    ("Is the sky blue? Answer yes or no.", StructuredOutputsParams(choice=CHOICES), 10, lambda text: text in CHOICES),
    ("What is six times seven?", StructuredOutputsParams(grammar='start: "The answer is " /[0-9]+/ "."'), 12,
     lambda text: re.fullmatch(r"The answer is [0-9]+\.", text) is not None),
    ("Name a primary color.", StructuredOutputsParams(grammar='root ::= "The color is " color "."\n'
                                                              'color ::= "red" | "green" | "blue"'), 12,
     lambda text: text in {f"The color is {color}." for color in ("red", "green", "blue")}),
]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_kv_blocks=256, max_model_len=1024)


def eos(llm) -> list[int]:
    return sorted(llm.engine.eos_token_ids)


def test_greedy_under_each_constraint_is_transformers_under_it_beside_plain_requests(llm, model_dir,
                                                                                      prompt_token_ids):
    prompts = [llm.engine.tokenize(prompt) for prompt, *_ in CASES]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint)
              for _, constraint, max_tokens, _ in CASES]
    # Two unconstrained requests in the same batches: the masks are on their rows only.
    plain = prompt_token_ids[1:3]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts + plain],
                           params + [SamplingParams(temperature=0.0, max_tokens=12)] * 2, use_tqdm=False)
    for (_, constraint, max_tokens, check), ids, output in zip(CASES, prompts, outputs):
        completion = output.outputs[0]
        expected = hf_greedy_constrained(str(model_dir), ids, max_tokens, constraint.to_grammar(), eos(llm))
        assert completion.token_ids == expected, (constraint.kind, completion.text)
        assert completion.finish_reason == "stop", (constraint.kind, completion.text)
        assert check(completion.text), (constraint.kind, completion.text)
    for ids, output in zip(plain, outputs[len(CASES):]):
        assert output.outputs[0].token_ids == hf_greedy(str(model_dir), ids, 12)
    assert_all_blocks_free(llm)


def test_the_torch_backend_masks_through_the_torch_path_and_gives_the_same_tokens(model_dir, llm):
    """Without the C++ kernels (--attention-backend torch) the masks go through apply_token_bitmask's torch path:
    the same tokens as the C++ kernel's."""
    torch_llm = LLM(str(model_dir), num_kv_blocks=128, max_model_len=1024, attention_backend="torch")
    assert torch_llm.engine.model_runner.sampler.kernels is None
    assert llm.engine.model_runner.sampler.kernels is not None
    prompts = [prompt for prompt, *_ in CASES]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint)
              for _, constraint, max_tokens, _ in CASES]
    expected = [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    assert [output.outputs[0].token_ids for output in torch_llm.generate(prompts, params, use_tqdm=False)] == expected
    assert_all_blocks_free(torch_llm)


def test_sampled_outputs_keep_the_shape_and_a_seed_repeats_them(llm):
    prompt = "Pick a date and an answer."
    for constraint, check in ((StructuredOutputsParams(regex=DATE), lambda text: re.fullmatch(DATE, text)),
                              (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES)):
        params = [SamplingParams(temperature=1.5, top_p=1.0, max_tokens=20, seed=seed, structured_outputs=constraint)
                  for seed in range(8)]
        texts = [output.outputs[0].text for output in llm.generate([prompt] * 8, params, use_tqdm=False)]
        assert all(check(text) for text in texts), texts
        assert len(set(texts)) > 1, texts  # sampled, not forced to one output
        again = llm.generate([prompt], params[3], use_tqdm=False)[0].outputs[0].text
        assert again == texts[3]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("constraint, reason", [
    ({"regex": "[a-"}, "regex is not valid"),
    ({"grammar": "start: undefined_rule"}, "grammar is not valid"),
    ({"json": {"type": "objekt"}}, "json is not valid"),
    ({"json": "{not json"}, "not JSON"),
    ({"json": [1, 2]}, "an object or a boolean"),
    ({"json": False}, "which no output follows"),
    ({"choice": []}, "1 to 1024"),
    ({"choice": ["a"] * (MAX_CHOICES + 1)}, "1 to 1024"),
    ({"choice": ["ok", ""]}, "non-empty strings"),
    ({"regex": "a" * 70_000}, "at most 65536"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({}, "exactly one"),
    ({"structural_tag": "{}"}, "no field 'structural_tag'"),
    ({"regex": "[0-9]+", "disable_any_whitespace": True}, "shape JSON only"),
    ({"json_object": True, "whitespace_pattern": "(a"}, "json_object is not valid"),
])
def test_a_bad_constraint_is_refused_with_a_sentence_and_loses_nothing(llm, constraint, reason):
    with pytest.raises(InvalidRequest, match=re.escape(reason)):
        llm.engine.add_request("bad", "Hello", SamplingParams(max_tokens=4, **{"structured_outputs": constraint}))
    assert_all_blocks_free(llm)
    assert llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0].outputs[0].text


def test_vllms_json_options_take_out_the_whitespace_and_the_extra_properties(llm, model_dir):
    """disable_any_whitespace: no whitespace between JSON's tokens (a small model otherwise fills it with newlines);
    disable_additional_properties: an object schema that does not forbid other keys gets none; a whitespace
    pattern of one space. Greedy, each is transformers' greedy under the same grammar."""
    open_person = {key: value for key, value in PERSON.items() if key != "additionalProperties"}
    prompt = llm.engine.tokenize(CASES[0][0])

    def compact(text: str) -> bool:
        return not any(char in text for char in "\n\t") and ": " not in text and ", " not in text

    for constraint, check in (
            (StructuredOutputsParams(json=PERSON, disable_any_whitespace=True), compact),
            (StructuredOutputsParams(json=open_person, disable_additional_properties=True),
             lambda text: set(json.loads(text)) <= set(PERSON["properties"])),
            (StructuredOutputsParams(json_object=True, whitespace_pattern=" "),
             lambda text: "\n" not in text)):
        output = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
            temperature=0.0, max_tokens=80, structured_outputs=constraint), use_tqdm=False)[0].outputs[0]
        assert output.token_ids == hf_greedy_constrained(str(model_dir), prompt, 80, constraint.to_grammar(), eos(llm))
        if output.finish_reason == "stop":
            json.loads(output.text)
        assert check(output.text), (constraint, output.text)
    # Without the option this prompt's answer has the whitespace the first one takes out.
    plain = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=PERSON)),
        use_tqdm=False)[0].outputs[0].text
    assert not compact(plain), plain


def test_choices_are_matched_literally(llm):
    """Regex meta characters, spaces and characters outside ASCII in a choice are the characters themselves."""
    choices = ["a.b", "(x)|[y]", "50% off? $5 ^_^", "naïve café", "tab\there"]
    tokenizer = llm.engine.tokenizer
    for choice in choices:
        params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs={"choice": [choice]})
        output = llm.generate(["Say something."], params, use_tqdm=False)[0].outputs[0]
        assert output.text == choice and output.finish_reason == "stop"
        assert output.token_ids == llm.generate([{"prompt_token_ids": tokenizer.encode("Say something.")}], params,
                                                use_tqdm=False)[0].outputs[0].token_ids
    # A near miss of a meta character (any character for "."): refused once the grammar is past the prefix.
    matcher = llm.engine.structured_outputs.matcher(StructuredOutputsParams(choice=["a.b"]), [1])
    assert not all(matcher.accept(token) for token in tokenizer.encode("axb", add_special_tokens=False))
    assert matcher.error


def test_resumed_tokens_continue_the_grammar_where_it_was(llm):
    """A migration's continuation: the prompt plus the tokens already sent, num_resumed_tokens of them."""
    prompt = llm.engine.tokenize(CASES[0][0])
    constraint = StructuredOutputsParams(json=PERSON)
    whole = llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=constraint),
                         use_tqdm=False)[0].outputs[0].token_ids
    sent = whole[:7]
    resumed = StructuredOutputsParams(json=PERSON, num_resumed_tokens=len(sent))
    rest = llm.generate([{"prompt_token_ids": prompt + sent}],
                        SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=resumed),
                        use_tqdm=False)[0].outputs[0]
    assert rest.token_ids == whole[len(sent):] and rest.finish_reason == "stop"
    # Tokens the grammar would not have produced, or more than the prompt holds: refused.
    off_track = llm.engine.tokenize("Hello") + llm.engine.tokenizer.encode("[1, 2]", add_special_tokens=False)
    for ids, count in ((off_track, 3), (prompt, len(prompt) + 1)):
        with pytest.raises(InvalidRequest, match="num_resumed_tokens|do not follow"):
            llm.engine.add_request("resumed", None, SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
                json=PERSON, num_resumed_tokens=count)), prompt_token_ids=ids)
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def engines(model_dir):
    # Engines as a cluster's workers build them: 16-token blocks.
    return tuple(LLM(str(model_dir), num_kv_blocks=64, max_model_len=512, block_size=16).engine for _ in range(2))


def _run(engine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def assert_handover_is_one_engines(prefill, decode, prompt: list[int], params: SamplingParams) -> None:
    """The prefill engine samples the first token (max_tokens 1) and its KV goes to the decode engine, which goes
    on from it: the same tokens as the decode engine doing both, and a normal finish."""
    decode.add_request("whole", None, params, prompt_token_ids=prompt)
    expected = _run(decode)[-1].outputs[0].token_ids
    first = dataclasses.replace(params, max_tokens=1)
    prefill.add_request("p", None, first, prompt_token_ids=prompt, kv_transfer=KVTransferParams(save=True))
    first_token = _run(prefill)[-1].outputs[0].token_ids[0]
    assert first_token == expected[0]
    decode.add_request("d", None, params, prompt_token_ids=prompt, kv_transfer=KVTransferParams(load=True))
    source, target = torch.tensor(prefill.block_ids("p")), torch.tensor(decode.block_ids("d"))
    decode.model_runner.kv_cache[target] = prefill.model_runner.kv_cache[source]
    prefill.release_kv("p")
    decode.finish_remote_kv("d", first_token_id=first_token)
    output = _run(decode)[-1]
    assert output.finished and output.outputs[0].token_ids == expected
    assert output.outputs[0].finish_reason in ("stop", "length")


def test_the_decode_side_continues_the_prefill_sides_first_token_under_the_grammar(engines):
    """The prefill engine samples the first token under the grammar; the decode engine's grammar takes it and
    goes on: the same tokens as one engine doing both. A first token the grammar refuses ends the request
    with an error, and frees its blocks."""
    prefill, decode = engines
    prompt = prefill.tokenize(CASES[0][0])
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=PERSON))
    assert_handover_is_one_engines(prefill, decode, prompt, params)

    request = decode.add_request("refused", None, params, prompt_token_ids=prompt,
                                 kv_transfer=KVTransferParams(load=True))
    decode.finish_remote_kv("refused", first_token_id=decode.tokenizer.encode("Hi", add_special_tokens=False)[0])
    (output,) = _run(decode)
    assert output.finished and output.outputs[0].finish_reason == "error"
    assert request.status == RequestStatus.FINISHED_ERROR
    assert "does not follow the requested structure" in request.stop_reason
    assert decode.free_block_count == decode.num_kv_blocks
    assert prefill.free_block_count == prefill.num_kv_blocks


def test_warming_up_builds_the_grammar_tokenizer_before_any_request(tokenizer):
    """A worker's warm-up builds llguidance's tokenizer (about 0.3 s), so the first constrained request's matcher
    does not build it on the serving loop; a tokenizer without a fast backend says so instead of raising."""
    from splitserve.common.structured_outputs import StructuredOutputsParams
    from splitserve.engine.structured_output import StructuredOutputs

    outputs = StructuredOutputs(tokenizer, 49152, frozenset([tokenizer.eos_token_id]))
    assert outputs._ll_tokenizer is None
    assert outputs.warm_up()
    built = outputs._ll_tokenizer
    assert built is not None
    outputs.matcher(StructuredOutputsParams(json_object=True), [1])
    assert outputs._ll_tokenizer is built  # the matcher used it, built nothing again
    assert not StructuredOutputs(object(), 49152, frozenset([2])).warm_up()
