"""The engine with ``attention_backend="triton"`` (KV writes, decode and prefill attention, RMSNorm with the
residual add, rotary and SiLU-and-multiply in the Triton kernels) gives the torch backend's greedy tokens; on a
CPU it refuses to start outside the interpreter.

On a CPU the Triton engine runs in Triton's interpreter, in a process of its own started with
``TRITON_INTERPRET=1`` (which must be set before that process imports triton, whatever this pytest process has
imported), on a tiny KV cache: the interpreter copies every tensor argument's whole storage back after each
launch, the cache included. It runs each operation of each program in Python, so its time is the kernel launches
a step makes, 8 per layer: the model here is the default model's first LAYERS layers (the whole of it, 30 layers,
took 165 s on a 2-core Zen 3), its greedy tokens compared with transformers' on the same weights as well as with
the torch backend's; the prompts are short, and the passes through the padded buffers generate fewer tokens. A
budget of 16 tokens a step splits the longest prompt, so a later chunk attends to context already in the paged
cache while the other requests decode. The step an engine on CUDA runs at start to size its cache
(``ModelRunner.profile_step``) runs here through the Triton kernels too, and so do the padded static buffers CUDA
graphs replay, decode steps whole and the other steps in pieces around attention (without capture).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from splitserve import LLM, SamplingParams
from tests.reference import hf_greedy

# The triton extra is installed by the test command: without it these tests fail (with the install hint).
pytestmark = pytest.mark.timeout(400)

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time, in a small village by the sea, there lived"]
MAX_TOKENS = 8
# The passes through the padded buffers generate fewer (each interpreted step costs seconds): their steps are the
# eager pass's steps, padded or split, and they must give its first tokens.
PADDED_TOKENS = 4
# The first layers of the default model: a Llama of SmolLM2's shapes whose steps launch a fifth of the kernels. Its
# text is no longer fluent, but its greedy choices are clear: at least 0.049 between the two largest logits of
# every step here (transformers), where the backends' sums differ by float32 rounding.
LAYERS = 6
ENGINE_OPTIONS = {"num_kv_blocks": 16, "max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 16,
                  "enable_prefix_caching": False}

_GENERATE = """
import json, sys
import torch
from splitserve import LLM, SamplingParams
model, options, prompts, max_tokens, padded_tokens = json.loads(sys.argv[1])
llm = LLM(model, attention_backend="triton", **options)
assert llm.engine.model_runner.use_triton_kernel
from splitserve.kernels import triton_ops
assert all(module.kernels is triton_ops for module in llm.engine.model_runner.model.modules() if hasattr(module, "kernels"))
def greedy(max_tokens):
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]
eager = greedy(max_tokens)
# The step an engine on CUDA runs at start to size its KV cache (engine/gpu_memory.py), here through the Triton
# kernels: two requests of 8 tokens on a scratch cache, 4 rows sampled; the engine's own cache stays as it was.
runner = llm.engine.model_runner
cache_before = runner.kv_cache.clone()
scratch = runner.profile_step(16, 4, 8)
assert scratch == 2 * runner.kv_cache[0].numel() * runner.kv_cache.element_size(), scratch
assert torch.equal(runner.kv_cache, cache_before)
# Decode-only steps again, through the static, padded buffers of engine/cuda_graphs.py (without capture: no GPU).
# Tables 64 tokens wide, not max_model_len's 256 (every request here stays under 30 tokens): the interpreter's
# time grows with the programs of a launch, and a wider table splits decode attention into more of them.
runner.decode_graphs = runner.make_decode_graphs(options["max_num_seqs"], 64, capture=False)
padded = greedy(padded_tokens)
# And the steps with prompt chunks through engine/piecewise_graphs.py's padded buffers, split at each attention
# (without capture): every such step here pads to 16 tokens, the one size for a budget of 16.
runner.piecewise_graphs = runner.make_piecewise_graphs(options["max_num_batched_tokens"], capture=False)
pieced = greedy(padded_tokens)
# A request scoring its prompt through the pieces: every row of its chunk is kept for the logits.
steps = runner.piecewise_graphs.num_steps
[scored] = llm.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
assert runner.piecewise_graphs.num_steps > steps
print(json.dumps([eager, padded, runner.decode_graphs.num_steps, pieced, runner.piecewise_graphs.num_steps,
                  scored.prompt_logprobs[1:]]))
"""


@pytest.fixture(scope="module")
def first_layers(model_dir, tmp_path_factory):
    """A model folder holding the default model's embedding, first LAYERS layers, final norm and head."""
    folder = tmp_path_factory.mktemp("first-layers")
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, folder / path.name)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] > LAYERS
    config["num_hidden_layers"] = LAYERS
    (folder / "config.json").write_text(json.dumps(config))
    kept = {}
    for path in model_dir.glob("*.safetensors"):
        for name, tensor in load_file(path).items():
            parts = name.split(".")
            if parts[:2] != ["model", "layers"] or int(parts[2]) < LAYERS:
                kept[name] = tensor
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_triton_backend_gives_the_torch_backends_greedy_tokens(first_layers):
    model_dir = first_layers
    arguments = json.dumps([str(model_dir), ENGINE_OPTIONS, PROMPTS, MAX_TOKENS, PADDED_TOKENS])
    result = subprocess.run(
        [sys.executable, "-c", _GENERATE, arguments], env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True, text=True, timeout=380,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    triton_tokens, padded_tokens, padded_steps, pieced_tokens, pieced_steps, scored = json.loads(
        result.stdout.strip().splitlines()[-1])

    reference = LLM(str(model_dir), attention_backend="torch", **ENGINE_OPTIONS)
    outputs = reference.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    torch_tokens = [output.outputs[0].token_ids for output in outputs]
    hf_tokens = [hf_greedy(str(model_dir), output.prompt_token_ids, MAX_TOKENS) for output in outputs]

    assert all(len(tokens) == MAX_TOKENS for tokens in torch_tokens)
    assert torch_tokens == hf_tokens
    assert triton_tokens == torch_tokens
    # Decode steps of 3 requests ran padded to 4 through the static buffers a CUDA graph replays.
    assert padded_steps > 0 and padded_tokens == [tokens[:PADDED_TOKENS] for tokens in torch_tokens]
    # Prompt chunks (3 prompts of 5 to 14 tokens, with decodes beside them) ran padded to 16 tokens, in pieces.
    assert pieced_steps > 0 and pieced_tokens == [tokens[:PADDED_TOKENS] for tokens in torch_tokens]
    # The prompt scored through the pieces is the torch backend's (float32 sums in another order).
    [expected] = reference.generate(PROMPTS[:1], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
                                    use_tqdm=False)
    assert [sorted(map(int, entry)) for entry in scored] == [sorted(entry) for entry in expected.prompt_logprobs[1:]]
    assert all(value == pytest.approx(entry[int(token)], abs=1e-4)
               for ours, entry in zip(scored, expected.prompt_logprobs[1:]) for token, value in ours.items())


def test_triton_backend_on_a_cpu_refuses_to_start_outside_the_interpreter(model_dir, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs only in Triton's interpreter: set TRITON_INTERPRET=1"):
        LLM(str(model_dir), attention_backend="triton", num_kv_blocks=16, max_model_len=256)
