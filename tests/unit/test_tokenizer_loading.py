"""The engine's tokenizer: what ``AutoTokenizer`` gives, without importing a model's config class.

``splitserve.engine.model_store.load_tokenizer`` hands ``AutoTokenizer`` the few
config values it asks for instead of letting it import ``LlamaConfig`` (whose
module pulls in transformers' weight loading and ``torch.distributed.tensor``,
1-4 s of a worker's start). The class ``AutoTokenizer`` picks depends on those
values (the model type and the class a repository declares), so each case here
is a real tokenizer directory, the default model's tokenizer declared as
another class or under another model type, loaded both ways.

The class ``AutoTokenizer`` picked is then kept in the cache folder
(``splitserve.common.tokenizer_class``), so that the next engine loads a top-level
class such as ``TokenizersBackend`` without importing ``transformers.models`` at
all, and the router (which never imports torch) loads the class the engine got:
every case is loaded a second time, from that record, by the engine and by the
router.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from transformers import PreTrainedTokenizerBase as BASE

from router import frontend
from splitserve.common import tokenizer_class as records
from splitserve.engine.model_store import load_tokenizer

TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TEXTS = ("Hello, world!", "  leading spaces and\ttabs\nnew lines", "naïve café — 東京 🚀", "<|im_start|>user")

# (model_type, the tokenizer_class tokenizer_config.json declares; None: the key removed)
CASES = [
    ("llama", "as shipped"),
    ("llama", "LlamaTokenizerFast"),  # ByteLevel tokenizer.json: AutoTokenizer overrides the declared class
    ("llama", "PreTrainedTokenizerFast"),
    ("llama", None),  # no class declared: AutoTokenizer as it is
    ("qwen2", "GPT2TokenizerFast"),  # a class other than the model type's registered one
    ("qwen2", "Qwen2TokenizerFast"),
    ("mistral", "LlamaTokenizerFast"),
]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Records of tokenizer classes in a folder of the test's own."""
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def tokenizer_dir(model_dir, tmp_path, model_type, tokenizer_class):
    folder = tmp_path / f"{model_type}-{tokenizer_class}"
    folder.mkdir()
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, folder / name)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    if tokenizer_class is None:
        tokenizer_config.pop("tokenizer_class", None)
    elif tokenizer_class != "as shipped":
        tokenizer_config["tokenizer_class"] = tokenizer_class
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


@pytest.mark.parametrize(("model_type", "tokenizer_class"), CASES)
def test_the_engine_loads_the_tokenizer_autotokenizer_would(model_dir, tmp_path, model_type, tokenizer_class):
    from transformers import AutoTokenizer

    folder = tokenizer_dir(model_dir, tmp_path, model_type, tokenizer_class)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    first = load_tokenizer(folder)
    record = records.record_path(folder)
    assert records.read_record(record, BASE, top_level_only=False) is type(theirs)
    second = load_tokenizer(folder)  # from the record, where the class is a top-level one
    assert_same_tokenizer(first, theirs)
    assert_same_tokenizer(second, theirs)


def _no_engine_loader(model_dir):
    raise AssertionError("the router asked the engine's loader although a record was there")


@pytest.mark.parametrize(("model_type", "tokenizer_class_name"), CASES)
def test_the_router_loads_the_class_the_engine_recorded(model_dir, tmp_path, monkeypatch, model_type,
                                                         tokenizer_class_name):
    """Among them a LlamaTokenizerFast declared over a ByteLevel tokenizer.json, where the class named would split
    text unlike AutoTokenizer's TokenizersBackend."""
    from transformers import AutoTokenizer

    folder = tokenizer_dir(model_dir, tmp_path, model_type, tokenizer_class_name)
    load_tokenizer(folder)
    monkeypatch.setattr(frontend, "_ask_the_engine_loader", _no_engine_loader)
    assert_same_tokenizer(frontend.load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder)))


def test_without_a_record_the_router_asks_the_engine_loader_in_a_process_of_its_own(model_dir, tmp_path):
    from transformers import AutoTokenizer

    folder = tokenizer_dir(model_dir, tmp_path, "llama", "LlamaTokenizerFast")
    ours, theirs = frontend.load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert type(theirs).__name__ == "TokenizersBackend"
    assert_same_tokenizer(ours, theirs)
    assert records.read_record(records.record_path(folder), BASE, top_level_only=False) is type(theirs)


