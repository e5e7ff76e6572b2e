"""LoRA adapters (engine/lora.py): PEFT directories read and refused, per-row deltas against plain torch, the
manager's loading, eviction and slots, the scheduler's max_loras admission, and the adapters' own prefix hashes.

Adapters are written here by hand in PEFT's format (safetensors plus adapter_config.json) for a tiny model of 2 layers,
hidden 8, 2 query heads and 1 KV head of head_dim 4, intermediate 12. Weights, inputs and scales are small integers
and powers of two, so that every delta is exact and compared with ``torch.equal``.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import splitserve.engine.lora as lora_module
from splitserve.common.block_hash import hash_block_tokens, lora_root_hash
from splitserve.common.errors import InvalidRequest
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.lora import LoRALinear, LoRAManager, LoRARequest, LoRARows, load_adapter, part_shapes, wrap_model
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.scheduler import Scheduler

CONFIG = SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, head_dim=4, num_key_value_heads=1,
                         intermediate_size=12)
SHAPES = part_shapes(CONFIG)  # q (8, 8), k (4, 8), v (4, 8), o (8, 8), gate/up (12, 8), down (8, 12)
# Columns of each Hugging Face projection in the fused projection splitserve runs: (part, first column, width).
COLUMNS = {"qkv_proj": [("q_proj", 0, 8), ("k_proj", 8, 4), ("v_proj", 12, 4)], "o_proj": [("o_proj", 0, 8)],
           "gate_up_proj": [("gate_proj", 0, 12), ("up_proj", 12, 12)], "down_proj": [("down_proj", 0, 8)]}
FUSED_SHAPES = {"qkv_proj": (16, 8), "o_proj": (8, 8), "gate_up_proj": (24, 8), "down_proj": (8, 12)}


def peft_name(layer: int, part: str, kind: str) -> str:
    module = "mlp" if part in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{module}.{part}.lora_{kind}.weight"


def integers(generator: torch.Generator, *shape: int, low: int = -2, high: int = 3) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=generator).to(torch.float32)


def lora_pairs(ranks: dict[tuple[int, str], int], seed: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Integer A [r, in] and B [out, r] for each (layer, part) of ``ranks``."""
    generator = torch.Generator().manual_seed(seed)
    pairs = {}
    for (layer, part), rank in ranks.items():
        out_features, in_features = SHAPES[part]
        pairs[(layer, part)] = (integers(generator, rank, in_features), integers(generator, out_features, rank))
    return pairs


def write_adapter(directory: Path, tensors: dict[str, torch.Tensor] | bytes | None, config_text: str | None = None,
                  **config) -> Path:
    """A PEFT LoRA directory: ``tensors`` in adapter_model.safetensors (bytes: written as they are; None: no file),
    adapter_config.json from PEFT's defaults updated by ``config`` (``config_text``: that text instead)."""
    directory.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "tiny", "r": 2,
                "lora_alpha": 4, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "use_rslora": False,
                "use_dora": False, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
                "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True}
    settings.update(config)
    (directory / "adapter_config.json").write_text(config_text if config_text is not None else json.dumps(settings))
    if isinstance(tensors, bytes):
        (directory / "adapter_model.safetensors").write_bytes(tensors)
    elif tensors is not None:
        save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def write_pairs(directory: Path, pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], **config) -> Path:
    tensors = {}
    for (layer, part), (a, b) in pairs.items():
        tensors[peft_name(layer, part, "A")], tensors[peft_name(layer, part, "B")] = a, b
    return write_adapter(directory, tensors, **config)


def load(directory: Path, max_rank: int = 8, name: str = "tiny-lora") -> lora_module.LoRAAdapter:
    return load_adapter(LoRARequest(name, 1, str(directory)), CONFIG.num_hidden_layers, SHAPES, max_rank,
                        torch.float32)


# ---- load_adapter ------------------------------------------------------------


