"""The router's front door: prompts (text, token ids, chat) -> validated token ids, and model facts.

The router tokenizes once, so workers receive token ids. It reads the model's
tokenizer files and config.json from a model directory, and nothing else: no
weights are loaded, no model code (nor torch) is imported, and the default model
is never converted here. The directory is ``--model DIR``, or without it the
default model's converted directory (``splitserve prepare-model`` writes it;
``splitserve up`` runs that first). A directory with only tokenizer files and
config.json is enough: then the first worker to register sets the cluster's model
fingerprint; with safetensors files beside them, the router fingerprints them
itself (headers and a few samples) and refuses workers serving other weights.

Why not let the router load the model's code or convert it: the router is the
process that must start fast, stay small and keep serving while workers come
and go; the GPU/CPU-heavy stack belongs to the workers only
(``tests/unit/test_architecture.py`` checks that the router never imports torch).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import jinja2

from splitserve.common import tokenizer_class
from splitserve.common.errors import InvalidRequest
from splitserve.common.model_info import ModelConfig, find_model_dir, has_weights, model_fingerprint
from splitserve.common.prompt import validate_prompt_token_ids
from splitserve.common.reasoning import think_tag_ids
from splitserve.common.sampling_params import MAX_LOGPROBS, SamplingParams
from splitserve.rpc.convert import chat_from_pb, sampling_params_from_pb
from splitserve.v1 import inference_pb2

logger = logging.getLogger(__name__)

# A chat template's own error message may quote the client's messages: at most this much of it is echoed.
_ECHOED_TEMPLATE_ERROR_CHARACTERS = 160


@dataclass
class Prompt:
    """A validated prompt: its token ids and the text they came from (None for token ids)."""

    token_ids: list[int]
    text: str | None


class Frontend:
    """Tokenizer, chat template and limits of the served model.

    Args:
        model: model directory (None: the default model's converted directory).
        dtype: the workers' dtype, part of the model fingerprint ("auto": float32 or bfloat16, whichever the
            first worker to register serves).
        max_model_len: the cluster's context limit (None: the model's).
        chat_template: a Jinja chat template that replaces the model's (None: the model's own).

    Raises:
        FileNotFoundError: no such directory, or the default model is not prepared yet.
        ValueError: a chat template that does not compile or cannot render a user's message.
    """

    def __init__(self, model: str | None, dtype: str = "auto", max_model_len: int | None = None,
                 chat_template: str | None = None) -> None:
        self.model_dir = find_model_dir(model)
        self.model_config = ModelConfig.from_model_dir(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
            _check_chat_template(self.tokenizer)
        self.max_model_len = min(max_model_len or self.model_config.max_model_len, self.model_config.max_model_len)
        self.max_token_bytes = max_token_bytes(self.tokenizer)
        try:  # for gateways that count reasoning tokens (GetModelInfo)
            self.think_tag_ids = think_tag_ids(self.tokenizer)
        except ValueError:
            self.think_tag_ids = ((), ())
        # None for a directory without weights: the registered workers then say which weights the cluster serves.
        # With dtype auto: None, and the fingerprints a worker may serve are those of either dtype.
        fingerprints = ([model_fingerprint(self.model_dir, name) for name in
                         (("float32", "bfloat16") if dtype == "auto" else (dtype,))]
                        if has_weights(self.model_dir) else None)
        self.allowed_fingerprints = frozenset(fingerprints) if fingerprints else None
        self.model_fingerprint = fingerprints[0] if fingerprints and dtype != "auto" else None
        self.model_name = self.model_dir.name

    def prompt_of(self, request, params: SamplingParams | None = None) -> Prompt:
        """The validated token ids of a GenerateRequest's prompt: what the workers will continue; cut to its last
        ``params.truncate_prompt_tokens`` when set (its text then dropped: the echo decodes the ids kept).

        Raises:
            InvalidRequest: what :meth:`tokenize` refuses, an empty prompt, ids outside the
                vocabulary, or one that leaves no room to generate within max_model_len.
        """
        prompt = self.tokenize(request)
        if params is not None:
            kept = params.truncated(prompt.token_ids, self.max_model_len)
            if len(kept) < len(prompt.token_ids):
                prompt = Prompt(kept, None)
        prompt.token_ids = validate_prompt_token_ids(prompt.token_ids, self.model_config.vocab_size,
                                                     self.max_model_len)
        return prompt

    def sampling_params_of(self, request) -> SamplingParams:
        """The validated SamplingParams of a GenerateRequest (the workers get its message as it came).

        Raises:
            InvalidRequest: a value out of range, a logit_bias token id outside the vocabulary, or a structured
                outputs constraint that does not build.
        """
        params = sampling_params_from_pb(request.sampling_params)
        params.check_vocabulary(self.model_config.vocab_size)
        if params.structured_outputs is not None:
            params.structured_outputs.check()
        return params

    def tokenize(self, request) -> Prompt:
        """The token ids of a GenerateRequest's or TokenizeRequest's prompt, as Generate tokenizes it.

        Not held to the generation limits (Tokenize answers a prompt of any length, with
        max_model_len beside it), except that text too large to ever fit is refused
        before the tokenizer sees it.

        Raises:
            InvalidRequest: no prompt, text or chat too large for max_model_len (not
                tokenized), or a chat the model's template cannot render.
        """
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequest("The request has no prompt: set text, token_ids or chat.")
        # vLLM's add_special_tokens; unset: a text gets the tokenizer's (a BOS), a chat its template's alone.
        special = request.add_special_tokens if request.HasField("add_special_tokens") else kind == "text"
        if kind == "text":
            text = request.text
            self._check_size(text, "text prompt")
            token_ids = self.tokenizer.encode(text, add_special_tokens=special) if text else []
        elif kind == "token_ids":
            text, token_ids = None, list(request.token_ids.ids)
        else:
            self._check_size(_chat_text(request.chat), "chat's messages")
            text = self.render_chat(request.chat)
            self._check_size(text, "rendered chat")
            token_ids = self.tokenizer.encode(text, add_special_tokens=special)
        return Prompt(token_ids, text)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's string as the tokenizer spells it (``convert_ids_to_tokens``: "Ġthe" for " the" in
        byte-level BPE), for ids the tokenizer gave."""
        return [str(token) for token in self.tokenizer.convert_ids_to_tokens(token_ids)]

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids (Detokenize; echo's text of a token-id prompt), special tokens kept unless
        ``skip_special_tokens``.

        Raises:
            InvalidRequest: more ids than max_model_len, or one outside the vocabulary.
        """
        if len(token_ids) > self.max_model_len:
            raise InvalidRequest(f"{len(token_ids)} token ids are more than max_model_len ({self.max_model_len}).")
        vocab_size = self.model_config.vocab_size
        bad = next((token_id for token_id in token_ids if token_id >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"Token id {bad} is outside the vocabulary [0, {vocab_size}).")
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _check_size(self, text: str, what: str) -> None:
        """Refuses text too long to fit max_model_len tokens, without tokenizing it (a huge prompt takes minutes).

        No token covers more than max_token_bytes bytes of text, so text of more than
        max_model_len * max_token_bytes bytes certainly has more than max_model_len tokens.
        """
        limit = self.max_model_len * self.max_token_bytes
        num_bytes = len(text.encode("utf-8"))
        if num_bytes > limit:
            verb = "are" if what.endswith("s") else "is"
            raise InvalidRequest(
                f"The {what} {verb} {num_bytes} bytes, more than max_model_len tokens can hold: {limit} bytes "
                f"(max_model_len {self.max_model_len} x {self.max_token_bytes} bytes, the longest token)."
            )

    def render_chat(self, chat: inference_pb2.ChatPrompt) -> str:
        """The chat rendered through the model's chat template, with its tools (the template's ``tools``), its
        messages' tool calls and tool answers, and its ``chat_template_kwargs`` as more template variables.

        Raises:
            InvalidRequest: no template, no messages, a message without a role, tools or template variables
                ``chat_from_pb`` refuses, or messages the template refuses (its error, at most 160
                characters of it).
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest("This model has no chat template; send the prompt as text or token ids.")
        conversation = chat_from_pb(chat)
        try:
            return self.tokenizer.apply_chat_template(
                conversation.template_messages(), tools=conversation.template_tools(), tokenize=False,
                add_generation_prompt=conversation.add_generation_prompt,
                continue_final_message=conversation.continue_final_message, **conversation.chat_template_kwargs)
        # The template's raise_exception(...), a value it cannot read, or one it adds to text (TypeError); with
        # continue_final_message, transformers' ValueError when the last message's text is not in the rendering.
        except (jinja2.TemplateError, TypeError, ValueError) as error:
            reason = str(error).strip().rstrip(".")[:_ECHOED_TEMPLATE_ERROR_CHARACTERS] or type(error).__name__
            raise InvalidRequest(f"The model's chat template refused these messages: {reason}.") from None

    def model_info(self) -> inference_pb2.GetModelInfoResponse:
        """The model's facts (the servicer adds the cluster's fingerprint and block size)."""
        from splitserve import __version__

        return inference_pb2.GetModelInfoResponse(
            model_name=self.model_name, max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.model_config.eos_token_ids),
            has_chat_template=bool(getattr(self.tokenizer, "chat_template", None)),
            max_logprobs=MAX_LOGPROBS, server_version=__version__,
            think_start_token_ids=self.think_tag_ids[0], think_end_token_ids=self.think_tag_ids[1],
        )


