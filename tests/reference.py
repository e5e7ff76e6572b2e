"""Prompts and Hugging Face transformers reference outputs shared by the end-to-end tests.

transformers' (and PEFT's) continuations are computed once per machine and kept on disk (:func:`cached`), under
a key of every byte of the model (and adapter), the arguments, the CPU's kernel level and the torch, transformers
and PEFT versions: any change computes them again. ``SPLITSERVE_FRESH_REFERENCES=1`` computes every one afresh.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

_ANIMALS = ["fox", "owl", "whale", "tiger", "heron", "otter", "lynx", "crane", "bison", "gecko"]
_PLACES = ["river", "forest", "desert", "harbor", "valley", "glacier", "meadow", "canyon"]


def _long_story(num_items: int) -> str:
    lines = ["Field journal of a naturalist, written over one long summer.\n"]
    for index in range(num_items):
        animal = _ANIMALS[index % len(_ANIMALS)]
        place = _PLACES[(index * 3) % len(_PLACES)]
        lines.append(
            f"Day {index + 1}: near the {place} I watched a {animal} for {index % 7 + 2} hours; "
            f"it moved {['slowly', 'quickly', 'carefully'][index % 3]} and ate {index % 5 + 1} times."
        )
    lines.append("\nSummary of the summer, in one paragraph:")
    return "\n".join(lines)


# Eight prompts from a couple of tokens to over a thousand.
PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "Write a haiku about the sea.\n",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. Photosynthesis in plants generally involves the "
    "green pigment chlorophyll and generates oxygen as a byproduct. In simple terms, the three most "
    "important inputs are",
    _long_story(12),
    _long_story(40),
]
MAX_TOKENS = 24


@functools.lru_cache(maxsize=2)
def hf_model(model_dir: str, dtype_name: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype_name)).eval()


@functools.lru_cache(maxsize=32)
def files_digest(directory: str) -> str:
    """A digest of every file's name and bytes under ``directory`` (a model's or an adapter's folder)."""
    digest = hashlib.sha256()
    root = Path(directory)
    for path in sorted(item for item in root.rglob("*") if item.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 24), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _environment() -> list[str]:
    import peft
    import torch
    import transformers

    return [torch.__version__, transformers.__version__, peft.__version__, torch.backends.cpu.get_cpu_capability(),
            str(torch.get_num_threads())]


def cached(kind: str, directories: list[str], arguments: list, compute: Callable[[], object]) -> object:
    """``compute()``'s result (JSON), computed once per machine: kept in the cache folder under a key of ``kind``,
    the bytes under ``directories``, ``arguments`` and the libraries' versions; computed afresh where
    ``SPLITSERVE_FRESH_REFERENCES`` is set."""
    from splitserve.common.model_info import cache_dir

    if os.environ.get("SPLITSERVE_FRESH_REFERENCES"):
        return compute()
    key = json.dumps([kind, [files_digest(str(directory)) for directory in directories], arguments, _environment()],
                     sort_keys=True)
    path = cache_dir() / "test-references" / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(value))
    os.replace(partial, path)  # whole or not at all, for a test running beside this one
    return value


def hf_greedy(model_dir: str, prompt_token_ids: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """transformers' ``generate``, greedy, float32, one prompt at a time (no padding); ``generate_kwargs`` go to
    ``generate`` (``bad_words_ids``, ``prefix_allowed_tokens_fn``, ...). Kept on disk (:func:`cached`) unless a
    keyword argument is a function."""
    import torch

    def compute() -> list[int]:
        model = hf_model(model_dir)
        with torch.inference_mode():
            input_ids = torch.tensor([prompt_token_ids])
            output = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False,
                **generate_kwargs,
            )
        return output[0, len(prompt_token_ids):].tolist()

    if any(callable(value) for value in generate_kwargs.values()):
        return compute()
    return cached("hf_greedy", [model_dir], [list(prompt_token_ids), max_new_tokens, generate_kwargs], compute)


def hf_greedy_with_top(model_dir: str, prompt_token_ids: list[int], max_new_tokens: int, dtype_name: str,
                       top: int) -> tuple[list[int], list[dict[int, float]]]:
    """transformers' greedy continuation in ``dtype_name`` ("bfloat16", ...) and, per generated token, its
    ``top`` most likely tokens with their log probabilities."""
    import torch

    def compute() -> list:
        model = hf_model(model_dir, dtype_name)
        with torch.inference_mode():
            input_ids = torch.tensor([prompt_token_ids])
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True)
        tops = [torch.log_softmax(scores[0].float(), -1).topk(top) for scores in out.scores]
        return [out.sequences[0, len(prompt_token_ids):].tolist(),
                [[t.indices.tolist(), t.values.tolist()] for t in tops]]

    tokens, tops = cached("hf_greedy_with_top", [model_dir], [list(prompt_token_ids), max_new_tokens, dtype_name, top],
                          compute)
    return tokens, [dict(zip(indices, values)) for indices, values in tops]