def test_parts_stack_in_qkv_order_whatever_the_files_order_with_each_scale_folded_into_b(tmp_path):
    # Written v, down, q, k, o: the loader stacks q, k, v by part, and scales each B by lora_alpha / its rank.
    ranks = {(0, "v_proj"): 3, (1, "down_proj"): 2, (0, "q_proj"): 2, (0, "k_proj"): 1, (1, "o_proj"): 4}
    pairs = lora_pairs(ranks, seed=0)
    adapter = load(write_pairs(tmp_path / "adapter", pairs, lora_alpha=16))
    assert adapter.rank == 4
    assert adapter.request == LoRARequest("tiny-lora", 1, str(tmp_path / "adapter"))
    assert sorted(adapter.weights) == [(0, "qkv_proj"), (1, "down_proj"), (1, "o_proj")]

    a, parts = adapter.weights[(0, "qkv_proj")]
    (aq, bq), (ak, bk), (av, bv) = pairs[(0, "q_proj")], pairs[(0, "k_proj")], pairs[(0, "v_proj")]
    assert torch.equal(a, torch.cat([aq, ak, av]))
    assert [(index, first, rank) for index, first, rank, _ in parts] == [(0, 0, 2), (1, 2, 1), (2, 3, 3)]
    for (*_, b), expected in zip(parts, [bq * (16 / 2), bk * (16 / 1), bv * (16 / 3)]):
        assert b.dtype == torch.float32 and torch.equal(b, expected)

    a, [(index, first, rank, b)] = adapter.weights[(1, "o_proj")]
    ao, bo = pairs[(1, "o_proj")]
    assert (index, first, rank) == (0, 0, 4) and torch.equal(a, ao) and torch.equal(b, bo * 4.0)
    numbers = sum(a.numel() + b.numel() for a, b in pairs.values())
    assert adapter.nbytes == 4 * numbers


@pytest.mark.parametrize(("use_rslora", "scale"), [(False, 8 / 4), (True, 8 / math.sqrt(4))])
def test_the_scale_is_alpha_over_the_rank_or_over_its_square_root_with_rslora(tmp_path, use_rslora, scale):
    pairs = lora_pairs({(0, "gate_proj"): 4, (0, "up_proj"): 4}, seed=1)
    adapter = load(write_pairs(tmp_path / "adapter", pairs, r=4, lora_alpha=8, use_rslora=use_rslora))
    a, parts = adapter.weights[(0, "gate_up_proj")]
    assert torch.equal(a, torch.cat([pairs[(0, "gate_proj")][0], pairs[(0, "up_proj")][0]]))
    assert torch.equal(parts[0][3], pairs[(0, "gate_proj")][1] * scale)
    assert torch.equal(parts[1][3], pairs[(0, "up_proj")][1] * scale)
    assert scale == (4.0 if use_rslora else 2.0)


def test_weights_are_loaded_in_the_models_dtype(tmp_path):
    pairs = lora_pairs({(1, "q_proj"): 2}, seed=2)
    directory = write_pairs(tmp_path / "adapter", {key: (a.to(torch.bfloat16), b.to(torch.bfloat16))
                                                   for key, (a, b) in pairs.items()})
    adapter = load_adapter(LoRARequest("tiny-lora", 1, str(directory)), 2, SHAPES, 8, torch.float64)
    a, [(_, _, _, b)] = adapter.weights[(1, "qkv_proj")]
    assert a.dtype == b.dtype == torch.float64
    assert torch.equal(a, pairs[(1, "q_proj")][0].double()) and torch.equal(b, pairs[(1, "q_proj")][1].double() * 2)


def _valid_q(rank: int = 2, layer: int = 0) -> dict[str, torch.Tensor]:
    return {peft_name(layer, "q_proj", "A"): torch.ones(rank, 8), peft_name(layer, "q_proj", "B"): torch.ones(8, rank)}