def test_a_router_that_cannot_ask_takes_the_declared_class_and_says_so(model_dir, tmp_path, monkeypatch, caplog):
    folder = tokenizer_dir(model_dir, tmp_path, "llama", "PreTrainedTokenizerFast")
    monkeypatch.setattr(frontend.sys, "executable", "/bin/false")
    with caplog.at_level("WARNING", logger=frontend.__name__):
        tokenizer = frontend.load_tokenizer(folder)
    assert type(tokenizer).__name__ == "TokenizersBackend"
    messages = [record.getMessage() for record in caplog.records]
    assert any("exited with status 1" in message for message in messages), messages
    assert any("Could not learn which tokenizer class" in message for message in messages), messages


def assert_same_tokenizer(ours, theirs):
    assert type(ours) is type(theirs)
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_loading_the_engine_tokenizer_skips_the_model_config_imports(model_dir):
    """The point of the shortcut, checked in a fresh interpreter: no config class, no DTensor."""
    script = (
        "import sys, json\n"
        "from splitserve.engine.model_store import load_tokenizer\n"
        f"load_tokenizer({str(model_dir)!r}).encode('hi')\n"
        "heavy = ('transformers.models.llama.configuration_llama', 'torch.distributed.tensor')\n"
        "print(json.dumps([name for name in heavy if name in sys.modules]))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def _load_in_a_fresh_interpreter(folder, cache) -> list[str]:
    """Load ``folder``'s tokenizer in a new interpreter with ``cache`` as the cache folder; the transformers
    modules of note it imported."""
    script = (
        "import sys, json\n"
        "from splitserve.engine.model_store import load_tokenizer\n"
        f"assert load_tokenizer({str(folder)!r}).encode('hi')\n"
        "print(json.dumps(sorted({name for name in sys.modules if name == 'transformers.models'})))\n"
    )
    env = {**os.environ, "SPLITSERVE_CACHE": str(cache)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_recorded_class_is_loaded_without_transformers_model_table(model_dir, own_cache):
    """The first process asks AutoTokenizer (which builds transformers' table of every model, 0.8 s); the next
    ones read the record and never import ``transformers.models``."""
    assert _load_in_a_fresh_interpreter(model_dir, own_cache) == ["transformers.models"]
    assert len(list((own_cache / records.RECORD_FOLDER).glob("*.json"))) == 1
    assert _load_in_a_fresh_interpreter(model_dir, own_cache) == []


def test_a_record_follows_the_tokenizer_files(model_dir, tmp_path):
    folder = tokenizer_dir(model_dir, tmp_path, "llama", "as shipped")
    before = records.record_path(folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = 4096
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert records.record_path(folder) != before


@pytest.mark.parametrize("entry", ['{"module": "os", "class": "system"}',
                                   '{"module": "transformers.models.gpt2", "class": "GPT2Tokenizer"}',
                                   '{"module": "transformers.utils", "class": "logging"}',
                                   '{"module": "transformers.nothing_here", "class": "X"}',
                                   '["TokenizersBackend"]', '{"module": "transformers.tok'])
def test_a_record_that_names_no_top_level_tokenizer_class_is_not_followed(model_dir, tmp_path, entry):
    """Anything but a transformers tokenizer class outside ``transformers.models`` (an edited or cut-short file)
    sends the load through AutoTokenizer, which writes the record again."""
    from transformers import AutoTokenizer

    folder = tokenizer_dir(model_dir, tmp_path, "llama", "as shipped")
    record = records.record_path(folder)
    record.parent.mkdir(parents=True)
    record.write_text(entry)
    assert records.read_record(record, BASE, top_level_only=True) is None
    assert_same_tokenizer(load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder)))
    assert records.read_record(record, BASE, top_level_only=True) is type(AutoTokenizer.from_pretrained(str(folder)))


def test_the_record_folder_keeps_the_newest_records_only(model_dir, own_cache):
    folder = own_cache / records.RECORD_FOLDER
    folder.mkdir(parents=True)
    for index in range(records.MAX_RECORDS + 10):
        old = folder / f"{index:032x}.json"
        old.write_text("{}")
        os.utime(old, (index, index))
    load_tokenizer(model_dir)
    kept = sorted(path.name for path in folder.iterdir())
    assert len(kept) == records.MAX_RECORDS
    assert records.record_path(model_dir).name in kept
    assert f"{0:032x}.json" not in kept and f"{records.MAX_RECORDS + 9:032x}.json" in kept
