"""LoRA adapters served beside the base model (vLLM's ``--enable-lora``, ``LoRARequest``).

An adapter is a PEFT directory (``adapter_config.json`` and ``adapter_model.safetensors``) trained on the base model's
attention and MLP projections. Nothing is merged into the base weights: each projection of the model is wrapped in a
:class:`LoRALinear`, which adds ``scale * B(A(x))`` to the rows of the requests that named an adapter, so requests of
different adapters and of none share one step, as vLLM's and SGLang's multi-LoRA serving do. A step may hold the
requests of up to ``max_loras`` adapters (the scheduler keeps the rest waiting); :class:`LoRAManager` keeps up to
``max_cpu_loras`` adapters loaded, the least recently used going first once no request holds it.

The delta of one adapter over its rows is two small GEMMs per projection (``[rows, in] @ [in, r]``, then
``[rows, r] @ [r, out]``): for SmolLM2-135M at rank 8, 1.6 MFLOP a token a layer against the base's 13.5.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from splitserve.common.errors import InvalidRequest

# The projections an adapter may train, by the Hugging Face module name, and the fused projection each is a column
# range of (splitserve fuses q/k/v and gate/up: engine/models/llama.py).
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          "down_proj": ("down_proj", 0)}
# Most bytes of adapter weights read from one directory: a rank-256 adapter on every projection of an 8B Llama is
# about 1.3 GB in bfloat16; SmolLM2-135M's at rank 64 is 37 MB in float32.
MAX_ADAPTER_BYTES = 4 * 1024**3
# Steps of up to this many rows over several adapters take every adapter's delta in three operations, each row
# multiplying every adapter's A and B (masked to its own); larger steps (prompt chunks) one adapter's rows at a time,
# where the GEMMs outweigh the operations' count. Measured in benchmarks/lora.py: see the README's LoRA section.
MASKED_MAX_ROWS = 256
# The ranks vLLM accepts for max_lora_rank.
SUPPORTED_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with, as vLLM's: a name (what clients call it, e.g. an OpenAI ``model``), an id
    unique per adapter (positive), and the local PEFT directory it loads from."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name or len(self.lora_name) > 256:
            raise InvalidRequest("A LoRA adapter's name must be a non-empty string of at most 256 characters.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequest(f"A LoRA adapter's lora_int_id must be a positive integer, got {self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequest("A LoRA adapter needs lora_path, the local directory of its PEFT checkpoint.")


_cache_tags: dict[LoRARequest, str] = {}
_cache_tags_lock = threading.Lock()


def kv_store_tag(request: LoRARequest | None, cache_salt: str | None) -> str | None:
    """The tag a request's KV goes under outside its engine (LMCache): its adapter's (:func:`lora_cache_tag`; None
    for the base model) without a cache salt; with one, ``salted.`` and a SHA-256 digest of the adapter's tag and
    the salt (never the salt itself: Redis key names are readable by whoever reads Redis), so only requests with
    the same salt and adapter share the KV.

    Raises:
        InvalidRequest: the adapter's files cannot be read.
    """
    tag = lora_cache_tag(request)
    if cache_salt is None:
        return tag
    digest = hashlib.sha256(f"splitserve-cache-salt/{tag or ''}/".encode() + cache_salt.encode("utf-8", "surrogatepass"))
    return f"salted.{digest.hexdigest()[:48]}"


def lora_cache_tag(request: LoRARequest | None) -> str | None:
    """The tag a request's KV goes under outside its engine (LMCache, ``kvtransfer.lmcache_connector``): None for
    the base model; for an adapter, its name and a SHA-256 digest of its files (adapter_config.json and its
    safetensors), computed once per adapter. KV of a prompt under one adapter is then never found for the base model,
    for another adapter, or for another version of the same name, on any worker that shares the store; two workers
    whose copies of an adapter differ share none of its KV.

    Raises:
        InvalidRequest: the adapter's files cannot be read.
    """
    if request is None:
        return None
    with _cache_tags_lock:
        tag = _cache_tags.get(request)
    if tag is not None:
        return tag
    directory = Path(request.lora_path)
    digest = hashlib.sha256()
    try:
        for path in [directory / "adapter_config.json", *sorted(directory.glob("*.safetensors"))]:
            digest.update(path.name.encode() + b"\0")
            with open(path, "rb") as file:
                while block := file.read(1 << 20):
                    digest.update(block)
    except OSError as error:
        raise InvalidRequest(f"LoRA adapter {request.lora_name[:64]!r}: its files cannot be read "
                             f"({error.strerror or type(error).__name__}).") from None
    tag = f"{re.sub(r'[^A-Za-z0-9._-]', '_', request.lora_name[:64])}.{digest.hexdigest()[:32]}"
    with _cache_tags_lock:
        _cache_tags[request] = tag
    return tag


@dataclass
class LoRAAdapter:
    """One loaded adapter: per (layer, fused projection), the stacked A of its trained parts and each part's B.

    ``weights[(layer, fused)]`` is ``(a, parts)``: ``a`` [sum of ranks, in_features], the A matrices of the trained
    parts stacked by rows; ``parts`` [(part index, first row of a, rank, b)], ``b`` [part's out_features, rank]
    already multiplied by the adapter's scale (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).
    """

    request: LoRARequest
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, list[tuple[int, int, int, torch.Tensor]]]]
    # The same weights as LoRALinear multiplies them, made once per (layer, fused) when first put in a slot:
    # (A transposed [in_features, sum of ranks], B of every part transposed into its columns [sum of ranks,
    # out_features], zero elsewhere).
    expanded: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + sum(b.nbytes for *_, b in parts) for a, parts in self.weights.values())


def load_adapter(request: LoRARequest, num_layers: int, part_shapes: dict[str, tuple[int, int]],
                 max_rank: int, dtype: torch.dtype, device: str = "cpu") -> LoRAAdapter:
    """Read a PEFT LoRA directory for a model of ``num_layers`` layers whose projections have
    ``part_shapes[name] = (out_features, in_features)`` (Hugging Face names: q_proj ... down_proj).

    Raises:
        InvalidRequest: no such directory, not a LoRA checkpoint, a rank above ``max_rank``, a module or feature
            this engine does not serve (embeddings, the head, DoRA, trained biases, modules_to_save, alpha_pattern),
            or tensors whose shapes do not fit the base model (each with a sentence naming it).
    """
    directory = Path(request.lora_path)
    config = _read_config(directory, request.lora_name)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InvalidRequest(f"LoRA adapter {request.lora_name!r} has no adapter_model.safetensors: splitserve loads "
                             "safetensors adapters only (save with safe_serialization=True).")
    if sum(path.stat().st_size for path in files) > MAX_ADAPTER_BYTES:
        raise InvalidRequest(f"LoRA adapter {request.lora_name!r} holds more than {MAX_ADAPTER_BYTES >> 30} GiB.")
    try:
        tensors = _read_tensors(files)
    except Exception as error:  # safetensors' own error type, or OSError
        raise InvalidRequest(f"LoRA adapter {request.lora_name!r}: its safetensors cannot be read "
                             f"({type(error).__name__}).") from None
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        layer, part, kind = _parse_name(name, num_layers, request.lora_name)
        pairs.setdefault((layer, part), {})[kind] = tensor
    grouped: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for (layer, part), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise InvalidRequest(f"LoRA adapter {request.lora_name!r} has lora_A or lora_B of layer {layer} {part} "
                                 "without the other.")
        a, b = pair["A"], pair["B"]
        out_features, in_features = part_shapes[part]
        r = a.shape[0] if a.dim() == 2 else 0
        if r < 1 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, r):
            raise InvalidRequest(
                f"LoRA adapter {request.lora_name!r} does not fit this model: layer {layer} {part} has A "
                f"{tuple(a.shape)} and B {tuple(b.shape)}, where [r, {in_features}] and [{out_features}, r] are needed.")
        if r > max_rank:
            raise InvalidRequest(f"LoRA adapter {request.lora_name!r} has rank {r}, above this engine's max_lora_rank "
                                 f"({max_rank}); start it with a larger --max-lora-rank.")
        rank = max(rank, r)
        scale = alpha / (math.sqrt(r) if rslora else r)
        fused, index = _FUSED[part]
        grouped.setdefault((layer, fused), []).append((index, a.to(torch.float32), b.to(torch.float32) * scale))
    weights = {}
    for key, items in grouped.items():
        items.sort(key=lambda item: item[0])
        a = torch.cat([a for _, a, _ in items]).to(dtype=dtype, device=device)
        parts, row = [], 0
        for index, part_a, b in items:
            parts.append((index, row, part_a.shape[0], b.to(dtype=dtype, device=device)))
            row += part_a.shape[0]
        weights[key] = (a, parts)
    if not weights:
        raise InvalidRequest(f"LoRA adapter {request.lora_name!r} holds no LoRA weights.")
    return LoRAAdapter(request, rank, weights)


def _read_config(directory: Path, name: str) -> dict:
    path = directory / "adapter_config.json"
    if not path.is_file():
        raise InvalidRequest(f"LoRA adapter {name!r}: no adapter_config.json in its lora_path, which must be the "
                             "local directory of a PEFT LoRA checkpoint.")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise InvalidRequest(f"LoRA adapter {name!r}: adapter_config.json cannot be read "
                             f"({type(error).__name__}).") from None
    if not isinstance(config, dict):
        raise InvalidRequest(f"LoRA adapter {name!r}: adapter_config.json holds no JSON object.")
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidRequest(f"LoRA adapter {name!r} is not a LoRA adapter (peft_type "
                             f"{str(config.get('peft_type'))[:40]!r}).")
    refused = [("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (fully trained modules)"),
               ("alpha_pattern", "alpha_pattern (per-module alphas)"), ("fan_in_fan_out", "fan_in_fan_out")]
    for key, what in refused:
        if config.get(key):
            raise InvalidRequest(f"LoRA adapter {name!r} uses {what}, which splitserve does not serve.")
    if config.get("bias", "none") != "none":
        raise InvalidRequest(f"LoRA adapter {name!r} trains biases (bias {str(config['bias'])[:40]!r}), which splitserve does "
                             "not serve.")
    return config


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
    return tensors


def _parse_name(name: str, num_layers: int, adapter: str) -> tuple[int, str, str]:
    """(layer, Hugging Face projection, "A" or "B") of a PEFT tensor name such as
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``."""
    pieces = name.split(".")
    refusal = InvalidRequest(f"LoRA adapter {adapter!r} trains {name[:120]!r}: splitserve serves adapters of the "
                             "layers' attention and MLP projections only (q, k, v, o, gate, up, down).")
    if len(pieces) < 5 or pieces[-1] != "weight" or pieces[-2] not in ("lora_A", "lora_B"):
        raise refusal
    part = pieces[-3]
    if part not in _FUSED or "layers" not in pieces:
        raise refusal
    layer_text = pieces[pieces.index("layers") + 1]
    if not layer_text.isdigit() or int(layer_text) >= num_layers:
        raise InvalidRequest(f"LoRA adapter {adapter!r} names layer {layer_text[:20]!r}; this model has {num_layers}.")
    return int(layer_text), part, pieces[-2][-1]


class LoRARows:
    """Which rows of the step's tokens run which adapter slot: set by the model runner before each forward.

    ``groups``: [(slot, rows)] for the step's tokens, ``rows`` an int64 index tensor or None for every row;
    ``output_groups`` the same for the rows a forward with ``output_rows`` keeps in its last layer (fewer rows).
    """

    def __init__(self) -> None:
        self.num_rows = self.num_output_rows = 0
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        self.output_groups: list[tuple[int, torch.Tensor | None]] = []
        self._row_slots: list[int] = []  # per row of the step, its slot (-1: the base model)
        self._output_row_slots: list[int] = []
        self._device = "cpu"
        self._masks: dict[tuple, torch.Tensor] = {}  # this step's (see mask)

    def set(self, row_slots: list[int], output_rows: list[int] | None, device: str) -> None:
        """``row_slots[row]``: the adapter slot of each token row, -1 for the base model."""
        self.num_rows, self._row_slots, self._device, self._masks = len(row_slots), row_slots, device, {}
        self.groups = _groups(row_slots, device)
        self.num_output_rows = 0 if output_rows is None else len(output_rows)
        self._output_row_slots = [] if output_rows is None else [row_slots[row] for row in output_rows]
        self.output_groups = [] if output_rows is None else _groups(self._output_row_slots, device)

    def clear(self) -> None:
        self.num_rows, self.num_output_rows, self.groups, self.output_groups = 0, 0, [], []
        self._row_slots, self._output_row_slots, self._masks = [], [], {}

    def for_rows(self, num_rows: int) -> list[tuple[int, torch.Tensor | None]]:
        """The groups of a projection's input of ``num_rows`` rows: the step's tokens, or its output rows."""
        if num_rows == self.num_rows:
            return self.groups
        if num_rows == self.num_output_rows:
            return self.output_groups
        raise RuntimeError(f"A projection ran {num_rows} rows of a step of {self.num_rows} with LoRA adapters.")

    def mask(self, num_rows: int, columns: tuple[tuple[int, int], ...], dtype: torch.dtype) -> torch.Tensor:
        """[num_rows, sum of widths]: 1 where a row's slot owns the column, 0 elsewhere, for columns laid out as
        ``columns`` ((slot, width) blocks, in order). Made once a step per layout: the layers share it."""
        key = (num_rows == self.num_rows, columns, dtype)
        mask = self._masks.get(key)
        if mask is None:
            row_slots = self._row_slots if num_rows == self.num_rows else self._output_row_slots
            column_slots = [slot for slot, width in columns for _ in range(width)]
            rows = torch.tensor(row_slots, device=self._device).unsqueeze(1)
            mask = self._masks[key] = (rows == torch.tensor(column_slots, device=self._device)).to(dtype)
        return mask

    @property
    def active(self) -> bool:
        return bool(self.groups)


def _groups(row_slots: list[int], device: str) -> list[tuple[int, torch.Tensor | None]]:
    slots = sorted(set(row_slots) - {-1})
    if len(slots) == 1 and -1 not in row_slots:
        return [(slots[0], None)]
    return [(slot, torch.tensor([row for row, value in enumerate(row_slots) if value == slot], dtype=torch.int64,
                                device=device)) for slot in slots]


class LoRALinear(nn.Module):
    """A projection (``base``: any module with ``forward(x)``) plus the LoRA deltas of the adapters in its slots, on
    the rows ``rows`` assigns them. ``part_sizes``: the column ranges of the fused parts (q, k, v; gate, up; or one)."""

    def __init__(self, base: nn.Module, part_sizes: list[int], num_slots: int, rows: LoRARows) -> None:
        super().__init__()
        self.base = base
        self.part_starts = [sum(part_sizes[:index]) for index in range(len(part_sizes))]
        self.out_features = sum(part_sizes)
        self.rows = rows
        # Per slot: (A transposed, B expanded) of the adapter there for this projection (LoRAAdapter.expanded), or None.
        self.slots: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots
        self._version = 0  # counts changes of the slots, which the stacked weights follow
        self._stack_key: tuple = ()
        self._stack: tuple = ()

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put an adapter's (A transposed, B expanded) for this projection in ``slot`` (None: empty it)."""
        self.slots[slot] = weights
        self._version += 1

    def expand(self, weights: tuple[torch.Tensor, list]) -> tuple[torch.Tensor, torch.Tensor]:
        """(A transposed [in, R], B expanded [R, out_features]) of an adapter's ``(a, parts)`` for this projection:
        each part's B transposed into its columns and zero in the others', so that one GEMM gives the whole
        delta of every part (R, the sum of ranks, is a few dozen: the zeros cost little) and it is added to whole
        rows, where adding into each part's columns took a strided add per part."""
        a, parts = weights
        expanded = a.new_zeros(a.shape[0], self.out_features)
        for index, first, rank, b in parts:
            start = self.part_starts[index]
            expanded[first : first + rank, start : start + b.shape[0]] = b.t()
        return a.t().contiguous(), expanded

    @property
    def needs_whole_batch(self) -> bool:
        """Whether this step's input must come whole (the MLP then runs no pieces of rows)."""
        return self.rows.active

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in_features] -> [rows, out_features], with each adapter's rows' deltas added."""
        out = self.base.forward(x)
        if not self.rows.active:
            return out
        groups = [(slot, rows) for slot, rows in self.rows.for_rows(x.shape[0]) if self.slots[slot] is not None]
        if len(groups) == 1 and groups[0][1] is None:  # every row one adapter's: out += (x A^T) B^T in place
            a_t, b_expanded = self.slots[groups[0][0]]
            out.addmm_(torch.mm(x, a_t), b_expanded)
        elif groups and x.shape[0] <= MASKED_MAX_ROWS:
            # Every slot's A and B side by side, each row's shrunk values kept only in its own slot's columns:
            # three operations whatever the number of adapters, where a group each took four (a decode step of 32
            # rows over 4 adapters: 1,920 small operations, each paying torch's dispatch).
            a_t, b_expanded, columns = self._stacked([slot for slot, _ in groups])
            shrunk = torch.mm(x, a_t).mul_(self.rows.mask(x.shape[0], columns, x.dtype))  # [rows, sum of R]
            out.addmm_(shrunk, b_expanded)
        else:  # a group at a time: [rows, in] -> [rows, R] -> [rows, out_features], added to those rows
            for slot, rows in groups:
                a_t, b_expanded = self.slots[slot]
                out.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), a_t), b_expanded))
        return out

    def _stacked(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int], ...]]:
        """The A (transposed) and B of ``slots``' adapters side by side ([in, sum of R], [sum of R, out]) and their
        (slot, R) blocks, kept while the step's adapters stay the same."""
        key = (self._version, *slots)
        if self._stack_key != key:
            weights = [self.slots[slot] for slot in slots]
            columns = tuple((slot, a_t.shape[1]) for slot, (a_t, _) in zip(slots, weights))
            self._stack = (torch.cat([a_t for a_t, _ in weights], dim=1), torch.cat([b for _, b in weights]), columns)
            self._stack_key = key
        return self._stack