REFUSALS = [
    pytest.param(dict(config_text="{not json"), "adapter_config.json cannot be read (JSONDecodeError)",
                 id="unreadable-config"),
    pytest.param(dict(config_text="[]"), "adapter_config.json holds no JSON object", id="config-not-an-object"),
    pytest.param(dict(peft_type="PREFIX_TUNING"), "is not a LoRA adapter (peft_type 'PREFIX_TUNING')", id="not-lora"),
    pytest.param(dict(use_dora=True), "uses DoRA", id="dora"),
    pytest.param(dict(modules_to_save=["lm_head"]), "uses modules_to_save", id="modules-to-save"),
    pytest.param(dict(alpha_pattern={"q_proj": 32}), "uses alpha_pattern", id="alpha-pattern"),
    pytest.param(dict(fan_in_fan_out=True), "uses fan_in_fan_out", id="fan-in-fan-out"),
    pytest.param(dict(bias="lora_only"), "trains biases (bias 'lora_only')", id="bias"),
    pytest.param(dict(tensors=None), "safe_serialization=True", id="no-safetensors"),
    pytest.param(dict(tensors={}), "holds no LoRA weights", id="no-tensors"),
    pytest.param(dict(tensors=b"\x08\x00\x00\x00\x00\x00\x00\x00not json"), "its safetensors cannot be read",
                 id="corrupt-safetensors"),
    pytest.param(dict(tensors={**_valid_q(), "base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(2, 32)}),
                 "trains 'base_model.model.model.embed_tokens.lora_embedding_A'", id="embed-tokens"),
    pytest.param(dict(tensors={**_valid_q(), "base_model.model.lm_head.lora_A.weight": torch.ones(2, 8),
                               "base_model.model.lm_head.lora_B.weight": torch.ones(32, 2)}),
                 "trains 'base_model.model.lm_head.lora_", id="lm-head"),
    pytest.param(dict(tensors=_valid_q(layer=2)), "names layer '2'; this model has 2", id="layer-past-the-model"),
    pytest.param(dict(tensors={peft_name(1, "o_proj", "A"): torch.ones(2, 8)}),
                 "has lora_A or lora_B of layer 1 o_proj without the other", id="a-without-b"),
    pytest.param(dict(tensors={peft_name(0, "k_proj", "A"): torch.ones(2, 8), peft_name(0, "k_proj", "B"): torch.ones(8, 2)}),
                 "does not fit this model: layer 0 k_proj has A (2, 8) and B (8, 2), where [r, 8] and [4, r]",
                 id="b-of-q-size-on-k"),
    pytest.param(dict(tensors={peft_name(0, "down_proj", "A"): torch.ones(2, 8), peft_name(0, "down_proj", "B"): torch.ones(8, 2)}),
                 "does not fit this model: layer 0 down_proj has A (2, 8)", id="a-of-hidden-on-down"),
    pytest.param(dict(tensors={peft_name(0, "q_proj", "A"): torch.ones(2, 8), peft_name(0, "q_proj", "B"): torch.ones(8, 3)}),
                 "does not fit this model", id="ranks-of-a-and-b-differ"),
    pytest.param(dict(tensors=_valid_q(rank=16)), "has rank 16, above this engine's max_lora_rank (8)", id="rank"),
]


@pytest.mark.parametrize(("case", "words"), REFUSALS)
def test_an_adapter_this_engine_cannot_serve_is_refused_with_a_sentence(tmp_path, case, words):
    case = dict(case)
    tensors = case.pop("tensors", _valid_q())
    directory = write_adapter(tmp_path / "adapter", tensors, **case)
    with pytest.raises(InvalidRequest) as refusal:
        load(directory)
    assert words in str(refusal.value)
    assert str(refusal.value).startswith("LoRA adapter 'tiny-lora'")


def test_a_path_without_an_adapter_config_is_refused(tmp_path):
    for directory in (tmp_path / "absent", write_adapter(tmp_path / "weights-only", _valid_q())):
        (directory / "adapter_config.json").unlink(missing_ok=True)
        with pytest.raises(InvalidRequest, match="no adapter_config.json in its lora_path"):
            load(directory)


def test_the_rank_limit_is_inclusive(tmp_path):
    assert load(write_adapter(tmp_path / "adapter", _valid_q(rank=8)), max_rank=8).rank == 8


@pytest.mark.parametrize(("fields", "words"), [
    (("", 1, "/a"), "non-empty string"), (("x" * 257, 1, "/a"), "at most 256"),
    (("a", 0, "/a"), "positive integer, got 0"), (("a", True, "/a"), "positive integer, got True"),
    (("a", 1, ""), "needs lora_path"),
])
def test_a_bad_lora_request_is_refused(fields, words):
    with pytest.raises(InvalidRequest, match=words):
        LoRARequest(*fields)


# ---- LoRALinear and LoRARows ------------------------------------------------


def groups(row_groups) -> list[tuple[int, list[int] | None]]:
    """LoRARows groups as (slot, row list or None for every row)."""
    return [(slot, None if rows is None else rows.tolist()) for slot, rows in row_groups]


def integer_linear(generator: torch.Generator, out_features: int, in_features: int) -> nn.Linear:
    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(integers(generator, out_features, in_features))
    return linear


def expected_output(x: torch.Tensor, base: nn.Linear, fused: str, layer: int,
                    row_adapters: list[tuple[dict, float] | None]) -> torch.Tensor:
    """Row by row in float64: base(x) plus, for a row of an adapter (its pairs, its scale), x @ A.T @ B.T * scale in
    each trained part's columns."""
    weight = base.weight.detach().double()
    rows = []
    for row, adapter in zip(x.double(), row_adapters):
        out = weight @ row
        if adapter is not None:
            pairs, scale = adapter
            for part, start, width in COLUMNS[fused]:
                if (layer, part) in pairs:
                    a, b = pairs[(layer, part)]
                    out[start : start + width] += (row @ a.double().t() @ b.double().t()) * scale
        rows.append(out)
    return torch.stack(rows)


@pytest.fixture
def two_adapters(tmp_path):
    """Adapters X (q and v, rank 2, scale 2) and Y (k and v of rank 4, scale 1/2) of layer 0, loaded."""
    pairs_x = lora_pairs({(0, "q_proj"): 2, (0, "v_proj"): 2}, seed=3)
    pairs_y = lora_pairs({(0, "k_proj"): 4, (0, "v_proj"): 4}, seed=4)
    x = load(write_pairs(tmp_path / "x", pairs_x, r=2, lora_alpha=4))
    y = load(write_pairs(tmp_path / "y", pairs_y, r=4, lora_alpha=2))
    return (x, (pairs_x, 2.0)), (y, (pairs_y, 0.5))


def qkv_wrapper(adapters) -> tuple[LoRALinear, nn.Linear, LoRARows]:
    """A qkv projection with X in slot 0 and Y in slot 1, and a third slot left empty."""
    base = integer_linear(torch.Generator().manual_seed(5), 16, 8)
    rows = LoRARows()
    wrapper = LoRALinear(base, [8, 4, 4], 3, rows)
    for slot, (adapter, _) in enumerate(adapters):
        wrapper.set_slot(slot, wrapper.expand(adapter.weights[(0, "qkv_proj")]))
    return wrapper, base, rows


def step_input(num_rows: int) -> torch.Tensor:
    return integers(torch.Generator().manual_seed(num_rows), num_rows, 8, low=-3, high=4)


@torch.inference_mode()
def test_every_row_of_one_adapter_gets_its_delta_in_its_parts_columns(two_adapters):
    wrapper, base, rows = qkv_wrapper(two_adapters)
    rows.set([1, 1, 1], None, "cpu")
    assert rows.groups == [(1, None)]
    x = step_input(3)
    out = wrapper(x)
    assert out.shape == (3, 16)
    assert torch.equal(out.double(), expected_output(x, base, "qkv_proj", 0, [two_adapters[1][1]] * 3))
    # Y trains k and v only: the q columns are the base's.
    assert torch.equal(out[:, :8], base(x)[:, :8]) and not torch.equal(out[:, 8:], base(x)[:, 8:])


@pytest.mark.parametrize(("row_slots", "expected_groups"), [
    ([1, -1, 0, 1, -1, 0], [(0, [2, 5]), (1, [0, 3])]), ([-1, 0, 0, -1, -1, 0], [(0, [1, 2, 5])]),
    ([1, 0, 0, 1, 1, 0], [(0, [1, 2, 5]), (1, [0, 3, 4])]),
], ids=["two-adapters-and-base", "one-adapter-and-base", "two-adapters"])
@pytest.mark.parametrize("masked_max_rows", [256, 0], ids=["masked", "group-by-group"])
@torch.inference_mode()
def test_rows_of_adapters_and_of_the_base_model_share_one_forward(two_adapters, row_slots, expected_groups,
                                                                  masked_max_rows, monkeypatch):
    """Both ways of adding several adapters' deltas: all at once under masks (small steps), a group at a time."""
    monkeypatch.setattr(lora_module, "MASKED_MAX_ROWS", masked_max_rows)
    wrapper, base, rows = qkv_wrapper(two_adapters)
    rows.set(row_slots, None, "cpu")
    assert groups(rows.groups) == expected_groups
    x = step_input(6)
    references = [None if slot == -1 else two_adapters[slot][1] for slot in row_slots]
    assert torch.equal(wrapper(x).double(), expected_output(x, base, "qkv_proj", 0, references))


@torch.inference_mode()
def test_rows_of_an_empty_slot_run_the_base_model(two_adapters):
    wrapper, base, rows = qkv_wrapper(two_adapters)
    rows.set([2, 0, 2], None, "cpu")
    x = step_input(3)
    assert torch.equal(wrapper(x).double(), expected_output(x, base, "qkv_proj", 0, [None, two_adapters[0][1], None]))


@pytest.mark.parametrize("output_rows", [[0, 2], [2, 3], [1]], ids=["two-adapters", "one-adapter", "base-only"])
@torch.inference_mode()
def test_a_forward_of_the_output_rows_takes_their_adapters(two_adapters, output_rows):
    wrapper, base, rows = qkv_wrapper(two_adapters)
    row_slots = [0, -1, 1, 1]
    rows.set(row_slots, output_rows, "cpu")
    assert rows.num_rows == 4 and rows.num_output_rows == len(output_rows)
    # The whole step still runs as set ...
    x = step_input(4)
    references = [None if slot == -1 else two_adapters[slot][1] for slot in row_slots]
    assert torch.equal(wrapper(x).double(), expected_output(x, base, "qkv_proj", 0, references))
    # ... and a last layer that keeps the output rows adds each one's own adapter.
    kept = step_input(len(output_rows))
    kept_references = [references[row] for row in output_rows]
    assert torch.equal(wrapper(kept).double(), expected_output(kept, base, "qkv_proj", 0, kept_references))


@torch.inference_mode()
def test_a_forward_of_neither_the_steps_rows_nor_its_output_rows_is_an_error(two_adapters):
    wrapper, _, rows = qkv_wrapper(two_adapters)
    rows.set([0, -1, 1, 1], [0, 2], "cpu")
    with pytest.raises(RuntimeError, match="ran 3 rows of a step of 4"):
        wrapper(step_input(3))


@torch.inference_mode()
def test_the_whole_batch_is_needed_only_while_rows_run_adapters(two_adapters):
    wrapper, base, rows = qkv_wrapper(two_adapters)
    assert not wrapper.needs_whole_batch
    rows.set([-1, 0], None, "cpu")
    assert wrapper.needs_whole_batch
    rows.set([-1, -1], None, "cpu")  # a step of base rows alone
    assert not wrapper.needs_whole_batch and rows.groups == []
    x = step_input(2)
    assert torch.equal(wrapper(x), base(x))
    rows.set([1], None, "cpu")
    rows.clear()
    assert not wrapper.needs_whole_batch and (rows.num_rows, rows.num_output_rows) == (0, 0)
    assert torch.equal(wrapper(step_input(5)), base(step_input(5)))  # any number of rows without adapters


# ---- wrap_model and LoRAManager ---------------------------------------------


class TinyModel(nn.Module):
    """The parts of a Llama-family model that wrap_model reaches: config and model.layers[i].{self_attn, mlp}."""

    def __init__(self, seed: int = 6) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.config = CONFIG
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        for _ in range(CONFIG.num_hidden_layers):
            layer = nn.Module()
            layer.self_attn, layer.mlp = nn.Module(), nn.Module()
            layer.self_attn.qkv_proj = integer_linear(generator, *FUSED_SHAPES["qkv_proj"])
            layer.self_attn.o_proj = integer_linear(generator, *FUSED_SHAPES["o_proj"])
            layer.mlp.gate_up_proj = integer_linear(generator, *FUSED_SHAPES["gate_up_proj"])
            layer.mlp.down_proj = integer_linear(generator, *FUSED_SHAPES["down_proj"])
            self.model.layers.append(layer)


def test_wrap_model_wraps_every_projection_with_its_parts_columns():
    model = TinyModel()
    bases = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
             for layer in model.model.layers]
    rows, layers = wrap_model(model, num_slots=2)
    assert len(layers) == 2
    for layer, wrappers, base in zip(model.model.layers, layers, bases):
        assert list(wrappers) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
        assert (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj) == \
            tuple(wrappers.values())
        assert tuple(wrapper.base for wrapper in wrappers.values()) == base
        assert [wrapper.part_starts for wrapper in wrappers.values()] == [[0, 8, 12], [0], [0, 12], [0]]
        assert all(wrapper.rows is rows and wrapper.slots == [None, None] for wrapper in wrappers.values())


def make_manager(max_loras: int = 1, max_cpu_loras: int = 2, max_rank: int = 8) -> tuple[LoRAManager, TinyModel]:
    model = TinyModel()
    return LoRAManager(model, max_loras, max_rank, max_cpu_loras, torch.float32, "cpu"), model


@pytest.fixture
def adapter_dirs(tmp_path):
    """Five adapters (ids 1 to 5, names a1 to a5) on different projections of both layers."""
    requests = {}
    targets = [{(0, "q_proj"): 2, (1, "down_proj"): 2}, {(0, "v_proj"): 2, (1, "up_proj"): 2},
               {(1, "o_proj"): 2, (0, "gate_proj"): 2}, {(0, "k_proj"): 2}, {(1, "q_proj"): 2}]
    for lora_id, ranks in enumerate(targets, start=1):
        directory = write_pairs(tmp_path / f"a{lora_id}", lora_pairs(ranks, seed=10 + lora_id))
        requests[lora_id] = LoRARequest(f"a{lora_id}", lora_id, str(directory))
    return requests


@pytest.fixture
def loads(monkeypatch):
    """The lora_int_ids load_adapter was called for, in order."""
    calls = []
    real = lora_module.load_adapter

    def counting(request, *args, **kwargs):
        calls.append(request.lora_int_id)
        return real(request, *args, **kwargs)

    monkeypatch.setattr(lora_module, "load_adapter", counting)
    return calls


def test_acquire_loads_an_adapter_once_and_counts_its_holders(adapter_dirs, loads):
    manager, _ = make_manager()
    manager.acquire(adapter_dirs[1])
    first = manager.adapters[1]
    manager.acquire(adapter_dirs[1])
    manager.acquire(LoRARequest("a1", 1, adapter_dirs[1].lora_path))  # an equal request
    assert loads == [1] and manager.adapters[1] is first and manager.holders == {1: 3}
    assert sorted(first.weights) == [(0, "qkv_proj"), (1, "down_proj")]
    manager.release(adapter_dirs[1])
    manager.release(adapter_dirs[1])
    assert manager.holders == {1: 1}
    manager.release(adapter_dirs[1])
    assert manager.holders == {} and list(manager.adapters) == [1]  # within max_cpu_loras: kept


def test_an_id_loaded_under_another_name_or_path_is_refused(adapter_dirs, loads):
    manager, _ = make_manager()
    manager.acquire(adapter_dirs[1])
    for other in (LoRARequest("a2", 1, adapter_dirs[1].lora_path), LoRARequest("a1", 1, adapter_dirs[2].lora_path)):
        with pytest.raises(InvalidRequest, match="lora_int_id 1 is adapter 'a1' here; give each adapter an id"):
            manager.acquire(other)
    assert loads == [1] and manager.holders == {1: 1} and manager.adapters[1].request == adapter_dirs[1]


def test_an_adapter_that_cannot_load_changes_nothing(adapter_dirs, tmp_path):
    manager, _ = make_manager()
    manager.acquire(adapter_dirs[1])
    with pytest.raises(InvalidRequest, match="no adapter_config.json"):
        manager.acquire(LoRARequest("missing", 2, str(tmp_path / "missing")))
    big = write_adapter(tmp_path / "big", _valid_q(rank=16))
    with pytest.raises(InvalidRequest, match="rank 16, above"):
        manager.acquire(LoRARequest("big", 3, str(big)))
    assert list(manager.adapters) == [1] and manager.holders == {1: 1}


def test_unheld_adapters_are_evicted_least_recently_used_first_and_held_ones_never(adapter_dirs, loads):
    manager, _ = make_manager(max_loras=1, max_cpu_loras=2)
    for lora_id in (1, 2, 3):
        manager.acquire(adapter_dirs[lora_id])
    assert list(manager.adapters) == [1, 2, 3]  # all held: more than max_cpu_loras stay
    manager.release(adapter_dirs[2])
    assert list(manager.adapters) == [1, 3]
    manager.release(adapter_dirs[1])
    manager.release(adapter_dirs[3])
    assert list(manager.adapters) == [1, 3] and manager.holders == {}
    manager.acquire(adapter_dirs[1])
    manager.release(adapter_dirs[1])
    assert list(manager.adapters) == [3, 1]  # 1 used again: 3 is now the least recently used
    manager.acquire(adapter_dirs[1])  # held from here on
    manager.acquire(adapter_dirs[4])
    assert list(manager.adapters) == [1, 4]
    manager.release(adapter_dirs[4])
    manager.acquire(adapter_dirs[5])
    assert list(manager.adapters) == [1, 5]  # 4 went, although 1 was used before it: 1 is held
    manager.acquire(adapter_dirs[3])  # evicted before: loaded again
    assert loads == [1, 2, 3, 4, 5, 3]
    assert list(manager.adapters) == [1, 5, 3] and manager.holders == {1: 1, 5: 1, 3: 1}


def slot_map(manager: LoRAManager) -> dict:
    """Per layer and fused projection, the weights in each slot."""
    return {(index, fused): list(wrapper.slots) for index, wrappers in enumerate(manager.layers)
            for fused, wrapper in wrappers.items()}


def assert_slots_hold(manager: LoRAManager) -> None:
    for index, wrappers in enumerate(manager.layers):
        for fused, wrapper in wrappers.items():
            for slot, lora_id in enumerate(manager.slot_ids):
                expected = None if lora_id is None else manager.adapters[lora_id].expanded.get((index, fused))
                assert wrapper.slots[slot] is expected, (index, fused, slot)


def test_prepare_puts_the_steps_adapters_in_slots_and_keeps_those_already_there(adapter_dirs):
    manager, _ = make_manager(max_loras=2, max_cpu_loras=3)
    for lora_id in (1, 2, 3):
        manager.acquire(adapter_dirs[lora_id])
    assert manager.slot_ids == [None, None]
    manager.prepare([0, 2, 2], None)
    assert manager.slot_ids == [2, None]
    assert_slots_hold(manager)
    assert groups(manager.rows.groups) == [(0, [1, 2])]

    manager.prepare([1, 0, 2, 2], None)  # 2 stays in slot 0
    assert manager.slot_ids == [2, 1]
    assert_slots_hold(manager)
    assert groups(manager.rows.groups) == [(0, [2, 3]), (1, [0])]

    manager.prepare([3, 2, 0], None)  # 3 takes the slot of 1, which this step does not use
    assert manager.slot_ids == [2, 3]
    assert_slots_hold(manager)
    assert groups(manager.rows.groups) == [(0, [1]), (1, [0])]

    manager.prepare([3, 3], [1])  # one adapter and no base rows in the step: every row
    assert manager.rows.groups == [(1, None)] and manager.rows.output_groups == [(1, None)]
    assert manager.slot_ids == [2, 3]  # 2 is not taken out while unused


def test_a_step_of_more_adapters_than_slots_is_an_error(adapter_dirs):
    manager, _ = make_manager(max_loras=2, max_cpu_loras=3)
    for lora_id in (1, 2, 3):
        manager.acquire(adapter_dirs[lora_id])
    with pytest.raises(RuntimeError, match="A step holds 3 LoRA adapters; max_loras is 2"):
        manager.prepare([1, 2, 0, 3], None)


def test_a_step_without_adapters_clears_the_rows_and_keeps_the_slots(adapter_dirs):
    manager, _ = make_manager()
    manager.acquire(adapter_dirs[1])
    manager.prepare([0, 1], [1])
    assert manager.rows.active
    manager.prepare([0, 0, 0], [2])
    assert not manager.rows.active
    assert (manager.rows.num_rows, manager.rows.num_output_rows, manager.rows.output_groups) == (0, 0, [])
    assert manager.slot_ids == [1]


def test_an_evicted_adapter_leaves_its_slot(adapter_dirs):
    manager, _ = make_manager(max_loras=1, max_cpu_loras=1)
    manager.acquire(adapter_dirs[1])
    manager.prepare([1], None)
    assert manager.slot_ids == [1] and manager.layers[0]["qkv_proj"].slots[0] is not None
    manager.release(adapter_dirs[1])
    manager.acquire(adapter_dirs[2])
    assert list(manager.adapters) == [2] and manager.slot_ids == [None]
    assert all(slots == [None] for slots in slot_map(manager).values())


@torch.inference_mode()
def test_the_managers_slots_feed_the_wrapped_projections(adapter_dirs):
    manager, model = make_manager(max_loras=2, max_cpu_loras=2)
    manager.acquire(adapter_dirs[1])
    manager.acquire(adapter_dirs[2])
    manager.prepare([2, 0, 1], [0, 2])
    pairs = {lora_id: (lora_pairs(ranks, seed=10 + lora_id), 2.0) for lora_id, ranks in
             ((1, {(0, "q_proj"): 2, (1, "down_proj"): 2}), (2, {(0, "v_proj"): 2, (1, "up_proj"): 2}))}
    layer0, layer1 = model.model.layers
    x = step_input(3)
    expected = expected_output(x, layer0.self_attn.qkv_proj.base, "qkv_proj", 0, [pairs[2], None, pairs[1]])
    assert torch.equal(layer0.self_attn.qkv_proj(x).double(), expected)
    x = step_input(2)  # the last layer's output rows 0 and 2: adapters 2 and 1
    expected = expected_output(x, layer1.mlp.gate_up_proj.base, "gate_up_proj", 1, [pairs[2], pairs[1]])
    assert torch.equal(layer1.mlp.gate_up_proj(x).double(), expected)
    hidden = integers(torch.Generator().manual_seed(7), 3, 12)
    expected = expected_output(hidden, layer1.mlp.down_proj.base, "down_proj", 1, [pairs[2], None, pairs[1]])
    assert torch.equal(layer1.mlp.down_proj(hidden).double(), expected)


# ---- scheduler admission with max_loras -------------------------------------

_arrivals = itertools.count()
ADAPTER_A, ADAPTER_B, ADAPTER_C, ADAPTER_D = (LoRARequest(name, lora_id, "/unused") for name, lora_id in
                                              (("adapter-a", 1), ("adapter-b", 2), ("adapter-c", 3), ("adapter-d", 4)))


def make_scheduler(max_loras: int, max_num_seqs: int = 8, policy: str = "fcfs") -> Scheduler:
    return Scheduler(KVCacheManager(32, 4, enable_caching=False), max_num_seqs, 64, policy=policy, max_loras=max_loras)


def lora_request(request_id: str, adapter: LoRARequest | None, priority: int = 0) -> Request:
    return Request(request_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=100), priority=priority,
                   arrival_number=next(_arrivals), lora_request=adapter)


