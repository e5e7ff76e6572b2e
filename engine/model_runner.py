"""Turns a scheduled step into one forward pass and samples its next tokens.

Owns the model weights and the KV cache tensor, allocated once from the memory
budget: ``kv_cache`` is ``[num_blocks, layers, 2, kv_heads, block_size, head_dim]``
(block-major: a block is one contiguous piece), and ``kv_caches[layer]`` a view
of it, ``[2, kv_heads, num_blocks, block_size, head_dim]`` (keys, then values).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from splitserve.common.model_info import cache_dir
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.attention import AttentionMetadata, DecodeGroup, PrefillBatch, PrefillSpan
from splitserve.engine.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_BYTES,
    EngineConfig,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)
from splitserve.engine.cuda_graphs import DecodeGraphs, DecodeInputs
from splitserve.engine.gpu_memory import gpu_kv_cache_bytes, measure_step_bytes
from splitserve.engine.host_allocator import keep_freed_buffers_in_heap
from splitserve.engine.kv_cache_manager import BlockCopy
from splitserve.engine.logprobs import record_prompt_logprobs
from splitserve.engine.lora import LoRAManager
from splitserve.engine.models import ModelConfig, load_model
from splitserve.engine.piecewise_graphs import PiecewiseGraphs, piecewise_sizes
from splitserve.engine.pooling import pool
from splitserve.engine.request import Request
from splitserve.engine.sampling import Sampler
from splitserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from splitserve.kernels import cpu_ops, triton_attention, triton_ops

_ELEMENT_SIZE = {"float32": 4, "bfloat16": 2}


def num_kv_blocks_for_budget(config: EngineConfig, model_config: ModelConfig, dtype: str) -> int:
    """KV blocks of ``dtype`` (resolved: "float32" or "bfloat16") that fit the configured budget (None: the CPU's
    default, 4 GiB), or the explicit block count."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    bytes_per_token = model_config.kv_bytes_per_token // 4 * _ELEMENT_SIZE[dtype]
    budget = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES
    return max(1, budget // (bytes_per_token * config.block_size))


def _layer_views(kv_cache: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, a view [2, kv_heads, num_blocks, block_size, head_dim] of a block-major cache."""
    return [kv_cache[:, layer].permute(1, 2, 0, 3, 4) for layer in range(kv_cache.shape[1])]


def copy_block_prefixes(kv_cache: torch.Tensor, copies: list[BlockCopy]) -> None:
    """Copy the first ``num_tokens`` slots of each block ``src`` into block ``dst`` of a block-major cache, every
    layer's keys and values (forked requests' copies of their parents' partial blocks)."""
    for copy in copies:
        kv_cache[copy.dst, :, :, :, : copy.num_tokens].copy_(kv_cache[copy.src, :, :, :, : copy.num_tokens])


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """The KV cache, all zeros: on CUDA one device allocation; on CPU backed by a fresh anonymous mapping
    with huge pages.

    Slots past a sequence's end are read (and masked) by attention, so they must
    hold finite numbers: a zero attention weight times NaN is NaN. The kernel
    zero-fills an anonymous mapping page by page on first use, so the budget
    costs memory only as blocks are used, and nothing is written up front
    (writing gigabytes of zeros at start takes tens of seconds on a small VM).
    Huge pages make each first touch cover 2 MiB instead of 4 KiB.
    """
    if device != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    num_bytes = numel * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds a reference to the buffer, which lives as long as it does.
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def _use_cpu_kernel(backend: str, dtype: torch.dtype) -> bool:
    """Whether decode attention and the fused layer operations run in the C++ kernels (compiled on first
    use) or in plain torch."""
    if backend in ("torch", "triton"):
        return False
    usable = dtype in (torch.float32, torch.bfloat16) and cpu_ops.available(str(cache_dir()))
    if backend == "cpu" and not usable:
        raise ValueError("attention_backend='cpu' needs float32 or bfloat16 and a C++ compiler to build the kernel.")
    return usable


def _check_graphs_possible(device: str | None, backend: str) -> None:
    """Raise ValueError with a sentence where decode steps cannot be captured as CUDA graphs (device None: no
    capture, the padded static-buffer path alone, which needs only the Triton backend)."""
    if device is not None and device != "cuda":
        raise ValueError("cuda_graphs needs a CUDA device; this engine runs on the CPU.")
    if backend != "triton":
        raise ValueError("cuda_graphs needs the triton attention backend (the default on CUDA): the torch "
                         "reference builds a mask of each step's width, which a graph cannot replay.")


@dataclass
class SampledToken:
    request: Request
    token_id: int
    logprobs: dict[int, float] | None


@dataclass
class _BatchInputs:
    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64: each token's row of the rotary tables (its position, or past long_offset)
    metadata: AttentionMetadata
    sample_rows: list[int]  # rows whose logits are sampled, in the order of sample_requests
    sample_requests: list[Request]
    # (request, row, position) of the prompt positions whose logits give prompt logprobs (record_prompt_logprobs)
    prompt_rows: list[tuple[Request, int, int]]
    # Per row, the lora_int_id of its request's adapter (0: none)
    lora_ids: list[int]


class ModelRunner:
    """The model, its KV cache and the sampler of one engine.

    Args:
        config: the engine configuration (dtype, block size, budget, seed).
        model_dir: a Hugging Face model directory.
        model_config: its parsed configuration.
        max_model_len: positions the rotary tables must cover.
    """

    def __init__(self, config: EngineConfig, model_dir: str, model_config: ModelConfig, max_model_len: int) -> None:
        self.block_size = config.block_size
        self.model_config = model_config
        self.device = resolve_device(config.device, torch.cuda.is_available())
        if self.device == "cpu":
            keep_freed_buffers_in_heap()
        backend = self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        use_graphs = config.cuda_graphs
        if use_graphs is None:
            use_graphs = self.device == "cuda" and backend == "triton" and not config.enable_lora
        elif use_graphs:
            _check_graphs_possible(self.device, backend)  # before the weights load
        if self.device != "cuda" and config.gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization sizes the KV cache of an engine on a GPU; this one runs on the "
                             "CPU, where the cache takes kv_cache_memory_bytes (--kv-cache-gb, default 4 GiB).")
        self.dtype_name = resolve_dtype(config.dtype, self.device)
        held_before_load = torch.cuda.memory_allocated() if self.device == "cuda" else 0  # other engines' here
        self.model = load_model(model_dir, self.dtype_name, max_model_len, self.device)
        self.dtype = self.model.model.embed_tokens.weight.dtype
        self.use_cpu_kernel = _use_cpu_kernel(backend, self.dtype)
        # Prompt chunks attend in one C++ call over the paged cache where the kernel takes the head size. In
        # bfloat16 on CPUs with AMX the kernel multiplies in AMX tiles itself where it takes the head and block
        # sizes (cpu_ops.prefills_in_amx); where it does not, torch's SDPA does there, which reaches oneDNN's AMX
        # kernels and ran prompt attention 1.6-3.3x faster than the kernel's AVX-512 pair dot products, even
        # gathering the context first (benchmarks/cpu_attention.py --dtype bfloat16; docs/cpu-performance.md
        # "bfloat16 on CPUs").
        amx_cpu = self.dtype == torch.bfloat16 and cpu_ops.has_amx_bfloat16()
        self.use_cpu_prefill_kernel = (
            self.use_cpu_kernel and cpu_ops.prefill_supports(model_config.head_dim)
            and (not amx_cpu or cpu_ops.prefills_in_amx(model_config.head_dim, self.block_size)))
        # Triton: KV writes, all attention and the fused element-wise layer operations.
        self.use_triton_kernel = backend == "triton"
        if self.use_triton_kernel:
            triton_attention.check_usable(torch.device(self.device))
        self.model.use_kernels(cpu_ops if self.use_cpu_kernel else triton_ops if self.use_triton_kernel else None)
        self.lora = None if not config.enable_lora else LoRAManager(
            self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, self.dtype, self.device)
        use_pieces = bool(use_graphs) and config.cuda_graph_mode != "full_decode_only"
        self.num_blocks = self._num_kv_blocks(config, max_model_len, held_before_load, use_pieces)
        # Block-major: [num_blocks, layers, 2, kv_heads, block_size, head_dim]. One block holds its tokens'
        # KV for every layer in one contiguous piece, so KV connectors send and receive whole blocks
        # straight from and into the cache, without gathering (as SGLang's "page_first" host layout).
        self.kv_cache = allocate_kv_cache(self._cache_shape(self.num_blocks), self.dtype, self.device)
        # Per layer, a view [2, kv_heads, num_blocks, block_size, head_dim] (strided: blocks far apart).
        self.kv_caches = _layer_views(self.kv_cache)
        self.sampler = Sampler(config.seed, cpu_ops if self.use_cpu_kernel else None)
        self.decode_graphs: DecodeGraphs | None = None
        self.piecewise_graphs: PiecewiseGraphs | None = None
        if use_graphs and config.cuda_graph_mode != "piecewise":
            self.decode_graphs = self.make_decode_graphs(config.max_num_seqs, max_model_len, capture=True)
        if use_pieces:
            self.piecewise_graphs = self.make_piecewise_graphs(config.max_num_batched_tokens, capture=True)

    def make_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool) -> DecodeGraphs:
        """Static decode buffers over this runner's model and cache, their graphs captured when ``capture``.

        Raises:
            ValueError: capture asked for off CUDA, or outside the Triton backend (a sentence saying so).
        """
        _check_graphs_possible(self.device if capture else None, self.attention_backend)
        return DecodeGraphs(self.model, self.kv_caches, self.block_size, max_num_seqs, max_model_len, self.device,
                            capture)

    def make_piecewise_graphs(self, max_num_batched_tokens: int, capture: bool) -> PiecewiseGraphs:
        """Static buffers for steps with prompt chunks, their pieces captured when ``capture``.

        Raises:
            ValueError: capture asked for off CUDA, or outside the Triton backend (a sentence saying so).
        """
        _check_graphs_possible(self.device if capture else None, self.attention_backend)
        config = self.model_config
        return PiecewiseGraphs(self.model, self.kv_caches, config.num_attention_heads, config.head_dim, self.dtype,
                               max_num_batched_tokens, self.device, capture)

    def _cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        config = self.model_config
        return (num_blocks, config.num_hidden_layers, 2, config.num_key_value_heads, self.block_size, config.head_dim)

    def _num_kv_blocks(self, config: EngineConfig, max_model_len: int, held_before_load: int,
                       use_pieces: bool) -> int:
        """The cache's blocks: as configured, or on CUDA what ``gpu_memory_utilization`` leaves once the weights
        (what loading the model added to this process's CUDA memory) and the largest step's activations
        (measured by running one) are counted (``engine/gpu_memory.py``), and with piecewise graphs those of
        their largest size again (their memory pool holds them for the engine's life, beside an eager step's)."""
        if self.device != "cuda" or config.num_kv_blocks is not None or config.kv_cache_memory_bytes is not None:
            return num_kv_blocks_for_budget(config, self.model_config, self.dtype_name)
        weight_bytes = torch.cuda.memory_allocated() - held_before_load
        activation_bytes = measure_step_bytes(
            lambda: self.profile_step(config.max_num_batched_tokens, config.max_num_seqs, max_model_len))
        if use_pieces:
            largest = piecewise_sizes(config.max_num_batched_tokens)[-1]
            activation_bytes += measure_step_bytes(lambda: self.profile_step(largest, 1, max_model_len))
        free, total = torch.cuda.mem_get_info()
        utilization = config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        budget = gpu_kv_cache_bytes(total, free, utilization, weight_bytes, activation_bytes)
        block_bytes = math.prod(self._cache_shape(1)) * self.model.model.embed_tokens.weight.element_size()
        return max(1, budget // block_bytes)

    @torch.inference_mode()
    def profile_step(self, num_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
        """Run the largest step this engine can be given, on a scratch KV cache of its own: ``num_tokens`` prompt
        tokens (as few requests as ``max_model_len`` allows) through the model, then logits for ``max_num_seqs``
        rows through the sampler's most expensive path (a logit bias, penalties, top-k, top-p, log probabilities). For
        :func:`measure_step_bytes`; the engine's cache, its sampler's random state and the model are untouched.

        Returns: the scratch cache's bytes (freed on return).
        """
        lengths = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
        lengths = lengths[:max_num_seqs]
        blocks_per_request = [-(-length // self.block_size) for length in lengths]
        scratch = allocate_kv_cache(self._cache_shape(sum(blocks_per_request)), self.dtype, self.device)
        vocab_size = self.model_config.vocab_size
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, logprobs=20,
                                logit_bias={0: 1.0})
        scheduled, block_tables, first_block = [], {}, 0
        for index, (length, num_blocks) in enumerate(zip(lengths, blocks_per_request)):
            request = Request(f"profile-{index}", [(index + token) % vocab_size for token in range(length)], params)
            scheduled.append(ScheduledRequest(request, length, sample=True))
            block_tables[request.request_id] = list(range(first_block, first_block + num_blocks))
            first_block += num_blocks
        inputs = self._prepare(scheduled, block_tables)
        hidden = self.model(inputs.input_ids, inputs.positions, _layer_views(scratch), inputs.metadata)
        rows = min(max_num_seqs, hidden.shape[0])
        requests = [Request(f"profile-sample-{row}", [row % vocab_size], params) for row in range(rows)]
        Sampler(0)(self.model.compute_logits(hidden[:rows]), requests)
        return scratch.numel() * scratch.element_size()

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, block_tables: dict[str, list[int]]) -> list[SampledToken]:
        """Run the step's forward pass; sample a token for every request that reached its last known token."""
        copy_block_prefixes(self.kv_cache, output.block_copies)
        scheduled = output.scheduled
        graphs = self.decode_graphs
        if (graphs is not None and graphs.can_run(len(scheduled)) and all(item.num_new_tokens == 1 for item in scheduled)
                and not any(item.request.wants_prompt_logprobs for item in scheduled)):
            step, sample_rows, sample_requests = self._decode_rows(scheduled, block_tables)
            hidden = graphs.run(step)[sample_rows]
        else:
            inputs = self._prepare(scheduled, block_tables)
            sample_rows, sample_requests = inputs.sample_rows, inputs.sample_requests
            num_rows = inputs.input_ids.numel()
            pieces = self.piecewise_graphs
            every_row = None
            if pieces is not None and pieces.can_run(num_rows):
                every_row = pieces.run(inputs.input_ids, inputs.positions, inputs.metadata)
                hidden = every_row[sample_rows]
            elif len(sample_rows) == num_rows or inputs.prompt_rows:
                self._assign_lora_rows(inputs.lora_ids, None)
                every_row = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
                # ascending rows when every row is sampled
                hidden = every_row if len(sample_rows) == num_rows else every_row[sample_rows]
            else:  # only the sampled rows' hidden states are read: the last layer computes no others
                output_rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
                self._assign_lora_rows(inputs.lora_ids, sample_rows)
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, output_rows)
            if inputs.prompt_rows:
                record_prompt_logprobs(every_row, self.model.compute_logits, inputs.prompt_rows)
        if not sample_rows:
            return []
        if any(request.pooling_params is not None for request in sample_requests):
            hidden, sample_requests = self._take_embeddings(hidden, sample_requests)
            if not sample_requests:
                return []
        logits = self.model.compute_logits(hidden)
        if any(item.spec_token_ids for item in scheduled):
            return self._sample_with_drafts(logits, sample_requests, scheduled)
        sampled = self.sampler(logits, sample_requests)
        return [
            SampledToken(request, token_id, logprobs)
            for request, token_id, logprobs in zip(sample_requests, sampled.sampled_token_ids, sampled.logprobs)
        ]

    @staticmethod
    def _take_embeddings(hidden: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, list[Request]]:
        """The rows of embedding requests (their prompt's last token) give their embeddings (engine/pooling.py)
        instead of a token; returns the other rows and requests, to sample."""
        pooled = [row for row, request in enumerate(requests) if request.pooling_params is not None]
        for row, embedding in zip(pooled, pool(hidden[pooled], [requests[row].pooling_params for row in pooled])):
            requests[row].embedding = embedding
        kept = [row for row, request in enumerate(requests) if request.pooling_params is None]
        return hidden[kept], [requests[row] for row in kept]

    def _assign_lora_rows(self, lora_ids: list[int], output_rows: list[int] | None) -> None:
        if self.lora is not None:
            self.lora.prepare(lora_ids, output_rows)

    def _sample_with_drafts(self, logits: torch.Tensor, sample_requests: list[Request],
                            scheduled: list[ScheduledRequest]) -> list[SampledToken]:
        """A step where some requests verified drafts (their rows consecutive in ``sample_requests``): the others'
        rows are sampled together, each verifying request's rows give its accepted tokens
        (``Sampler.verify_drafts``), and its scheduled item records how many drafts were rejected. Tokens come
        back in row order, a request's together."""
        drafting = {id(item.request): item for item in scheduled if item.spec_token_ids}
        groups: list[tuple[int, int, ScheduledRequest | None]] = []  # (first row, rows, item), in row order
        row = 0
        while row < len(sample_requests):
            item = drafting.get(id(sample_requests[row]))
            count = 1 if item is None else len(item.spec_token_ids) + 1
            groups.append((row, count, item))
            row += count
        plain_rows = [first for first, _, item in groups if item is None]
        if plain_rows:
            sampled = self.sampler(logits[plain_rows], [sample_requests[row] for row in plain_rows])
            plain = iter(zip(sampled.sampled_token_ids, sampled.logprobs))
        tokens: list[SampledToken] = []
        for first, count, item in groups:
            if item is None:
                token_id, logprobs = next(plain)
                tokens.append(SampledToken(sample_requests[first], token_id, logprobs))
                continue
            rows = logits[first : first + count]
            accepted = self.sampler.verify_drafts(rows, item.request, item.spec_token_ids)
            item.num_rejected = count - len(accepted)
            tokens.extend(SampledToken(item.request, token_id, logprobs) for token_id, logprobs
                          in zip(accepted, self.sampler.draft_logprobs(rows, item.request, accepted)))
        return tokens

    def _decode_rows(self, decodes: list[ScheduledRequest], block_tables: dict[str, list[int]]
                     ) -> tuple[DecodeInputs, list[int], list[Request]]:
        """The one-token rows of ``decodes``, in their order, and which of them are sampled (rows, requests)."""
        size = self.block_size
        step = DecodeInputs([], [], [], [])
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        for row, item in enumerate(decodes):
            request = item.request
            position = request.num_computed_tokens
            table = block_tables[request.request_id]
            step.token_ids.append(request.all_token_ids[position])
            step.positions.append(position)
            step.rotary_positions.append(position + self._rotary_offset(request))
            step.slots.append(table[position // size] * size + position % size)
            step.block_tables.append(table)
            if item.sample:
                sample_rows.append(row)
                sample_requests.append(request)
        return step, sample_rows, sample_requests

    def _prepare(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]]) -> _BatchInputs:
        """Flatten the step: decodes (one token each, shortest context first), then prompt chunks."""
        decodes = sorted(
            (item for item in scheduled if item.num_new_tokens == 1), key=lambda item: item.request.num_computed_tokens
        )
        prefills = [item for item in scheduled if item.num_new_tokens > 1]
        step, sample_rows, sample_requests = self._decode_rows(decodes, block_tables)
        token_ids, positions, decode_tables = step.token_ids, step.positions, step.block_tables
        rotary_positions = list(step.rotary_positions)
        prompt_rows = [entry for row, item in enumerate(decodes)  # a one-token prompt chunk is a decode row
                       if item.request.sampling_params.prompt_logprobs is not None
                       for entry in _prompt_rows(item.request, row, positions[row], 1)]
        slot_mapping = [torch.tensor(step.slots, dtype=torch.int64, device=self.device)]
        # The C++ and Triton kernels read each request's own blocks: one group, no padding to worry about.
        one_group = self.use_cpu_kernel or self.use_triton_kernel
        ranges = [(0, len(decodes))] if one_group else group_by_length([p + 1 for p in positions])
        decode_groups = [
            self._decode_group(start, end, decode_tables[start:end], positions[start:end])
            for start, end in ranges
            if end > start
        ]

        spans = []
        for item in prefills:
            request = item.request
            start, end = request.num_computed_tokens, request.num_computed_tokens + item.num_new_tokens
            row = len(token_ids)
            token_ids.extend(request.all_token_ids[start : end - len(item.spec_token_ids)])
            token_ids.extend(item.spec_token_ids)
            positions.extend(range(start, end))
            offset = self._rotary_offset(request)
            rotary_positions.extend(range(start + offset, end + offset))
            table = torch.tensor(block_tables[request.request_id], dtype=torch.int64, device=self.device)
            spans.append(PrefillSpan(row, row + item.num_new_tokens, start, table))
            prompt_rows.extend(_prompt_rows(request, row, start, item.num_new_tokens))
            chunk_positions = torch.arange(start, end, device=self.device)
            slot_mapping.append(table[chunk_positions // self.block_size] * self.block_size + chunk_positions % self.block_size)
            if item.sample:  # the chunk's last row, or with drafts every row from the request's last token's
                first = row + item.num_new_tokens - 1 - len(item.spec_token_ids)
                sample_rows.extend(range(first, row + item.num_new_tokens))
                sample_requests.extend([request] * (row + item.num_new_tokens - first))

        metadata = AttentionMetadata(slot_mapping=torch.cat(slot_mapping), decode_groups=decode_groups, prefills=spans,
                                     use_cpu_kernels=self.use_cpu_kernel, use_triton_kernels=self.use_triton_kernel)
        if (self.use_triton_kernel or self.use_cpu_prefill_kernel) and spans:
            metadata.prefill_batch = PrefillBatch.from_spans(spans)
        return _BatchInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(rotary_positions, dtype=torch.int64, device=self.device),
            metadata=metadata,
            sample_rows=sample_rows,
            sample_requests=sample_requests,
            prompt_rows=prompt_rows,
            lora_ids=[_lora_id(item.request) for item in decodes]
            + [_lora_id(item.request) for item in prefills for _ in range(item.num_new_tokens)],
        )

    def _rotary_offset(self, request: Request) -> int:
        """How far past its position a request's row of the rotary tables is: RotaryEmbedding.long_offset for a
        request rotated with LongRoPE's long factors throughout (``request.long_rope``), else 0."""
        return self.model.model.rotary.long_offset if request.long_rope else 0

    def _decode_group(self, start: int, end: int, tables: list[list[int]], positions: list[int]) -> DecodeGroup:
        """Padded block tables, context lengths and (torch path) the key mask of decode rows [start, end)."""
        max_blocks = max(position // self.block_size + 1 for position in positions)
        rows = [table[:max_blocks] for table in tables]
        padded = [row + [0] * (max_blocks - len(row)) for row in rows]
        seq_lens = torch.tensor(positions, dtype=torch.int64, device=self.device) + 1
        group = DecodeGroup(start, end, torch.tensor(padded, dtype=torch.int64, device=self.device), seq_lens, None)
        if not (self.use_cpu_kernel or self.use_triton_kernel):
            padding = torch.arange(max_blocks * self.block_size, device=self.device).unsqueeze(0) >= seq_lens.unsqueeze(1)  # [requests, keys]
            num_kv_heads = self.model_config.num_key_value_heads
            group.mask = padding.unsqueeze(0).expand(num_kv_heads, -1, -1).reshape(num_kv_heads * len(tables), 1, -1)
        return group


def _lora_id(request: Request) -> int:
    return 0 if request.lora_request is None else request.lora_request.lora_int_id


def _prompt_rows(request: Request, row: int, start: int, count: int) -> list[tuple[Request, int, int]]:
    """(request, row, position) for the positions of a chunk (``count`` tokens from position ``start`` at step
    row ``row``) whose logits score a prompt token not yet scored: position p scores token p + 1."""
    if not request.wants_prompt_logprobs:
        return []
    first = max(start, len(request.prompt_logprobs) - 1)
    end = min(start + count, request.num_prompt_tokens - 1)
    return [(request, row + position - start, position) for position in range(first, end)]


# A decode group grows while padding it to its longest member wastes at most this fraction.
MAX_DECODE_PADDING = 0.25
MIN_DECODE_GROUP = 8


def group_by_length(lengths: list[int]) -> list[tuple[int, int]]:
    """Split ascending context lengths into contiguous groups with little padding.

    Each group is padded to its longest member; a group closes when adding the next
    request would pad more than MAX_DECODE_PADDING of its real length (but holds at
    least MIN_DECODE_GROUP requests, since every group costs a few kernel launches).

    Returns: [(start, end)] row ranges covering all of ``lengths``.
    """
    groups: list[tuple[int, int]] = []
    start, total = 0, 0
    for index, length in enumerate(lengths):
        count = index - start + 1
        if count > MIN_DECODE_GROUP and length * count > (1 + MAX_DECODE_PADDING) * (total + length):
            groups.append((start, index))
            start, total = index, 0
        total += length
    if lengths:
        groups.append((start, len(lengths)))
    return groups