@functools.lru_cache(maxsize=8)
def hf_prompt_logprobs(model_dir: str, prompt_token_ids: tuple[int, ...]):
    """transformers' log-softmax (float32) at every prompt position, [tokens, vocab]: row p scores token p + 1."""
    import torch

    with torch.inference_mode():
        logits = hf_model(model_dir)(torch.tensor([list(prompt_token_ids)])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first index where two token sequences differ (over their common length), or None."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def hf_greedy_constrained(model_dir: str, prompt_token_ids: list[int], max_new_tokens: int, grammar: str,
                          eos_token_ids: list[int], think_end: list[int] | None = None) -> list[int]:
    """:func:`_hf_greedy_constrained`, kept on disk (:func:`cached`, llguidance's version among the arguments)."""
    import llguidance

    return cached("hf_greedy_constrained", [model_dir],
                  [list(prompt_token_ids), max_new_tokens, grammar, list(eos_token_ids),
                   list(think_end) if think_end is not None else None, getattr(llguidance, "__version__", "")],
                  lambda: _hf_greedy_constrained(model_dir, prompt_token_ids, max_new_tokens, grammar, eos_token_ids,
                                                 think_end))


def _hf_greedy_constrained(model_dir: str, prompt_token_ids: list[int], max_new_tokens: int, grammar: str,
                           eos_token_ids: list[int], think_end: list[int] | None = None) -> list[int]:
    """transformers' greedy continuation, float32, under an llguidance grammar (its JSON form, e.g.
    ``StructuredOutputsParams.to_grammar()``): at each step every token the grammar's own matcher cannot take
    next gets -inf, from the tokenizer.json file as llguidance reads it. Ends once the grammar is complete (or
    ``max_new_tokens``), as the engine does, without the end-of-sequence token the grammar would then allow.
    With ``think_end`` (the token ids of ``</think>``) the grammar waits: no mask until the generated tokens have
    spelled it, and the grammar takes the tokens after it (an engine with a reasoning parser, its prompt in an
    open think block)."""
    import json
    from pathlib import Path

    import llguidance
    import torch

    tokenizer_json = json.dumps(json.loads((Path(model_dir) / "tokenizer.json").read_text()))
    model = hf_model(model_dir)
    vocab_size = model.config.vocab_size
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                          eos_token=eos_token_ids), grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    active = [think_end is None]  # whether the grammar has started

    def mask(input_ids, scores):  # a LogitsProcessor: -inf where the grammar cannot go next
        if not active[0]:
            return scores
        allowed = torch.zeros(scores.shape[-1], dtype=torch.bool)
        allowed[torch.from_numpy(numpy_bits(matcher.compute_bitmask(), vocab_size))] = True
        return scores.masked_fill(~allowed, float("-inf"))

    class Complete(StoppingCriteria):  # after each token: the grammar takes it; stop once it is complete
        def __call__(self, input_ids, scores, **kwargs):
            if not active[0]:  # the think block: does this token end </think>?
                generated = input_ids[0, len(prompt_token_ids):].tolist()
                active[0] = generated[-len(think_end):] == list(think_end)
                return False
            assert matcher.consume_token(int(input_ids[0, -1])), matcher.get_error()
            return matcher.is_stopped()

    with torch.inference_mode():
        input_ids = torch.tensor([prompt_token_ids])
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                do_sample=False, logits_processor=LogitsProcessorList([mask]),
                                stopping_criteria=StoppingCriteriaList([Complete()]))
    return output[0, len(prompt_token_ids):].tolist()


def numpy_bits(bitmask: bytes, vocab_size: int):
    """The token ids a bitmask (bit j of little-endian 32-bit word w: token 32 w + j) allows, as a numpy array."""
    import numpy

    bits = numpy.unpackbits(numpy.frombuffer(bitmask, dtype=numpy.uint8), bitorder="little")
    return numpy.flatnonzero(bits[:vocab_size])


def hf_beams(model_dir: str, prompt_token_ids: list[int], beam_width: int, max_new_tokens: int) -> list[list[int]]:
    """transformers' beam search (``num_beams`` and ``num_return_sequences`` ``beam_width``, length penalty 1, no
    early stopping), float32: the beams' generated tokens, best first, each cut after its end-of-sequence token
    (transformers pads the shorter ones). Kept on disk (:func:`cached`)."""
    return cached("hf_beams", [model_dir], [list(prompt_token_ids), beam_width, max_new_tokens],
                  lambda: generate_beams(hf_model(model_dir), prompt_token_ids, beam_width, max_new_tokens))


def generate_beams(model, prompt_token_ids: list[int], beam_width: int, max_new_tokens: int) -> list[list[int]]:
    """``model.generate``'s beams (a transformers or PEFT model; see :func:`hf_beams`), best first, each cut after
    its end-of-sequence token."""
    import torch

    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        input_ids = torch.tensor([prompt_token_ids])
        output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                num_beams=beam_width, num_return_sequences=beam_width, early_stopping=False,
                                length_penalty=1.0, max_new_tokens=max_new_tokens)
    return [row[: row.index(eos) + 1] if eos in row else row for row in output[:, len(prompt_token_ids):].tolist()]