def run_step(scheduler: Scheduler) -> list[tuple[str, int]]:
    output = scheduler.schedule()
    scheduler.update_after_step(output)
    for item in output.scheduled:
        if item.sample:
            item.request.append_output_token(7)
    return [(item.request.request_id, item.num_new_tokens) for item in output.scheduled]


def ids(requests) -> list[str]:
    return [request.request_id for request in requests]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_of_another_adapter_waits_in_its_place_until_the_running_adapter_is_done(policy):
    scheduler = make_scheduler(max_loras=1, policy=policy)
    requests = {request_id: lora_request(request_id, adapter, priority) for request_id, adapter, priority in
                (("a1", ADAPTER_A, 0), ("b", ADAPTER_B, 1), ("a2", ADAPTER_A, 2), ("base", None, 3))}
    for request in requests.values():
        scheduler.add_request(request)
    assert run_step(scheduler) == [("a1", 5), ("a2", 5), ("base", 5)]
    assert ids(scheduler.waiting) == ["b"] and requests["b"].status == RequestStatus.WAITING
    assert run_step(scheduler) == [("a1", 1), ("a2", 1), ("base", 1)]  # still A's
    scheduler.finish_request(requests["a1"], RequestStatus.FINISHED_STOPPED)
    assert run_step(scheduler) == [("a2", 1), ("base", 1)]  # one request of A still runs
    scheduler.finish_request(requests["a2"], RequestStatus.FINISHED_STOPPED)
    assert run_step(scheduler) == [("base", 1), ("b", 5)]
    assert ids(scheduler.running) == ["base", "b"] and not scheduler.waiting


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_passed_over_request_keeps_its_place_ahead_of_later_ones(policy):
    # Arrival order differs from priority order; under fcfs priorities are all 0.
    scheduler = make_scheduler(max_loras=1, max_num_seqs=2, policy=policy)
    order = [("base", None, 3), ("a2", ADAPTER_A, 2), ("b", ADAPTER_B, 1), ("a1", ADAPTER_A, 0)]
    if policy == "fcfs":
        order = [("a1", ADAPTER_A, 0), ("b", ADAPTER_B, 0), ("a2", ADAPTER_A, 0), ("base", None, 0)]
    requests = {request_id: lora_request(request_id, adapter, priority) for request_id, adapter, priority in order}
    for request in requests.values():
        scheduler.add_request(request)
    assert run_step(scheduler) == [("a1", 5), ("a2", 5)]  # max_num_seqs 2: base does not start either
    assert ids(scheduler.waiting) == ["b", "base"]
    scheduler.finish_request(requests["a1"], RequestStatus.FINISHED_STOPPED)
    scheduler.finish_request(requests["a2"], RequestStatus.FINISHED_STOPPED)
    assert run_step(scheduler) == [("b", 5), ("base", 5)]


