"""EngineConfig: everything that shapes one engine instance, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.reasoning import check_reasoning_parser
from splitserve.engine.request_queue import SCHEDULING_POLICIES
from splitserve.engine.speculative import SpeculativeConfig

_DTYPES = ("auto", "float32", "bfloat16")
_ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
_DEVICES = ("auto", "cpu", "cuda")
CUDA_GRAPH_MODES = ("full_and_piecewise", "full_decode_only", "piecewise")
DEFAULT_KV_CACHE_BYTES = 4 * 1024**3  # on a CPU, like vLLM-CPU's default KV space
# On a GPU, the share of its memory an engine may take in all (weights, activations, KV cache), as vLLM's default.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# max_num_seqs and max_num_batched_tokens by device when not given: on a CPU vLLM-CPU's server defaults; on a GPU
# vLLM's server defaults on GPUs (256 sequences; 8,192 tokens a step). A GPU step of a small model is bound by
# its launches (about 20 ms eager for SmolLM2's 30 layers on an H100 at any size: README "On an H100"), so a
# larger step costs little more and finishes prompts sooner; more sequences fill the GPU's decode steps.
DEFAULT_STEP_LIMITS = {"cpu": (64, 2048), "cuda": (256, 8192)}


@dataclass
class EngineConfig:
    """Configuration of one engine (one worker, or the offline ``LLM``).

    Attributes:
        model: path to a local Hugging Face model directory (None: the default model).
        dtype: weights, activations and KV cache dtype: "float32", "bfloat16", or "auto" (bfloat16 on CUDA,
            float32 on CPU, where greedy output is token-identical to transformers in float32; see
            :func:`resolve_dtype`). On a CPU with AVX512-BF16 or AMX, "bfloat16" runs the projections
            about twice as fast and halves the KV cache's bytes, with bfloat16's rounding.
        block_size: tokens per KV cache block.
        kv_cache_memory_bytes: KV cache budget in bytes (used when num_kv_blocks is None); None: 4 GiB on a
            CPU (DEFAULT_KV_CACHE_BYTES), and on CUDA what ``gpu_memory_utilization`` leaves.
        gpu_memory_utilization: on CUDA, when neither kv_cache_memory_bytes nor num_kv_blocks is set, the
            share of the GPU's memory this engine may take in all: its weights and its largest step's
            activations (measured at start by running one) come first, the KV cache gets the rest (vLLM's
            ``--gpu-memory-utilization``). None: DEFAULT_GPU_MEMORY_UTILIZATION (0.9). Set on a CPU, refused.
        num_kv_blocks: KV cache size in blocks; overrides the byte budget.
        max_num_seqs: most requests running at once (None: 64 on a CPU, 256 on CUDA; DEFAULT_STEP_LIMITS).
        max_num_batched_tokens: most tokens in one forward pass (the per-step budget; None: 2,048 on a CPU, 8,192
            on CUDA, and at least max_num_seqs).
        max_model_len: longest prompt + output (None: the model's max_position_embeddings).
        enable_chunked_prefill: split long prompts across steps, mixed with decodes.
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        scheduling_policy: the order waiting requests start in: "fcfs" (first come, first served) or "priority"
            (each request's priority, lower first, then arrival; vLLM's ``--scheduling-policy``); see
            ``engine/request_queue.py``.
        seed: seed of the random generator used by requests without their own seed.
        attention_backend: decode attention and the fused element-wise layer operations (RMSNorm
            with the residual add, rotary, SiLU-and-multiply) in "cpu" (the C++ kernels, float32),
            "torch" (the plain-torch reference), or "auto" (the kernels when they can be built);
            "triton": KV writes, decode and prefill attention in the Triton kernels (element-wise
            operations in torch), which on a CPU run only under TRITON_INTERPRET=1 (tests).
            On CUDA, "auto" is "triton" and "cpu" is refused.
        device: where the model, the KV cache, the step's tensors and sampling live: "cpu", "cuda" (the
            current CUDA device), or "auto" (cuda when torch finds one, else cpu); see :func:`resolve_device`.
        cuda_graphs: replay steps from CUDA graphs captured at start (CUDA and the Triton backend only): True
            asks for them (refused with a sentence where they cannot run), False never captures (vLLM's
            ``enforce_eager``), None captures wherever they can run (CUDA with the Triton backend), as vLLM
            does by default. Which steps: ``cuda_graph_mode``.
        cuda_graph_mode: with graphs, "full_and_piecewise" (vLLM's default name; None means it): decode-only
            steps of up to ``max_num_seqs`` requests captured whole (``engine/cuda_graphs.py``) and the other
            steps of up to 2,048 tokens in pieces around attention (``engine/piecewise_graphs.py``);
            "full_decode_only": the decode graphs alone; "piecewise": the pieces alone, for every step that
            fits (a prefill worker's).
        speculative_config: speculative decoding by n-gram prompt lookup (``engine/speculative.py``): a
            :class:`SpeculativeConfig`, a dict of its fields or their JSON text (vLLM's ``--speculative-config``,
            e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``); None: one token a step.
        enable_lora: serve LoRA adapters beside the base model (``engine/lora.py``; vLLM's ``--enable-lora``):
            requests may name one (a ``LoRARequest``). Steps then run eagerly (no CUDA graphs).
        max_loras: LoRA adapters one step may run (vLLM's default, 1); requests of others wait.
        max_lora_rank: the highest adapter rank accepted (vLLM's default, 16).
        max_cpu_loras: adapters kept loaded once no request holds them (None: max_loras).
        reasoning_parser: the model thinks in ``<think> ... </think>`` before it answers ("deepseek_r1" or
            "qwen3", vLLM's ``--reasoning-parser`` names): a request's structured output constrains only the
            tokens after its think block (``engine/structured_output.py``). None: from its first token.
    """

    model: str | None = None
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    attention_backend: str = "auto"
    device: str = "auto"
    cuda_graphs: bool | None = None
    cuda_graph_mode: str | None = "full_and_piecewise"
    speculative_config: SpeculativeConfig | dict | str | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        check_reasoning_parser(self.reasoning_parser)
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        _require_positive_int("max_loras", self.max_loras)
        _require_positive_int("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _require_positive_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}).")
        if self.enable_lora and self.cuda_graphs:
            raise ValueError("enable_lora runs steps eagerly: LoRA adapters are not captured in CUDA graphs "
                             "(leave cuda_graphs unset, or pass --enforce-eager).")
        if self.cuda_graph_mode is None:  # a flag left out
            self.cuda_graph_mode = CUDA_GRAPH_MODES[0]
        if self.cuda_graph_mode not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graph_mode must be one of {', '.join(CUDA_GRAPH_MODES)}, got "
                             f"{self.cuda_graph_mode!r}.")
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {', '.join(_DEVICES)}, got {self.device!r}.")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(_ATTENTION_BACKENDS)}, got {self.attention_backend!r}."
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                             f"{self.scheduling_policy!r}.")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}.")
        _require_positive_int("block_size", self.block_size)
        if self.max_num_seqs is None or self.max_num_batched_tokens is None:
            seqs, tokens = DEFAULT_STEP_LIMITS[likely_device(self.device)]
            if self.max_num_seqs is None:
                self.max_num_seqs = seqs
            if self.max_num_batched_tokens is None and isinstance(self.max_num_seqs, int):
                self.max_num_batched_tokens = max(tokens, self.max_num_seqs)
        if self.kv_cache_memory_bytes is not None:
            _require_positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        utilization = self.gpu_memory_utilization
        if utilization is not None and (isinstance(utilization, bool) or not isinstance(utilization, (int, float))
                                        or not 0 < utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be a share of the GPU's memory in (0, 1], got {utilization!r}.")
        if self.num_kv_blocks is not None:
            _require_positive_int("num_kv_blocks", self.num_kv_blocks)
        _require_positive_int("max_num_seqs", self.max_num_seqs)
        _require_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _require_positive_int("max_model_len", self.max_model_len)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}), so every running request can decode each step."
            )

    def resolve_max_model_len(self, model_max_len: int) -> int:
        """The effective length limit: the configured one, which may not exceed the model's."""
        if self.max_model_len is None:
            return model_max_len
        if self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's maximum "
                f"({model_max_len} positions)."
            )
        return self.max_model_len

    def check_fits(self, max_model_len: int, num_kv_blocks: int) -> None:
        """Refuse configurations that could never run a request of the full length."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"With chunked prefill off, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be at least max_model_len ({max_model_len}); lower max_model_len or "
                "enable chunked prefill."
            )
        blocks_needed = -(-max_model_len // self.block_size)
        if num_kv_blocks < blocks_needed:
            raise ValueError(
                f"The KV cache holds {num_kv_blocks} blocks of {self.block_size} tokens, fewer than "
                f"one request of max_model_len={max_model_len} needs ({blocks_needed}); raise the "
                "KV cache budget or lower max_model_len."
            )


def likely_device(device: str) -> str:
    """Where an engine asked to run on ``device`` will run ("cpu" or "cuda"), for defaults: like
    :func:`resolve_device`, but "cuda" without a CUDA device is left for the engine to refuse."""
    if device != "auto":
        return device
    import torch  # here, not at the top: the router imports nothing of torch, and never builds an EngineConfig

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str, cuda_available: bool) -> str:
    """The device an engine runs on: "cpu" or "cuda".

    Raises:
        ValueError: "cuda" asked for where torch finds no CUDA device (a sentence saying so).
    """
    if device == "auto":
        return "cuda" if cuda_available else "cpu"
    if device == "cuda" and not cuda_available:
        raise ValueError("device 'cuda' was asked for, but torch finds no CUDA device here "
                         "(torch.cuda.is_available() is False: a CPU build of torch, or no GPU); use --device cpu.")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype an engine on ``device`` ("cpu" or "cuda") runs in: "auto" is bfloat16 on CUDA (what vLLM and
    SGLang serve in there: half the bytes of every weight and KV read) and float32 on CPU."""
    if dtype == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return dtype


def resolve_attention_backend(backend: str, device: str) -> str:
    """The attention backend on ``device`` ("cpu" or "cuda"): "auto" stays "auto" on CPU (the C++ kernels
    when they build) and is "triton" on CUDA; "torch" runs anywhere.

    Raises:
        ValueError: the C++ kernels ("cpu") asked for on CUDA.
    """
    if device == "cuda":
        if backend == "cpu":
            raise ValueError("attention_backend 'cpu' (the C++ kernels) runs on CPU only; on CUDA use 'triton' "
                             "(the default there) or 'torch'.")
        return "triton" if backend == "auto" else backend
    return backend


def _require_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
