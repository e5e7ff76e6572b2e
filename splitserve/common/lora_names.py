"""The names LoRA adapters are served under in a cluster (``--lora-modules NAME=PATH``): checked the same way by
the workers that serve them, the router that routes by them and the gateway that takes them as OpenAI ``model``s.

No torch here: the router imports it.
"""

from __future__ import annotations

import re

from splitserve.common.errors import InvalidRequest

# A name is what a client writes in a request (an OpenAI "model") and what a worker registers: short, and safe to
# log and to put in a metric label or a path.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_LORA_MODULES = 64  # adapters one worker may serve


def is_lora_name(name: object) -> bool:
    """Whether ``name`` is a valid adapter name (what :func:`check_lora_name` takes)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_lora_name(name: object) -> str:
    """``name`` when it is a valid adapter name: 1 to 64 characters from [A-Za-z0-9._-], a letter or digit first.

    Raises:
        InvalidRequest: a sentence saying what a name must be (the name itself cut short).
    """
    if not is_lora_name(name):
        shown = repr(name[:64]) if isinstance(name, str) else type(name).__name__
        raise InvalidRequest(f"A LoRA adapter's name is 1 to 64 characters from [A-Za-z0-9._-], starting with a letter "
                             f"or digit; got {shown}.")
    return name


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """``--lora-modules``' values (``NAME=PATH``, as vLLM's flag takes them) as {name: path}.

    Raises:
        ValueError: a value without ``=``, a bad or repeated name, an empty path, more than MAX_LORA_MODULES.
    """
    modules: dict[str, str] = {}
    for item in items:
        name, equals, path = item.partition("=")
        if not equals or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH pairs (the adapter's name and its PEFT directory), got "
                             f"{item[:80]!r}.")
        check_lora_name(name)
        if name in modules:
            raise ValueError(f"LoRA adapter {name!r} is named twice in --lora-modules.")
        modules[name] = path
    if len(modules) > MAX_LORA_MODULES:
        raise ValueError(f"A worker serves at most {MAX_LORA_MODULES} LoRA adapters; --lora-modules names "
                         f"{len(modules)}.")
    return modules