def test_a_step_holds_requests_of_up_to_max_loras_adapters():
    scheduler = make_scheduler(max_loras=2)
    for request_id, adapter in (("a", ADAPTER_A), ("b", ADAPTER_B), ("c", ADAPTER_C), ("base", None),
                                ("d", ADAPTER_D), ("b2", ADAPTER_B)):
        scheduler.add_request(lora_request(request_id, adapter))
    assert run_step(scheduler) == [("a", 5), ("b", 5), ("base", 5), ("b2", 5)]
    assert ids(scheduler.waiting) == ["c", "d"]  # passed over, in their order


# ---- the adapters' prefix hashes ------------------------------------------------


def test_each_adapters_root_hash_is_its_own_and_not_the_base_models():
    roots = [lora_root_hash(name) for name in ("adapter-a", "adapter-b", "adapter-a2")]
    assert len(set(roots)) == 3 and all(len(root) == 32 for root in roots)
    assert lora_root_hash("adapter-a") == roots[0]  # by name: every worker computes the same
    tokens = [1, 2, 3, 4]
    first_blocks = {hash_block_tokens(root, tokens) for root in [None, *roots]}
    assert len(first_blocks) == 4


def test_requests_of_different_adapters_share_no_cached_blocks():
    manager = KVCacheManager(16, 4, enable_caching=True)
    tokens = list(range(100, 109))  # two full blocks and one token
    root_a, root_b = lora_root_hash("adapter-a"), lora_root_hash("adapter-b")

    def request(request_id: str, root: bytes | None) -> Request:
        return Request(request_id, list(tokens), SamplingParams(max_tokens=4), block_hash_root=root)

    first = request("first", root_a)
    assert manager.find_cached_prefix(first) == ([], 0)
    first_hash = hash_block_tokens(root_a, tokens[:4])
    assert first.block_hashes == [first_hash, hash_block_tokens(first_hash, tokens[4:8])]
    assert manager.allocate_slots(first, len(tokens))
    table = manager.block_ids("first")

    same, other, base = request("same", root_a), request("other", root_b), request("base", None)
    assert manager.find_cached_prefix(same) == (table[:2], 8)
    assert same.block_hashes == first.block_hashes
    assert manager.find_cached_prefix(other) == ([], 0)
    assert manager.find_cached_prefix(base) == ([], 0)
    assert base.block_hashes[0] == hash_block_tokens(None, tokens[:4])
    assert len({other.block_hashes[0], base.block_hashes[0], first_hash}) == 3
    assert len({other.block_hashes[1], base.block_hashes[1], first.block_hashes[1]}) == 3
