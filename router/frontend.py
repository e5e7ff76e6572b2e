"""The router's front door: prompts (text, token ids, chat) -> validated token ids, and model facts.

The router tokenizes once, so workers receive token ids; it loads the model's
tokenizer and config only, never its weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.model_store import model_fingerprint, resolve_model
from splitserve.engine.models.model_config import ModelConfig
from splitserve.engine.sampling_params import MAX_LOGPROBS
from splitserve.rpc.errors import InvalidArgument
from splitserve.v1 import inference_pb2


@dataclass
class Prompt:
    """A validated prompt: its token ids and the text they came from (None for token ids)."""

    token_ids: list[int]
    text: str | None


class Frontend:
    """Tokenizer, chat template and limits of the served model.

    Args:
        model: model directory (None: the default model).
        dtype: the workers' dtype, part of the model fingerprint.
        max_model_len: the cluster's context limit (None: the model's).
    """

    def __init__(self, model: str | None, dtype: str = "float32", max_model_len: int | None = None) -> None:
        from transformers import AutoTokenizer

        self.model_dir = resolve_model(model)
        self.model_config = ModelConfig.from_model_dir(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.max_model_len = min(max_model_len or self.model_config.max_model_len, self.model_config.max_model_len)
        self.model_fingerprint = model_fingerprint(self.model_dir, dtype)
        self.model_name = self.model_dir.name

    def prompt_of(self, request) -> Prompt:
        """The token ids of a GenerateRequest's (or TokenizeRequest's) prompt.

        Raises:
            InvalidArgument: no prompt, an empty one, ids outside the vocabulary,
                or one that leaves no room to generate within max_model_len.
        """
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidArgument("The request has no prompt: set text, token_ids or chat.")
        if kind == "text":
            text = request.text
            token_ids = self.tokenizer.encode(text, add_special_tokens=True) if text else []
        elif kind == "token_ids":
            text, token_ids = None, list(request.token_ids.ids)
        else:
            text = self.render_chat(request.chat)
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.check(token_ids)
        return Prompt(token_ids, text)

    def render_chat(self, chat: inference_pb2.ChatPrompt) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgument("This model has no chat template; send the prompt as text or token ids.")
        if not chat.messages:
            raise InvalidArgument("The chat prompt has no messages.")
        messages = [{"role": message.role, "content": message.content} for message in chat.messages]
        for index, message in enumerate(messages):
            if not message["role"]:
                raise InvalidArgument(f"Chat message {index} has no role.")
        add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def check(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidArgument("The prompt is empty: give at least one token.")
        vocab_size = self.model_config.vocab_size
        bad = next((token for token in token_ids if not 0 <= token < vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"Prompt token id {bad} is outside the vocabulary [0, {vocab_size}).")
        if len(token_ids) >= self.max_model_len:
            raise InvalidArgument(
                f"The prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which must leave room for at least one generated token."
            )

    def model_info(self) -> inference_pb2.GetModelInfoResponse:
        from splitserve import __version__

        return inference_pb2.GetModelInfoResponse(
            model_name=self.model_name, model_fingerprint=self.model_fingerprint,
            max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.model_config.eos_token_ids),
            has_chat_template=bool(getattr(self.tokenizer, "chat_template", None)),
            max_logprobs=MAX_LOGPROBS, server_version=__version__,
        )
