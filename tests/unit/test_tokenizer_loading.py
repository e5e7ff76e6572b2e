"""The engine's tokenizer: what ``AutoTokenizer`` gives, without importing a model's config class.

``splitserve.engine.model_store.load_tokenizer`` hands ``AutoTokenizer`` the few
config values it asks for instead of letting it import ``LlamaConfig`` (whose
module pulls in transformers' weight loading and ``torch.distributed.tensor``,
1-4 s of a worker's start). The class ``AutoTokenizer`` picks depends on those
values (the model type and the class a repository declares), so each case here
is a real tokenizer directory, the default model's tokenizer declared as
another class or under another model type, loaded both ways.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

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
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))

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
