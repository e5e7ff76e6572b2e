"""StructuredOutputsParams: the shape a request's output must take (vLLM's structured outputs).

Exactly one constraint per request, as in vLLM's ``StructuredOutputsParams``:
a JSON schema (``json``), any JSON object (``json_object``), a regular
expression (``regex``), one of a list of strings (``choice``) or a context-free
grammar (``grammar``: Lark, as llguidance reads it, or GBNF, which vLLM's
xgrammar backend reads and is converted here). The engine turns it into an
llguidance grammar and masks, at each step, every token the grammar cannot
take next (``splitserve.engine.structured_output``).

The values come from the network, so their sizes are bounded here before any
grammar is built, and the grammar's own work is bounded by llguidance's parser
limits there. Shared by the engine, the router (which checks a request's
grammar before routing it) and clients; importing it needs no llguidance.
"""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass
from typing import ClassVar

from splitserve.common.errors import InvalidRequest

# The most characters of a schema, regex or grammar, and of all choices together; the most choices.
MAX_CONSTRAINT_CHARS = 65_536
MAX_CHOICES = 1_024
# Characters a Rust regex (llguidance's) gives a meaning to, escaped in a choice.
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_JSON_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
_TOO_DEEP = "json is nested too deeply to be a JSON schema read here."


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's output constraint; exactly one field of ``json``, ``json_object``, ``regex``, ``choice``,
    ``grammar`` is set.

    Attributes:
        json: a JSON schema, as text or as its parsed value (a dict, or a bool); kept as compact text.
        json_object: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
        regex: the output matches this regular expression, whole (Rust's regex syntax, as llguidance's).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar: Lark as llguidance reads it, or GBNF (rules written ``::=``).
        disable_any_whitespace: JSON without whitespace between its tokens (vLLM's; by default a JSON output may
            put any run of spaces, tabs and newlines there, and a small model sometimes fills it).
        disable_additional_properties: every object of the schema that does not say otherwise takes only the
            properties it names (``additionalProperties: false``), as vLLM's option does.
        whitespace_pattern: a regex for the whitespace JSON may put between its tokens (vLLM's), instead of any run.
        num_resumed_tokens: the last this-many prompt tokens were generated under this constraint before (a
            request continued on another worker after a failure): the grammar takes them first.
    """

    json: str | dict | bool | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    num_resumed_tokens: int = 0

    FIELDS: ClassVar[frozenset[str]] = frozenset((*_KINDS, *_JSON_OPTIONS, "num_resumed_tokens"))

    def __post_init__(self) -> None:
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise InvalidRequest("json_object must be true or false.")
        kinds = [name for name in _KINDS if self._is_set(name)]
        if len(kinds) != 1:
            raise InvalidRequest("structured outputs take exactly one of json, json_object, regex, choice and "
                                 f"grammar; got {', '.join(kinds) or 'none'}.")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", _checked_choices(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check_text(name, value)
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} must be true or false.")
        if self.whitespace_pattern is not None:
            _check_text("whitespace_pattern", self.whitespace_pattern)
        if self.kind not in ("json", "json_object") and (self.disable_any_whitespace or self.whitespace_pattern
                                                         or self.disable_additional_properties):
            raise InvalidRequest(f"disable_any_whitespace, disable_additional_properties and whitespace_pattern "
                                 f"shape JSON only; this constraint is a {self.kind}.")
        if (not isinstance(self.num_resumed_tokens, int) or isinstance(self.num_resumed_tokens, bool)
                or self.num_resumed_tokens < 0):
            raise InvalidRequest(f"num_resumed_tokens must be an integer >= 0, got {self.num_resumed_tokens!r}.")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        return next(name for name in _KINDS if self._is_set(name))

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value not in (False, None) if name == "json_object" else value is not None

    def check(self) -> None:
        """Raise InvalidRequest when the constraint does not build a grammar (checked without a tokenizer: the
        router's check before it routes a request; the engine builds it against its tokenizer)."""
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(self.to_grammar(), limits=parser_limits())
        if error:
            raise InvalidRequest(f"structured outputs: the {self.kind} is not valid: {short_message(error)}")

    def to_grammar(self) -> str:
        """The constraint as an llguidance grammar (its JSON form); not yet checked (the grammar's builder does).

        Raises:
            InvalidRequest: llguidance is not installed.
        """
        try:
            from llguidance import LLMatcher
        except ImportError:
            raise InvalidRequest("structured outputs need llguidance on the serving side (pip install "
                                 "llguidance).") from None
        if self.json is not None or self.json_object:
            schema = json_module.loads(self.json) if self.json is not None else {"type": "object"}
            if isinstance(schema, bool):  # true: any JSON value, as {} says it
                if not schema:
                    raise InvalidRequest("json is the schema false, which no output follows.")
                schema = {}
            if self.disable_additional_properties:
                schema = _without_additional_properties(schema)
            options = {"whitespace_flexible": not self.disable_any_whitespace}
            if self.whitespace_pattern is not None:
                options["whitespace_pattern"] = self.whitespace_pattern
            return LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_regex("|".join(_escape(choice) for choice in self.choice))
        if "::=" in self.grammar:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                return LLMatcher.grammar_from_lark(gbnf_to_lark(self.grammar))
            except Exception as error:  # the converter raises plain exceptions on bad GBNF
                raise InvalidRequest(f"grammar is not valid GBNF: {short_message(str(error))}") from None
        return LLMatcher.grammar_from_lark(self.grammar)


def parser_limits():
    """llguidance's parser limits for a request's grammar: its defaults, which bound each step's work (lexer fuel,
    Earley items) and the grammar's size, and error messages that do not quote the grammar."""
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)


def _schema_text(schema: object) -> str:
    """A JSON schema as compact text, checked to be JSON (an object or a boolean) and not too long."""
    if isinstance(schema, str):
        _check_text("json", schema)
        try:
            schema = json_module.loads(schema)
        except ValueError as error:
            raise InvalidRequest(f"json must be a JSON schema; its text is not JSON: {short_message(str(error))}") from None
        except RecursionError:
            raise InvalidRequest(_TOO_DEEP) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(f"json must be a JSON schema (an object or a boolean), got {type(schema).__name__}.")
    try:
        text = json_module.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidRequest(f"json must be a JSON schema: {short_message(str(error))}") from None
    except RecursionError:
        raise InvalidRequest(_TOO_DEEP) from None
    _check_text("json", text)
    return text


# Keywords whose value maps names to subschemas, and keywords whose value is data, never a schema.
_SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))
_DATA_KEYWORDS = frozenset(("enum", "const", "default", "examples"))