def _check_chat_template(tokenizer) -> None:
    """Renders one user message through the tokenizer's chat template, so that a broken template stops the
    router at start rather than failing every chat request."""
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                      add_generation_prompt=True)
    except (jinja2.TemplateError, TypeError, ValueError) as error:
        reason = str(error).strip().rstrip(".")[:300] or type(error).__name__
        raise ValueError(f"The chat template cannot render a user's message: {reason}.") from None


def _chat_text(chat: inference_pb2.ChatPrompt) -> str:
    """Every text a chat carries (roles, contents, tool calls, tools), to bound its size before rendering."""
    parts = [part for message in chat.messages
             for part in (message.role, message.content, message.tool_call_id, message.name,
                          *(text for call in message.tool_calls for text in (call.id, call.name, call.arguments)))]
    parts += [text for tool in chat.tools for text in (tool.name, tool.description, tool.parameters)]
    parts += [text for name, value in chat.chat_template_kwargs.items() for text in (name, value.string_value)]
    return "".join(parts)


def max_token_bytes(tokenizer) -> int:
    """The UTF-8 length in bytes of the vocabulary's longest token (special tokens included).

    A token's vocabulary string is never shorter in UTF-8 than the text it covers:
    byte-level BPE writes each byte as one character of 1 or 2 UTF-8 bytes,
    SentencePiece writes a space as a 3-byte character and a byte-fallback token
    as 6 characters.
    """
    return max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())


