"""The Llama family (Llama, Mistral, Qwen2, Qwen3, Granite, Phi-3, SmolLM) over a paged KV cache.

Module names follow the Hugging Face checkpoints except that q/k/v and
gate/up projections are fused into one matrix each (one GEMM instead of three
or two); :meth:`LlamaForCausalLM.load_weights` fuses them while loading (Phi-3's
checkpoints hold them fused already, under the same names).
The layers shared with other families live beside it: ``rms_norm.py``,
``rotary_embedding.py`` and ``packed_linear.py``.

Inside the model, modules call each other's ``forward`` directly rather than through ``nn.Module.__call__``, whose
hook checks cost about a microsecond each, 274 times a step, and the rotary tables come in the kernels' layout once
a step rather than reshaped in every layer: with the C++ kernels, a 30-layer model as small as to be all overhead
took 2.57 ms a decode step against 3.00 (batch 1, medians of 5, three alternating processes of each, 2-core Intel
Xeon with AMX). No hooks are registered on these modules.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.common.model_info import ModelConfig
from splitserve.engine.attention import AttentionMetadata, paged_attention
from splitserve.engine.models.packed_linear import PackedLinear
from splitserve.engine.models.rms_norm import RMSNorm
from splitserve.engine.models.rotary_embedding import RotaryEmbedding, apply_rotary

# Up to this many rows, logits use the transposed copy of the head (decode of small batches), where the C++ small
# GEMM does not take them (see LlamaForCausalLM.use_kernels).
_SMALL_BATCH_ROWS = 4

# Up to this many rows, float32 logits come from the head's panels through the C++ small GEMM (use_kernels). SmolLM2's
# 113 MB head with the caches evicted, 2-core Zen 5, medians of 9: 1.6-1.7 ms from 1 to 4 rows against 4.1-11.6
# through the transposed copy and 1.6-2.0 in oneDNN; 2.2, 4.2 and 8.5 ms at 16, 32 and 64 rows against oneDNN's 3.3,
# 5.2 and 8.8; from 96 rows on oneDNN is 2-5% ahead.
_HEAD_SMALL_GEMM_MAX_ROWS = 64

# Steps of more rows run the MLP this many rows at a time, so that its intermediates stay in cache: a 256-row
# piece's gate/up output is 3 MB for SmolLM2 (2,048 rows: 25 MB, written to memory and read back twice, by
# SiLU-and-multiply and by the down projection). On a 2-core Emerald Rapids VM that streams 22 GB/s, the
# offline workload ran 7-11% faster than with 2,048-row pieces (medians of 4 alternating runs in one
# process: 256 rows 167.8-169.8 tok/s, 384-512 about 166, 1,024 162.6, 2,048 152.6-158.4). Pieces stay
# above splitserve/kernels/cpu_ops.small_gemm_max_rows(), so they run in oneDNN with the weights just used hot in
# cache; 128-row pieces went to the small GEMM, which streams its weights, and ran at 152.6. On a GPU the step
# runs whole: its intermediates live in device memory either way, and larger GEMMs fill more of the SMs.
_MLP_CHUNK_ROWS = 256

_UNINITIALISED = contextvars.ContextVar("splitserve_uninitialised_weights", default=False)


@contextlib.contextmanager
def uninitialised_weights():
    """Layers built inside leave their weights as allocated (``torch.empty``: pages untouched until the checkpoint
    is copied in) instead of drawing random ones. Building on the meta device does the same, but its first
    operation imports ``torch._dynamo``: 0.6 s of a worker's 4.7 s start on two Zen 4 cores."""
    token = _UNINITIALISED.set(True)
    try:
        yield
    finally:
        _UNINITIALISED.reset(token)


class _Linear(nn.Linear):
    def reset_parameters(self) -> None:
        if not _UNINITIALISED.get():
            super().reset_parameters()


