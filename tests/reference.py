"""Prompts and Hugging Face transformers reference outputs shared by the end-to-end tests."""

from __future__ import annotations

import functools

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


def hf_greedy(model_dir: str, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' ``generate``, greedy, float32, one prompt at a time (no padding)."""
    import torch

    model = hf_model(model_dir)
    with torch.inference_mode():
        input_ids = torch.tensor([prompt_token_ids])
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return output[0, len(prompt_token_ids):].tolist()


def hf_greedy_with_top(model_dir: str, prompt_token_ids: list[int], max_new_tokens: int, dtype_name: str,
                       top: int) -> tuple[list[int], list[dict[int, float]]]:
    """transformers' greedy continuation in ``dtype_name`` ("bfloat16", ...) and, per generated token, its
    ``top`` most likely tokens with their log probabilities."""
    import torch

    model = hf_model(model_dir, dtype_name)
    with torch.inference_mode():
        input_ids = torch.tensor([prompt_token_ids])
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_token_ids):].tolist()
    tops = [torch.log_softmax(scores[0].float(), -1).topk(top) for scores in out.scores]
    return tokens, [dict(zip(t.indices.tolist(), t.values.tolist())) for t in tops]


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