def load_tokenizer(model_dir: Path):
    """The model's tokenizer, of the class ``AutoTokenizer`` picks (as the engine's is), without importing torch.

    ``AutoTokenizer`` reads the config through modules that import torch, and its
    choice of class is not just the class ``tokenizer_config.json`` names: a
    ``LlamaTokenizerFast`` declared over a ByteLevel ``tokenizer.json`` (Llama 3
    derivatives) is loaded as ``TokenizersBackend``, and ``LlamaTokenizer`` would
    split the text otherwise. The engine keeps the class it got from
    ``AutoTokenizer`` in the cache folder (``splitserve.common.tokenizer_class``);
    the router loads that class. Where no record exists yet, a short-lived process
    asks the engine's loader (which writes the record), so this process never
    imports torch. Only if that fails (no torch installed beside the router) is
    the class named in ``tokenizer_config.json`` taken, with a warning.
    """
    from transformers import PreTrainedTokenizerBase

    record = tokenizer_class.record_path(model_dir)
    chosen = (tokenizer_class.read_record(record, PreTrainedTokenizerBase, top_level_only=False)
              or tokenizer_class.resolve(_ask_the_engine_loader(model_dir), PreTrainedTokenizerBase,
                                         top_level_only=False))
    if chosen is None:
        chosen = _declared_tokenizer_class(model_dir)
        logger.warning("Could not learn which tokenizer class AutoTokenizer picks for %s; using %s, the class "
                       "tokenizer_config.json names. Prompts may be split other than the workers would split them.",
                       model_dir, chosen.__name__)
    return chosen.from_pretrained(str(model_dir))


ENGINE_LOADER_TIMEOUT_S = 300.0


def _ask_the_engine_loader(model_dir: Path) -> object | None:
    """The record entry (``tokenizer_class.describe``) of the class the engine's ``load_tokenizer`` gives for
    ``model_dir``, from a process of its own (which imports transformers' model table and torch, and records the
    class for the next start); None if it fails."""
    script = ("import json, sys\n"
              "from splitserve.common.tokenizer_class import describe\n"
              "from splitserve.engine.model_store import load_tokenizer\n"
              "print(json.dumps(describe(type(load_tokenizer(sys.argv[1])))))\n")
    try:
        result = subprocess.run([sys.executable, "-c", script, str(model_dir)], capture_output=True, text=True,
                                timeout=ENGINE_LOADER_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("Asking the engine's tokenizer loader failed: %s", type(error).__name__)
        return None
    if result.returncode != 0:
        logger.warning("The engine's tokenizer loader exited with status %d: %s", result.returncode,
                       result.stderr.strip().splitlines()[-1][:300] if result.stderr.strip() else "no message")
        return None
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _declared_tokenizer_class(model_dir: Path) -> type:
    """The class ``tokenizer_config.json`` names, or ``PreTrainedTokenizerFast`` (tokenizer.json) when it names
    none or transformers has no such class."""
    import transformers

    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    name = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
    return getattr(transformers, name, None) or transformers.PreTrainedTokenizerFast
