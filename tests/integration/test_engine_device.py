"""--device: where the engine runs. The resolution rules are checked for both devices here (pure functions);
the engine on CPU by device name; the engine on CUDA wherever torch finds a GPU (CI has none: those tests say
so in their skip reason)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from splitserve import LLM, BeamSearchParams, SamplingParams
from splitserve.engine.config import EngineConfig, resolve_attention_backend, resolve_device, resolve_dtype
from tests.reference import MAX_TOKENS, hf_beams, hf_greedy, hf_prompt_logprobs

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False: a CPU build of torch, or no GPU)"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


@pytest.mark.parametrize(("asked", "cuda_available", "resolved"), [
    ("auto", False, "cpu"), ("auto", True, "cuda"), ("cpu", True, "cpu"), ("cpu", False, "cpu"),
    ("cuda", True, "cuda"),
])
def test_the_device_resolves(asked, cuda_available, resolved):
    assert resolve_device(asked, cuda_available) == resolved


def test_cuda_without_a_cuda_device_is_refused_with_a_sentence():
    with pytest.raises(ValueError, match="torch finds no CUDA device here"):
        resolve_device("cuda", False)
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        EngineConfig(device="gpu")


@pytest.mark.parametrize(("backend", "device", "resolved"), [
    ("auto", "cpu", "auto"), ("auto", "cuda", "triton"), ("torch", "cuda", "torch"), ("triton", "cuda", "triton"),
    ("cpu", "cpu", "cpu"), ("torch", "cpu", "torch"),
])
def test_the_attention_backend_follows_the_device(backend, device, resolved):
    assert resolve_attention_backend(backend, device) == resolved


@pytest.mark.parametrize(("dtype", "device", "resolved"), [
    ("auto", "cpu", "float32"), ("auto", "cuda", "bfloat16"), ("float32", "cuda", "float32"),
    ("bfloat16", "cpu", "bfloat16"),
])
def test_the_dtype_follows_the_device(dtype, device, resolved):
    assert resolve_dtype(dtype, device) == resolved
    assert EngineConfig().dtype == "auto"


def test_the_cpp_kernels_are_refused_on_cuda():
    with pytest.raises(ValueError, match="runs on CPU only"):
        resolve_attention_backend("cpu", "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda is valid here")
def test_the_command_line_refuses_cuda_here_in_one_line(model_dir):
    result = subprocess.run([sys.executable, "-m", "splitserve.cli", "generate", "Hi", "--device", "cuda",
                             "--model", str(model_dir)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "torch finds no CUDA device here" in result.stderr


def test_the_engine_on_cpu_by_name_gives_transformers_tokens(model_dir, prompt_token_ids, hf_reference):
    llm = LLM(str(model_dir), num_kv_blocks=256, max_model_len=2048, device="cpu")
    runner = llm.engine.model_runner
    assert runner.device == "cpu" and runner.kv_cache.device.type == "cpu"
    assert runner.dtype_name == "float32" and runner.kv_cache.dtype == torch.float32  # dtype auto on CPU
    assert runner.decode_graphs is None  # CUDA graphs auto: nothing to capture on a CPU
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids[:3]], GREEDY)
    assert [output.outputs[0].token_ids for output in outputs] == hf_reference[:3]


@needs_cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_engine_on_cuda_gives_transformers_tokens(model_dir, prompt_token_ids, hf_reference, backend):
    # Eager steps: the torch backend is never captured (graphs auto), the Triton one is told not to be.
    llm = LLM(str(model_dir), num_kv_blocks=256, max_model_len=2048, device="cuda", dtype="float32",
              attention_backend=backend, cuda_graphs=None if backend == "torch" else False)
    runner = llm.engine.model_runner
    assert runner.kv_cache.device.type == "cuda" and runner.decode_graphs is None
    assert all(parameter.device.type == "cuda" for parameter in runner.model.parameters())
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids], GREEDY)
    assert [output.outputs[0].token_ids for output in outputs] == hf_reference


@needs_cuda
def test_forked_kv_on_cuda_beams_and_parallel_samples_are_transformers(model_dir, prompt_token_ids):
    # Forks copy a partial block on the device before the step (BlockCopy), then decode steps replay from graphs.
    llm = LLM(str(model_dir), num_kv_blocks=256, max_model_len=2048, device="cuda", dtype="float32",
              max_num_seqs=32, cuda_graphs=True)
    prompts = prompt_token_ids[:4]
    outputs = llm.beam_search([{"prompt_token_ids": ids} for ids in prompts], BeamSearchParams(4, 12))
    for ids, output in zip(prompts, outputs):
        assert [beam.tokens[len(ids):] for beam in output.sequences] == hf_beams(str(model_dir), ids, 4, 12)
    samples = llm.generate([{"prompt_token_ids": ids} for ids in prompts], SamplingParams(
        n=3, max_tokens=6, temperature=0.0))
    for ids, output in zip(prompts, samples):
        assert [completion.token_ids for completion in output.outputs] == [hf_greedy(str(model_dir), ids, 6)] * 3
    assert llm.engine.model_runner.decode_graphs.num_steps > 0
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks


@needs_cuda
def test_sampling_on_cuda_with_every_filter_and_penalty(model_dir):
    llm = LLM(str(model_dir), num_kv_blocks=128, max_model_len=1024, device="cuda", dtype="bfloat16")
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=3,
                            repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, logprobs=2)
    first, again = (llm.generate(["The capital of France is"], params)[0].outputs[0] for _ in range(2))
    assert first.token_ids == again.token_ids and len(first.token_ids) == 16  # a seed gives its tokens again
    assert all(len(position) >= 2 for position in first.logprobs)


@needs_cuda
def test_the_engine_on_cuda_defaults_to_bfloat16(model_dir):
    llm = LLM(str(model_dir), num_kv_blocks=64, max_model_len=1024)  # device auto, dtype auto
    runner = llm.engine.model_runner
    assert runner.device == "cuda" and runner.dtype_name == "bfloat16"
    assert runner.kv_cache.dtype == torch.bfloat16 and runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    # Graphs auto: decode steps captured up to max_num_seqs (256 on CUDA by default), the others in pieces up to
    # 2,048 tokens (the budget is 8,192).
    assert runner.decode_graphs.captured and max(runner.decode_graphs.graphs) == 256
    assert runner.piecewise_graphs.captured and max(runner.piecewise_graphs._pieces) == 2048
    output = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert len(output.outputs[0].token_ids) == 8 and runner.decode_graphs.num_steps == 7
    assert runner.piecewise_graphs.num_steps == 1  # the prompt


@needs_cuda
def test_decode_steps_replayed_from_cuda_graphs_give_transformers_tokens(model_dir, prompt_token_ids, hf_reference):
    # max_num_seqs 6: sizes 1, 2, 4, 8 are captured, so the batch of all prompts replays padded.
    llm = LLM(str(model_dir), num_kv_blocks=256, max_model_len=2048, device="cuda", dtype="float32",
              max_num_seqs=6, cuda_graphs=True)
    graphs = llm.engine.model_runner.decode_graphs
    assert graphs.captured and sorted(graphs.graphs) == [1, 2, 4, 8]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids], GREEDY)
    assert [output.outputs[0].token_ids for output in outputs] == hf_reference
    assert graphs.num_steps > 0  # decode steps went through the graphs, not the eager forward pass


@needs_cuda
@pytest.mark.parametrize("mode", ["full_and_piecewise", "piecewise"])
def test_prompt_steps_replayed_in_pieces_give_transformers_tokens(model_dir, prompt_token_ids, hf_reference, mode):
    # A 64-token budget: the long prompts prefill in chunks beside the others' decodes (mixed steps of up to 64
    # tokens, padded to 16, 32, 48 or 64), every one of them through the pieces, attention between them.
    llm = LLM(str(model_dir), num_kv_blocks=256, max_model_len=2048, device="cuda", dtype="float32",
              max_num_seqs=6, max_num_batched_tokens=64, cuda_graphs=True, cuda_graph_mode=mode)
    runner = llm.engine.model_runner
    pieces = runner.piecewise_graphs
    assert pieces.captured and sorted(pieces._pieces) == [16, 32, 48, 64]
    num_layers = runner.model_config.num_hidden_layers
    assert all(len(size.graphs) == num_layers + 1 and len(size.sites) == num_layers for size in pieces._pieces.values())
    assert (runner.decode_graphs is None) == (mode == "piecewise")
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids], GREEDY)
    assert [output.outputs[0].token_ids for output in outputs] == hf_reference
    assert pieces.num_steps > 0


@needs_cuda
def test_prompt_logprobs_with_cuda_graphs_are_transformers(model_dir, prompt_token_ids):
    # Requests scoring their prompts step beside the others through the pieces (their chunks' every row kept for
    # the logits), and a decode step holding a one-token chunk of theirs runs eagerly, not from the decode graphs.
    llm = LLM(str(model_dir), num_kv_blocks=256, max_model_len=2048, device="cuda", dtype="float32",
              max_num_seqs=6, max_num_batched_tokens=64, cuda_graphs=True)
    prompts = prompt_token_ids[1:7]
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    assert llm.engine.model_runner.piecewise_graphs.num_steps > 0
    for ids, output in zip(prompts, outputs):
        reference = hf_prompt_logprobs(str(model_dir), tuple(ids))
        assert len(output.prompt_logprobs) == len(ids) and output.prompt_logprobs[0] is None
        for position in range(1, len(ids)):
            row, entry = reference[position - 1], output.prompt_logprobs[position]
            assert entry[ids[position]] == pytest.approx(row[ids[position]].item(), abs=1e-3), position
            assert list(entry.values())[:2] == pytest.approx(row.topk(2).values.tolist(), abs=1e-3), position


def test_cuda_graphs_are_refused_on_a_cpu_with_a_sentence(model_dir):
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        LLM(str(model_dir), num_kv_blocks=16, max_model_len=256, device="cpu", cuda_graphs=True)


# ---- the KV cache's size on a GPU: what gpu_memory_utilization leaves (engine/gpu_memory.py) ----------------


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_largest_step_runs_on_a_scratch_cache_and_changes_nothing(model_dir, prompt_token_ids, hf_reference,
                                                                      backend):
    """The step an engine on CUDA runs at start to measure its activations, run here on the CPU (where nothing is
    measured): 600 prompt tokens as requests of at most 256 (256, 256 and 88 tokens) on a scratch cache, then 4
    rows through the sampler; the engine's own cache, its sampler's random state and its tokens are untouched."""
    llm = LLM(str(model_dir), num_kv_blocks=256, max_model_len=2048, device="cpu", attention_backend=backend)
    runner = llm.engine.model_runner
    state = runner.sampler.generator.get_state()
    size = runner.block_size
    block_bytes = runner.kv_cache[0].numel() * runner.kv_cache.element_size()
    assert runner.profile_step(600, 4, 256) == sum(-(-length // size) for length in (256, 256, 88)) * block_bytes
    assert runner.profile_step(40, 4, 256) == -(-40 // size) * block_bytes  # fewer tokens than sampled rows
    assert not runner.kv_cache.any()
    assert torch.equal(runner.sampler.generator.get_state(), state)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids[:3]], GREEDY)
    assert [output.outputs[0].token_ids for output in outputs] == hf_reference[:3]


def test_a_gpu_share_on_a_cpu_is_refused_with_a_sentence(model_dir):
    with pytest.raises(ValueError, match="gpu_memory_utilization sizes the KV cache of an engine on a GPU; this "
                                         "one runs on the CPU"):
        LLM(str(model_dir), device="cpu", gpu_memory_utilization=0.5)


@needs_cuda
def test_on_cuda_the_cache_takes_what_the_share_leaves(model_dir, prompt_token_ids, hf_reference):
    # A small share: make test-gpu runs eight test processes on the GPU at once.
    free, total = torch.cuda.mem_get_info()
    share = min(0.05, 0.5 * free / total)
    held_before = torch.cuda.memory_allocated()
    llm = LLM(str(model_dir), max_model_len=2048, device="cuda", dtype="float32", gpu_memory_utilization=share)
    runner = llm.engine.model_runner
    cache_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    held = torch.cuda.memory_allocated() - held_before  # weights, cache and the captured graphs' static buffers
    # The engine holds its share less one step's activations (under 2 GiB for this model), most of it cache.
    assert share * total - 2 * 1024**3 <= held <= share * total
    assert cache_bytes >= 0.5 * held
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids[:3]], GREEDY)
    assert [output.outputs[0].token_ids for output in outputs] == hf_reference[:3]


@needs_cuda
def test_on_cuda_a_share_too_small_for_the_weights_is_refused_with_a_sentence(model_dir):
    with pytest.raises(ValueError, match="leave nothing for the KV cache: raise gpu_memory_utilization"):
        LLM(str(model_dir), max_model_len=2048, device="cuda", gpu_memory_utilization=1e-6)


@needs_cuda
def test_structured_outputs_on_cuda_with_graphs_are_transformers_under_the_grammar(model_dir):
    """The grammar's masks built on the host and applied to logits on the GPU (the torch path of
    apply_token_bitmask), decode steps replayed from CUDA graphs: greedy under each constraint is transformers'
    greedy under the same grammar (float32); a seeded sampled answer keeps the shape."""
    import re

    from tests.e2e.test_structured_outputs import CASES, DATE
    from tests.reference import hf_greedy_constrained

    llm = LLM(str(model_dir), num_kv_blocks=256, max_model_len=1024, device="cuda", dtype="float32",
              max_num_seqs=8, cuda_graphs=True)
    assert llm.engine.model_runner.sampler.kernels is None  # the C++ kernels are CPU-only
    prompts = [llm.engine.tokenize(prompt) for prompt, *_ in CASES]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint)
              for _, constraint, max_tokens, _ in CASES]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    assert llm.engine.model_runner.decode_graphs.num_steps > 0
    eos = sorted(llm.engine.eos_token_ids)
    for (_, constraint, max_tokens, check), ids, output in zip(CASES, prompts, outputs):
        expected = hf_greedy_constrained(str(model_dir), ids, max_tokens, constraint.to_grammar(), eos)
        assert output.outputs[0].token_ids == expected, constraint.kind
        assert check(output.outputs[0].text) and output.outputs[0].finish_reason == "stop"
    sampled = llm.generate(["Pick a date."], SamplingParams(temperature=1.0, max_tokens=20, seed=4,
                                                            structured_outputs={"regex": DATE}))[0].outputs[0]
    assert re.fullmatch(DATE, sampled.text), sampled.text
