"""LoRA adapters for the tests, made and run by PEFT (the reference): random, small, and on named projections."""

from __future__ import annotations

import functools
from pathlib import Path

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EVERY_PROJECTION = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
LORA_MAX_TOKENS = 16  # tokens of the references (conftest's lora_references)


def make_adapter(model_dir: str, directory: Path, seed: int, targets: list[str], rank: int = 8, alpha: int = 16,
                 std: float = 0.02, **options) -> Path:
    """A PEFT LoRA adapter of ``model_dir`` saved in ``directory``: A as PEFT initialises it, B drawn from
    N(0, std) with ``seed`` (PEFT's own B is zero, which would change nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, **options)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, std)
    model.save_pretrained(str(directory))
    return directory


@functools.lru_cache(maxsize=8)
def _peft_model(model_dir: str, adapter_dir: str):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(model_dir: str, adapter_dir: str, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """PEFT's greedy continuation of one prompt with the adapter (unmerged, float32), no padding; kept on disk
    (``tests.reference.cached``)."""
    import torch

    from tests.reference import cached

    def compute() -> list[int]:
        model = _peft_model(str(model_dir), str(adapter_dir))
        with torch.inference_mode():
            input_ids = torch.tensor([prompt_token_ids])
            output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=max_new_tokens, do_sample=False)
        return output[0, len(prompt_token_ids):].tolist()

    return cached("peft_greedy", [str(model_dir), str(adapter_dir)], [list(prompt_token_ids), max_new_tokens],
                  compute)


def peft_beams(model_dir: str, adapter_dir: str, prompt_token_ids: list[int], beam_width: int,
               max_new_tokens: int) -> list[list[int]]:
    """PEFT's beam search with the adapter (unmerged, float32), as ``tests.reference.hf_beams`` runs transformers':
    each beam's generated tokens, best first, cut after its end-of-sequence token."""
    from tests.reference import generate_beams

    return generate_beams(_peft_model(str(model_dir), str(adapter_dir)), prompt_token_ids, beam_width, max_new_tokens)


def peft_last_hidden_state(model_dir: str, adapter_dir: str, prompt_token_ids: list[int]):
    """PEFT's final hidden state (after the model's last norm) of the prompt's last token with the adapter, float32:
    what an embedding with the adapter is made of."""
    import torch

    model = _peft_model(str(model_dir), str(adapter_dir))
    with torch.inference_mode():
        return model.base_model.model.model(torch.tensor([prompt_token_ids])).last_hidden_state[0, -1].float()