def wrap_model(model: nn.Module, num_slots: int) -> tuple[LoRARows, list[dict[str, LoRALinear]]]:
    """Wrap every projection of every layer of a Llama-family ``model`` (after its weights are packed and its
    kernels chosen) in a :class:`LoRALinear`. Returns the shared row assignment and, per layer, the wrappers by
    fused name."""
    config = model.config
    q_size, kv_size = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    rows = LoRARows()
    layers = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        wrappers = {
            "qkv_proj": LoRALinear(attention.qkv_proj, [q_size, kv_size, kv_size], num_slots, rows),
            "o_proj": LoRALinear(attention.o_proj, [config.hidden_size], num_slots, rows),
            "gate_up_proj": LoRALinear(mlp.gate_up_proj, [config.intermediate_size] * 2, num_slots, rows),
            "down_proj": LoRALinear(mlp.down_proj, [config.hidden_size], num_slots, rows),
        }
        attention.qkv_proj, attention.o_proj = wrappers["qkv_proj"], wrappers["o_proj"]
        mlp.gate_up_proj, mlp.down_proj = wrappers["gate_up_proj"], wrappers["down_proj"]
        layers.append(wrappers)
    return rows, layers


def part_shapes(config) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each Hugging Face projection of a model of ``config`` (a ModelConfig)."""
    q_size, kv_size = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, intermediate = config.hidden_size, config.intermediate_size
    return {"q_proj": (q_size, hidden), "k_proj": (kv_size, hidden), "v_proj": (kv_size, hidden),
            "o_proj": (hidden, q_size), "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
            "down_proj": (hidden, intermediate)}


class LoRAManager:
    """The adapters of one engine: loaded on a request's arrival, kept up to ``max_cpu_loras`` (least recently used
    first out, never one a request still holds), put in the model's ``max_loras`` slots as steps need them.

    Args:
        model: the engine's Llama-family model (wrapped here).
        max_loras: adapters one step may run (slots); max_rank: the highest rank accepted;
        max_cpu_loras: adapters kept loaded; dtype, device: of the model.
    """

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: str) -> None:
        self.config = model.config
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.dtype, self.device = dtype, device
        self.rows, self.layers = wrap_model(model, max_loras)
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # by lora_int_id, least recently used first
        self.holders: dict[int, int] = {}  # lora_int_id -> requests holding it
        self.slot_ids: list[int | None] = [None] * max_loras  # lora_int_id in each slot
        # Every adapter this engine ever took, by name: a name means one adapter for the engine's life, as cached KV
        # blocks are found by it.
        self.names: dict[str, LoRARequest] = {}

    def acquire(self, request: LoRARequest) -> None:
        """Load ``request``'s adapter if it is not loaded, and hold it for one request until :meth:`release`.

        Raises:
            InvalidRequest: the adapter cannot be loaded (``load_adapter``'s sentences), or its id is loaded under
                another name or path.
        """
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is not None and adapter.request != request:
            raise InvalidRequest(f"lora_int_id {request.lora_int_id} is adapter {adapter.request.lora_name!r} here; "
                                 "give each adapter an id of its own.")
        known = self.names.setdefault(request.lora_name, request)
        if known != request:  # its KV in the prefix cache is found by its name (lora_root_hash)
            raise InvalidRequest(f"LoRA adapter name {request.lora_name!r} is lora_int_id {known.lora_int_id} here, "
                                 "from another directory or under another id; give each adapter a name of its own.")
        if adapter is None:
            adapter = load_adapter(request, self.config.num_hidden_layers, part_shapes(self.config), self.max_rank,
                                   self.dtype, self.device)
            self.adapters[request.lora_int_id] = adapter
        self.adapters.move_to_end(request.lora_int_id)
        self.holders[request.lora_int_id] = self.holders.get(request.lora_int_id, 0) + 1
        self._evict()

    def release(self, request: LoRARequest) -> None:
        """A request that held ``request``'s adapter finished."""
        count = self.holders.get(request.lora_int_id, 0) - 1
        if count > 0:
            self.holders[request.lora_int_id] = count
        else:
            self.holders.pop(request.lora_int_id, None)
        self._evict()

    def _evict(self) -> None:
        for lora_id in list(self.adapters):
            if len(self.adapters) <= self.max_cpu_loras:
                return
            if lora_id not in self.holders:
                del self.adapters[lora_id]
                if lora_id in self.slot_ids:
                    self._fill_slot(self.slot_ids.index(lora_id), None)

    def prepare(self, row_ids: list[int], output_rows: list[int] | None) -> None:
        """Assign the step's token rows (``row_ids[row]``: the lora_int_id of the row's request, 0 for none) to
        slots, loading adapters into slots that no adapter of this step uses."""
        if not any(row_ids):
            self.rows.clear()
            return
        wanted = set(row_ids) - {0}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"A step holds {len(wanted)} LoRA adapters; max_loras is {self.max_loras}.")
        free = [slot for slot, lora_id in enumerate(self.slot_ids) if lora_id not in wanted]
        for lora_id in wanted - set(self.slot_ids):
            self._fill_slot(free.pop(0), lora_id)
        slot_of = {lora_id: slot for slot, lora_id in enumerate(self.slot_ids) if lora_id is not None}
        self.rows.set([slot_of[lora_id] if lora_id else -1 for lora_id in row_ids], output_rows, self.device)

    def _fill_slot(self, slot: int, lora_id: int | None) -> None:
        self.slot_ids[slot] = lora_id
        adapter = None if lora_id is None else self.adapters[lora_id]
        for index, wrappers in enumerate(self.layers):
            for fused, wrapper in wrappers.items():
                key = (index, fused)
                if adapter is None or key not in adapter.weights:
                    wrapper.set_slot(slot, None)
                    continue
                if key not in adapter.expanded:
                    adapter.expanded[key] = wrapper.expand(adapter.weights[key])
                wrapper.set_slot(slot, adapter.expanded[key])
