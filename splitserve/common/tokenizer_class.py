"""The tokenizer class transformers' ``AutoTokenizer`` picks for a model directory, kept in the cache folder.

``AutoTokenizer``'s choice depends on the directory's ``config.json`` (the model
type), ``tokenizer_config.json`` (the declared class, remote code) and
``tokenizer.json`` (a ``LlamaTokenizerFast`` declared over a ByteLevel
``tokenizer.json``, as Llama 3 derivatives ship, becomes ``TokenizersBackend``),
by rules that change between transformers versions. Asking it is costly:
importing ``AutoTokenizer`` imports ``transformers.models``, which reads every
model's sources to build its import table (0.8 s), and it reads the config
through torch-importing modules.

So the engine asks ``AutoTokenizer`` once (``engine/model_store.py``) and keeps the
class's module and name in ``<cache>/tokenizer-classes/<key>.json``, the key a
SHA-256 of the directory's path, those files and the transformers version: a
change to any of them is a new key, and a record never outlives what it was read
from. Later engines load a top-level class (``TokenizersBackend``,
``PreTrainedTokenizerFast``) directly; the router, which never imports torch,
loads whatever class the record names.

A record is only followed to a tokenizer class of transformers' own: anything
else in the file (an edit, a cut-short write) reads as no record.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
from pathlib import Path

from splitserve.common.model_info import cache_dir, keep_newest, read_cached_json, write_cached_json

# The files AutoTokenizer's choice of class (and the tokenizer it builds) is read from.
RECORD_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json")
RECORD_FOLDER = "tokenizer-classes"
# Records kept at most: the oldest written go first (a directory whose record went is asked again, once). Every
# temporary model directory a test suite or a benchmark makes leaves one.
MAX_RECORDS = 256


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def record_path(model_dir: str | os.PathLike) -> Path:
    """Where the class AutoTokenizer picks for ``model_dir``, as its files and transformers are now, is kept."""
    path = Path(model_dir)
    digest = hashlib.sha256(f"{_transformers_version()}\0{path.resolve()}".encode())
    for name in RECORD_FILES:
        file = path / name
        digest.update(f"\0{name}\0".encode())
        if file.is_file():
            digest.update(file.read_bytes())
    return cache_dir() / RECORD_FOLDER / f"{digest.hexdigest()[:32]}.json"


def is_top_level(module: str) -> bool:
    """A module of transformers outside ``transformers.models``: importing it builds no import table."""
    return module.startswith("transformers.") and not module.startswith("transformers.models")


def describe(tokenizer_class: type) -> dict[str, str]:
    """What a record holds of a class."""
    return {"module": tokenizer_class.__module__, "class": tokenizer_class.__qualname__}


def resolve(entry: object, base: type, top_level_only: bool) -> type | None:
    """The class ``entry`` ({"module", "class"}) names, if it is a subclass of ``base`` in a transformers module
    (and, with ``top_level_only``, outside ``transformers.models``); else None. The caller passes transformers'
    ``PreTrainedTokenizerBase`` as ``base``: this package does not import transformers itself."""
    module, name = (entry.get("module"), entry.get("class")) if isinstance(entry, dict) else (None, None)
    if not isinstance(module, str) or not isinstance(name, str) or not module.startswith("transformers."):
        return None
    if top_level_only and not is_top_level(module):
        return None
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return found if isinstance(found, type) and issubclass(found, base) else None


def read_record(record: Path, base: type, top_level_only: bool) -> type | None:
    """The class kept in ``record`` (see :func:`resolve`), or None where there is none to follow."""
    return resolve(read_cached_json(record), base, top_level_only)


def write_record(record: Path, tokenizer_class: type) -> None:
    """Keep ``tokenizer_class`` in ``record``. A cache folder that cannot be written only costs the next process
    the AutoTokenizer route."""
    entry = describe(tokenizer_class)
    if read_cached_json(record) != entry and write_cached_json(record, entry):
        keep_newest(record.parent, MAX_RECORDS, keep=record)