class _Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        if not _UNINITIALISED.get():
            super().reset_parameters()


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_multiplier or self.head_dim**-0.5
        # A partial rotary (Phi-4-mini) turns each head's leading rotary_dim dimensions; None: the whole head.
        self.rotary_dim = config.rotary_dim
        self.qkv_proj = _Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = _Linear(self.q_size, config.hidden_size, bias=config.attention_bias and config.model_type != "qwen2")
        if config.qk_norm:  # Qwen3: an RMSNorm over each head of the queries, another over the keys'
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.kernels = None  # set by LlamaForCausalLM.use_kernels

    def forward(
        self,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rotary_tables: tuple[torch.Tensor, torch.Tensor],
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden: [tokens, hidden_size]; kv_cache: [2, kv_heads, num_blocks, block_size, head_dim]. Every
        token's K/V is written; ``output_rows`` (None: all) picks the rows whose output is projected and
        returned."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)
        # Queries and keys are rotated together: [tokens, q_heads + kv_heads, head_dim].
        query_key = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            self._normalize_heads(query_key)
        rotated = query_key if self.rotary_dim is None else query_key[..., : self.rotary_dim]  # a view, in place
        if self.kernels is not None:
            self.kernels.rotary_(rotated, *rotary_tables)
        elif self.rotary_dim is None:
            query_key = apply_rotary(query_key, *rotary_tables)
        else:
            rotated.copy_(apply_rotary(rotated, *rotary_tables))
        query, key = query_key.split_with_sizes([self.num_heads, self.num_kv_heads], dim=1)
        value = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(query, key, value, kv_cache[0], kv_cache[1], metadata, self.scale)
        out = out.view(num_tokens, self.q_size)
        return self.o_proj.forward(out if output_rows is None else out[output_rows])

    def _normalize_heads(self, query_key: torch.Tensor) -> None:
        """Qwen3's q_norm and k_norm, in place: each head's query and key scaled to unit RMS over head_dim, then
        by its norm's weight, before rotary (as transformers' Qwen3Attention). The rows go through the same RMSNorm
        kernels as the hidden states, as [tokens x heads, head_dim]."""
        query, key = query_key.split_with_sizes([self.num_heads, self.num_kv_heads], dim=1)
        query.copy_(self.q_norm.forward(query.reshape(-1, self.head_dim)).view_as(query))
        key.copy_(self.k_norm.forward(key.reshape(-1, self.head_dim)).view_as(key))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = _Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = _Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.kernels = None  # set by LlamaForCausalLM.use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, hidden] -> [tokens, hidden]. On CPU, a step of more than _MLP_CHUNK_ROWS tokens runs the
        gate/up projection and SiLU in pieces of that many rows, so that each piece's gate/up output (3 MB for
        SmolLM) is still in cache when SiLU reads it; with the kernels, SiLU writes each piece's rows of one
        [tokens, intermediate] tensor, which the down projection takes whole (no pieces to concatenate after it)."""
        if (x.shape[0] > _MLP_CHUNK_ROWS and x.device.type == "cpu"
                and not getattr(self.gate_up_proj, "needs_whole_batch", False)):  # LoRA deltas index whole steps
            if self.kernels is None:
                return torch.cat([self._forward(piece) for piece in x.split(_MLP_CHUNK_ROWS)])
            hidden = x.new_empty(x.shape[0], self.intermediate_size)
            for start in range(0, x.shape[0], _MLP_CHUNK_ROWS):
                rows = slice(start, start + _MLP_CHUNK_ROWS)
                self.kernels.silu_and_mul(self.gate_up_proj.forward(x[rows]), out=hidden[rows])
            return self.down_proj.forward(hidden)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)  # [tokens, 2 * intermediate]
        if self.kernels is not None:
            return self.down_proj.forward(self.kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier  # Granite's; 1.0 elsewhere

    def forward(self, hidden, residual, kv_cache, metadata, rotary_tables, output_rows=None):
        """The residual stream is carried separately so each residual add fuses with the norm after it.

        hidden: [tokens, hidden_size], the previous layer's MLP output (the embeddings for the first
        layer, with ``residual`` None). Returns (this layer's MLP output, residual stream before adding it),
        for the rows ``output_rows`` only where given (every token's K/V is still written).
        """
        if residual is None:
            residual = hidden
            normed = self.input_layernorm.forward(hidden)
        else:
            normed, residual = self.input_layernorm.forward(hidden, residual)
        attention_out = self.self_attn.forward(normed, kv_cache, metadata, rotary_tables, output_rows)
        if output_rows is not None:
            residual = residual[output_rows]
        if self.residual_multiplier != 1.0:
            attention_out = attention_out.mul_(self.residual_multiplier)
        normed, residual = self.post_attention_layernorm.forward(attention_out, residual)
        out = self.mlp.forward(normed)
        return (out if self.residual_multiplier == 1.0 else out.mul_(self.residual_multiplier)), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.embedding_multiplier = config.embedding_multiplier
        self.kernels = None  # set by LlamaForCausalLM.use_kernels: then the rotary tables are in the kernels' layout

    def forward(self, input_ids, positions, kv_caches, metadata, output_rows=None) -> torch.Tensor:
        hidden = self.embed_tokens.forward(input_ids)
        if self.embedding_multiplier != 1.0:  # Granite's
            hidden = hidden * self.embedding_multiplier
        rotary_tables = self.rotary.tables(positions, hidden.dtype, over_heads=self.kernels is None)
        residual = None
        last = len(self.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            rows = output_rows if index == last else None
            hidden, residual = layer.forward(hidden, residual, kv_cache, metadata, rotary_tables, rows)
        return self.norm.forward(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """The whole model: ``forward`` gives final hidden states, ``compute_logits`` the vocabulary scores."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions)
        if not config.tie_word_embeddings:
            self.lm_head = _Linear(config.hidden_size, config.vocab_size, bias=False)
        self._transposed_head: torch.Tensor | None = None
        self._packed_head: torch.Tensor | None = None
        # The C++ kernels and the head in their small GEMM's panels for logits of up to _head_panel_rows rows (see
        # use_kernels), or None.
        self._head_kernels = None
        self._head_panels: torch.Tensor | None = None
        self._head_panel_rows = 0

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [tokens]. Returns hidden states [tokens, hidden_size], or with ``output_rows``
        (int64 row indices) only those rows' [len(output_rows), hidden_size], in that order.

        A prompt step samples one row per finished prompt, and only the sampled rows' hidden states are ever
        read. Every layer but the last must still run every row (its output is the next layer's K/V), but the
        last layer's attention output projection and MLP need only the rows asked for: ``output_rows`` skips
        the others there, as llama.cpp does for the tokens it does not output. With SmolLM2-135M's 30 layers
        that is 2.8% of a long prompt step's GEMM work. The last layer's K/V is written for every row either
        way."""
        return self.model.forward(input_ids, positions, kv_caches, metadata, output_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [rows, hidden_size] -> logits [rows, vocab] (float32), divided by Granite's logits_scaling."""
        logits = self._head_logits(hidden)
        return logits if self.config.logits_scaling == 1.0 else logits.div_(self.config.logits_scaling)

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        kernels = self._head_kernels
        if kernels is not None and hidden.shape[0] <= self._head_panel_rows:
            if hidden.dtype == torch.bfloat16:
                return kernels.small_gemm_bfloat16(hidden, self._head_panels, None, self.config.vocab_size).float()
            return kernels.small_gemm(hidden, self._head_panels, None, self.config.vocab_size)
        if hidden.shape[0] <= _SMALL_BATCH_ROWS and self._transposed_head is not None:
            return torch.mm(hidden, self._transposed_head).float()
        if self._packed_head is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden, self._packed_head, None, "none", [], "").float()
        return F.linear(hidden, self._head_weight()).float()

    def use_kernels(self, kernels) -> None:
        """Run RMSNorm (fused with the residual add), rotary and SiLU-and-multiply through ``kernels``: the
        C++ kernels (``splitserve.kernels.cpu_ops``, float32 or bfloat16; call ``cpu_ops.available`` first), the Triton
        kernels (``splitserve.kernels.triton_ops``: the same functions and contracts), or None: the
        plain-torch code here, their reference. With the C++ kernels, packed projections also run
        decode-sized batches through their GEMM (:meth:`PackedLinear.use_kernels`), and so do the logits of a few
        rows: in float32 up to ``_HEAD_SMALL_GEMM_MAX_ROWS`` rows (the head's panels then replace its transposed
        copy, freeing as much memory as they take), in bfloat16 up to ``SMALL_GEMM_BFLOAT16_MAX_ROWS`` where the
        CPU has AVX512-BF16. A row times the head's [hidden, vocab] copy in ``torch.mm`` read its 57 MB
        (SmolLM2, bfloat16) at about 7 GB/s, 8 ms a token on a 2-core Emerald Rapids, where the panels stream at
        over 20; in float32 on a Zen 5 the 113 MB copy read at 28 GB/s, the panels at 69. Both small GEMMs sum
        each row on its own, so a row's logits are bit for bit the same whatever else the step holds."""
        head = self._head_weight()
        self._head_kernels, self._head_panels, self._head_panel_rows = None, None, 0
        if kernels is not None and head.device.type == "cpu":
            if (head.dtype == torch.bfloat16 and head.shape[1] % 2 == 0
                    and getattr(kernels, "small_gemm_bfloat16_supported", lambda: False)()):
                self._head_kernels, self._head_panels = kernels, kernels.pack_panels_bfloat16(head.detach())
                self._head_panel_rows = kernels.SMALL_GEMM_BFLOAT16_MAX_ROWS
            elif head.dtype == torch.float32 and getattr(kernels, "small_gemm_supported", lambda: False)():
                self._head_kernels, self._head_panels = kernels, kernels.pack_panels(head.detach())
                self._head_panel_rows = _HEAD_SMALL_GEMM_MAX_ROWS
        if self._head_panels is not None:
            self._transposed_head = None  # the panels serve every row count it would
        elif head.device.type == "cpu" and self._transposed_head is None:
            self.keep_transposed_head()
        for module in self.modules():
            if hasattr(module, "kernels"):
                module.kernels = kernels
            if isinstance(module, PackedLinear):
                module.use_kernels(kernels)

    def pack_linear_weights(self) -> None:
        """Replace every projection of every layer by a :class:`PackedLinear` (frees the dense weights)
        and keep a packed copy of the head beside the embeddings. Call after :meth:`load_weights`;
        float32 or bfloat16 (see :func:`can_pack_linear_weights`)."""
        for layer in self.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            attention.qkv_proj, attention.o_proj = PackedLinear(attention.qkv_proj), PackedLinear(attention.o_proj)
            mlp.gate_up_proj, mlp.down_proj = PackedLinear(mlp.gate_up_proj), PackedLinear(mlp.down_proj)
        self._packed_head = torch.ops.mkldnn._reorder_linear_weight(self._head_weight().detach(), None)

    def _head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def keep_transposed_head(self) -> None:
        """Keep a [hidden, vocab] copy of the head for logits of up to ``_SMALL_BATCH_ROWS`` rows (CPU: a
        vector times it reads memory in order, about twice as fast as through the [vocab, hidden] layout, on
        a 2-core Emerald Rapids). :meth:`use_kernels` makes it on CPU where the C++ small GEMM does not take
        those rows, at load, not on first use: the copy (113 MB for SmolLM2-135M) took about 100 ms and 27,000
        page faults inside the first small request's time to first token. Call after :meth:`load_weights`."""
        self._transposed_head = self._head_weight().t().contiguous()

    def load_weights(self, weights) -> None:
        """Copy Hugging Face checkpoint tensors in, fusing q/k/v and gate/up.

        Args:
            weights: iterable of (name, tensor) in Hugging Face naming, a causal LM's (``model.layers...``,
                ``lm_head``) or its base model's (``layers...``: transformers loads either into a causal LM).
        Raises:
            ValueError: a required tensor is missing or has the wrong shape.
        """
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if not name.startswith(("model.", "lm_head.")):  # a base model's checkpoint (an embedding model saved
                name = f"model.{name}"                       # as Qwen3Model, say): its layers without "model."
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = name, None
            for part, (fused_name, index) in fused.items():
                if f".{part}." in name:
                    target, shard = name.replace(part, fused_name), index
                    break
            if target not in params:
                continue  # e.g. unused buffers some checkpoints carry
            param = params[target]
            if shard is None:
                _copy_checked(param.data, tensor, name)
            else:
                _copy_checked(self._shard_view(target, param, shard), tensor, name)
            loaded.add(f"{target}#{shard}")
        self._check_all_loaded(params, loaded)

    def _shard_view(self, target: str, param: torch.Tensor, shard: int) -> torch.Tensor:
        config = self.config
        if "qkv_proj" in target:
            q_size = config.num_attention_heads * config.head_dim
            kv_size = config.num_key_value_heads * config.head_dim
            sizes = [q_size, kv_size, kv_size]
        else:
            sizes = [config.intermediate_size, config.intermediate_size]
        start = sum(sizes[:shard])
        return param.data.narrow(0, start, sizes[shard])

    def _check_all_loaded(self, params: dict, loaded: set[str]) -> None:
        missing = []
        for target in params:
            if f"{target}#None" in loaded:  # whole, fused or not (Phi-3's checkpoints hold qkv_proj, gate_up_proj)
                continue
            shards = 3 if "qkv_proj" in target else 2 if "gate_up_proj" in target else None
            keys = [f"{target}#{shard}" for shard in range(shards)] if shards else [f"{target}#None"]
            missing += [key for key in keys if key not in loaded]
        if missing:
            raise ValueError(f"The checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}.")


def _copy_checked(destination: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if destination.shape != source.shape:
        raise ValueError(f"Checkpoint tensor {name} has shape {tuple(source.shape)}, expected {tuple(destination.shape)}.")
    destination.copy_(source)