def _without_additional_properties(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that does not set it (one with
    ``properties`` or ``type: object``), however deep: a copy, walked without recursion, through subschemas only
    (a property named ``properties`` or an ``enum``'s objects are left as they are)."""
    schema = json_module.loads(json_module.dumps(schema))
    pending = [schema]
    while pending:
        node = pending.pop()
        if not isinstance(node, dict):
            continue
        if ("properties" in node or node.get("type") == "object") and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for keyword, value in node.items():
            if keyword in _DATA_KEYWORDS:
                continue
            if keyword in _SCHEMA_MAPS and isinstance(value, dict):
                pending.extend(value.values())
            elif isinstance(value, dict):
                pending.append(value)
            elif isinstance(value, list):
                pending.extend(value)
    return schema


def _checked_choices(choices: object) -> tuple[str, ...]:
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
        raise InvalidRequest("choice must be a list of strings.")
    if not 1 <= len(choices) <= MAX_CHOICES:
        raise InvalidRequest(f"choice must hold 1 to {MAX_CHOICES} strings, got {len(choices)}.")
    if any(not isinstance(choice, str) or not choice for choice in choices):
        raise InvalidRequest("choice must be a list of non-empty strings.")
    if sum(len(choice) for choice in choices) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(f"choice holds more than {MAX_CONSTRAINT_CHARS} characters in all.")
    return tuple(choices)


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name} must be a non-empty string.")
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(f"{name} has {len(value)} characters; at most {MAX_CONSTRAINT_CHARS} are allowed.")


def _escape(text: str) -> str:
    """``text`` as a regex matching exactly it: meta characters escaped, others outside printable ASCII as code
    points (\\x{...})."""
    return "".join("\\" + char if char in _REGEX_META
                   else char if " " <= char <= "~" else f"\\x{{{ord(char):x}}}" for char in text)


def short_message(message: str, limit: int = 300) -> str:
    """A library's error message cut to ``limit`` characters (it may quote the client's text at length)."""
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."
