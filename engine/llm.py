"""The offline entry point, shaped like vLLM's: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from splitserve.common.block_hash import check_cache_salt
from splitserve.common.chat import Chat
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.scoring import cosine, pair_up
from splitserve.engine.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    beam_candidates,
    beam_forks,
    beam_search,
)
from splitserve.engine.config import DEFAULT_STEP_LIMITS, EngineConfig, likely_device, resolve_device, resolve_dtype
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.lora import LoRARequest
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.parallel_sampling import ParallelSamples
from splitserve.engine.pooling import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingParams,
    ScoringOutput,
    ScoringRequestOutput,
)

# A prompt: text, or {"prompt_token_ids": [...]} (optionally with "prompt": text), or {"prompt": text}; a dict may
# carry vLLM's "cache_salt" (its blocks in the prefix cache are then found only by prompts with the same salt).
PromptType = str | dict[str, Any]

# The offline step budget, where nobody waits on a token: twice a server's (EngineConfig's 2,048), as
# vLLM's CPU platform sets for its LLM class (4,096, against 2,048 for its API server). Fewer, larger
# prompt steps finish every prompt sooner, so the decode-only steps that follow, each paying a full read
# of the weights, start earlier: the offline workload of benchmarks/offline_throughput.py ran in 19.4 s
# at 4,096 against 20.6 s at 2,048 (2-core Sapphire Rapids).
OFFLINE_MAX_NUM_BATCHED_TOKENS = 4096
# On a GPU, twice a server's too, as vLLM's LLM class on GPUs (16,384 against 8,192 for its server).
OFFLINE_CUDA_MAX_NUM_BATCHED_TOKENS = 16384

# The offline block size where the C++ kernels attend (CPU, attention backend "auto" or "cpu"): 128
# tokens, as vLLM's CPU platform sets for every engine there; elsewhere EngineConfig's 16 (vLLM's on GPUs).
# The cache keeps a block's keys and values of all heads of a layer together, so decode attention reads each
# request in pieces of 2 x kv_heads x block_size x head_dim floats: 192 KB for SmolLM at 128 tokens against
# 24 KB at 16, which the decode kernel read at 25-27 against 19 GB/s (a C++ harness, 2-core Zen 4). The
# offline workload of benchmarks/offline_throughput.py ran at 133.6 output tok/s at 128 against 130.7 at 16
# (medians of 3, 2-core AMD EPYC). Servers keep 16: the prefill and decode workers of a cluster must agree
# on it, and the KV connectors move whole blocks.
OFFLINE_CPU_BLOCK_SIZE = 128


class LLM:
    """Load a model and generate offline, continuously batched.

    Args:
        model: a local Hugging Face Llama-family directory; None for the default model.
        **engine_options: any :class:`EngineConfig` field (dtype, block_size,
            max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching, ...).
            max_num_batched_tokens defaults to twice a server's here (at least max_num_seqs):
            OFFLINE_MAX_NUM_BATCHED_TOKENS (4,096) on a CPU, OFFLINE_CUDA_MAX_NUM_BATCHED_TOKENS (16,384) on
            CUDA; block_size to OFFLINE_CPU_BLOCK_SIZE (128) where the C++ kernels attend on a CPU, else to 16.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        if engine_options.get("max_num_batched_tokens") is None:
            engine_options["max_num_batched_tokens"] = offline_max_num_batched_tokens(engine_options)
        if "block_size" not in engine_options and _attends_in_cpu_kernels(engine_options):
            engine_options["block_size"] = OFFLINE_CPU_BLOCK_SIZE
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's blocks, as vLLM's ``LLM.reset_prefix_cache`` (benchmarks that repeat a
        workload call it between runs)."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, all batched together; outputs come back in prompt order.

        ``lora_request`` (one for every prompt, or one per prompt, None for the base model) runs prompts with LoRA
        adapters, in an engine made with ``enable_lora=True`` (vLLM's ``LLM(..., enable_lora=True)``).

        ``priority`` (one per prompt, as vLLM's) orders the prompts under the priority scheduling policy
        (``LLM(..., scheduling_policy="priority")``; lower first). Every prompt, parameter set and priority is
        checked before any is queued, so a bad one raises ``ValueError`` without leaving work behind.
        """
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"Got {len(priorities)} priorities for {len(prompt_list)} prompts.")
        adapters = (list(lora_request) if isinstance(lora_request, (list, tuple))
                    else [lora_request] * len(prompt_list))
        if len(adapters) != len(prompt_list):
            raise ValueError(f"Got {len(adapters)} lora_requests for {len(prompt_list)} prompts.")
        requests = []
        for prompt, params, value in zip(prompt_list, params_list, priorities):  # validate (and tokenize) all first
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}.")
            text, token_ids = self._token_ids_of(prompt)
            requests.append((text, self.engine.prompt_token_ids_of(text, token_ids, params), _cache_salt_of(prompt)))
            self.engine.check_priority(value)
        request_ids, groups, samples = [], [], ParallelSamples(self.engine)
        try:
            for (text, token_ids, salt), params, value, adapter in zip(requests, params_list, priorities, adapters):
                groups.append([self.engine.next_request_id() for _ in range(params.n)])
                samples.add(groups[-1], text, params, request_ids, prompt_token_ids=token_ids, priority=value,
                            lora_request=adapter, cache_salt=salt)
        except ValueError:  # an adapter that cannot load: nothing of this call stays queued
            self._abort_all(request_ids)
            raise
        try:
            outputs = self._run(request_ids, use_tqdm, after_step=samples.release_started)
        finally:
            samples.release_all()
        return _gathered(groups, outputs)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, as vLLM's ``LLM.embed``: its last token's final hidden state, normalized
        (``pooling_params``; engine/pooling.py), all prompts batched together and returned in their order. The
        prompts run as generation requests do until their last token, which gives the embedding in place of a
        token. Every prompt is checked before any is queued."""
        params = pooling_params if pooling_params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}.")
        params.check(self.engine.model_config.hidden_size)
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        adapters = (list(lora_request) if isinstance(lora_request, (list, tuple))
                    else [lora_request] * len(prompt_list))
        if len(adapters) != len(prompt_list):
            raise ValueError(f"Got {len(adapters)} lora_requests for {len(prompt_list)} prompts.")
        requests = []
        for prompt in prompt_list:
            text, token_ids = self._token_ids_of(prompt)
            requests.append((text, self.engine.prompt_token_ids_of(text, token_ids), _cache_salt_of(prompt)))
        request_ids = []
        try:
            for (text, token_ids, salt), adapter in zip(requests, adapters):
                request_id = self.engine.next_request_id()
                self.engine.add_request(request_id, text, prompt_token_ids=token_ids, lora_request=adapter,
                                        pooling_params=params, cache_salt=salt)
                request_ids.append(request_id)
        except ValueError:
            self._abort_all(request_ids)
            raise
        return [EmbeddingRequestOutput(output.request_id, output.prompt_token_ids, EmbeddingOutput(output.embedding))
                for output in self._run(request_ids, use_tqdm)]

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Each prompt's ``params.beam_width`` best continuations by beam search, best first, as vLLM's
        ``LLM.beam_search`` (engine/beam_search.py): a step asks for one token of every live beam, all prompts'
        beams in one batch, with the top ``2 * beam_width`` log probabilities. A beam forks the KV of the one it
        grew from (request.KVFork: the full blocks shared, the partial one copied, or taken by the last beam to
        grow from it), so a step computes one token a beam, as transformers does. ``lora_request`` searches with
        that LoRA adapter (an engine made with ``enable_lora=True``), as vLLM's.

        Raises:
            InvalidRequest: a bad parameter or prompt (nothing runs).
        """
        params.check()
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        token_ids = [self.engine.prompt_token_ids_of(*self._token_ids_of(prompt)) for prompt in prompt_list]
        # No beam may outgrow the context (each prompt leaves room for a token: prompt_token_ids_of checks it).
        room = self.engine.max_model_len - max(len(ids) for ids in token_ids)
        params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
        eos_token_ids = self.engine.eos_token_ids
        tokenizer = self.get_tokenizer()
        steps = _ForkingSteps(self, beam_candidates(params.beam_width, eos_token_ids), params.temperature,
                              lora_request, params.max_tokens if use_tqdm else None)
        try:
            return beam_search(token_ids, params, steps, eos_token_ids,
                               lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        finally:
            steps.release()

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        /,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """Each pair's score, as vLLM's ``LLM.score`` with an embedding model: the cosine similarity of the two
        prompts' embeddings (:meth:`embed`'s, normalized). ``data_1`` is one prompt, scored against each of
        ``data_2``, or a list as long as ``data_2``, scored pairwise. Each distinct prompt is embedded once, all
        in one batch.

        Raises:
            ValueError: either side is empty, or the two lists differ in length and ``data_1`` holds more than one.
        """
        firsts = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
        seconds = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
        pairs = pair_up(firsts, seconds)
        keys = list(dict.fromkeys(_prompt_key(prompt) for pair in pairs for prompt in pair))
        prompts = {_prompt_key(prompt): prompt for pair in pairs for prompt in pair}
        embedded = dict(zip(keys, self.embed([prompts[key] for key in keys], use_tqdm=use_tqdm,
                                             lora_request=lora_request)))
        outputs = []
        for first, second in pairs:
            one, other = embedded[_prompt_key(first)], embedded[_prompt_key(second)]
            outputs.append(ScoringRequestOutput(
                f"{one.request_id}+{other.request_id}", one.prompt_token_ids + other.prompt_token_ids,
                ScoringOutput(cosine(one.outputs.embedding, other.outputs.embedding))))
        return outputs

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (lists of OpenAI chat messages: {"role", "content"}, an assistant's
        ``tool_calls``, a tool's answer) through the model's chat template, or ``chat_template`` (a Jinja
        template's text), which is shown ``tools`` (OpenAI's function tools) and ``chat_template_kwargs`` (more
        template variables, such as ``{"enable_thinking": False}`` for Qwen3's), as vLLM's ``LLM.chat`` does;
        ``lora_request`` as :meth:`generate` takes it."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(conversation, add_generation_prompt, tools, chat_template,
                                            chat_template_kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            chat_template_kwargs: dict | None = None) -> dict:
        """The prompt of a conversation (its text and token ids), rendered as the router renders a chat.

        Raises:
            ValueError: no chat template, or malformed messages, tools or template variables
                (``Chat.from_openai``).
        """
        tokenizer = self.engine.tokenizer
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("This model has no chat template; use generate() with a plain prompt.")
        chat = Chat.from_openai(conversation, tools, chat_template_kwargs=chat_template_kwargs)
        text = tokenizer.apply_chat_template(chat.template_messages(), tools=chat.template_tools(), tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **chat.chat_template_kwargs)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": token_ids}

    @staticmethod
    def _params_per_prompt(params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"Got {len(params)} sampling_params for {count} prompts.")
        return params

    @staticmethod
    def _token_ids_of(prompt: PromptType) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, str):
            return prompt, None
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], None
        raise ValueError('A prompt must be a string or a dict with "prompt_token_ids" or "prompt".')

    def _run(self, request_ids: Iterable[str], use_tqdm: bool,
             after_step: Callable[[], None] | None = None) -> list[RequestOutput]:
        request_ids = list(request_ids)
        final: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="Generating", unit="req")
        try:
            while len(final) < len(request_ids):
                for output in self.engine.step():
                    if output.finished:
                        final[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
                if after_step is not None:
                    after_step()
        except BaseException:
            self._abort_all([request_id for request_id in request_ids if request_id not in final])
            raise
        finally:
            if progress is not None:
                progress.close()
        return [final[request_id] for request_id in request_ids]

    def _abort_all(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.abort_request(request_id)
        self.engine.step()  # drain the abort outputs


def _gathered(groups: list[list[str]], outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output a prompt: its first completion's, with every completion of the prompt, indexed in order."""
    by_id = {output.request_id: output for output in outputs}
    gathered = []
    for group in groups:
        first = by_id[group[0]]
        if len(group) > 1:
            completions = []
            for index, request_id in enumerate(group):
                completion = by_id[request_id].outputs[0]
                completion.index = index
                completions.append(completion)
            first = dataclasses.replace(first, outputs=completions)
        gathered.append(first)
    return gathered


class _ForkingSteps:
    """Beam search's steps through an LLM's engine: each sequence a one-token request with the top ``candidates``
    log probabilities, holding its blocks when done (``keep_kv``) so that the next step's sequences that grow from
    it fork its KV; a step's requests release the step's before it once they are done. With ``max_steps`` a
    progress bar counts the steps, one bar for the whole search (as vLLM's)."""

    def __init__(self, llm: LLM, candidates: int, temperature: float, lora_request: LoRARequest | None,
                 max_steps: int | None = None) -> None:
        self.llm, self.lora_request = llm, lora_request
        self.progress = None
        if max_steps is not None:
            from tqdm import tqdm

            self.progress = tqdm(total=max_steps, desc="Beam search", unit="step")
        self.params = SamplingParams(temperature=temperature, max_tokens=1, logprobs=candidates, ignore_eos=True)
        self.held: dict[tuple[int, ...], str] = {}  # the last step's requests, by their tokens
        self.to_release: list[str] = []  # every request that may hold blocks

    def __call__(self, sequences: list[list[int]]) -> list[dict[int, float]]:
        engine = self.llm.engine
        request_ids = []
        try:
            for tokens, fork in zip(sequences, beam_forks(sequences, self.held)):
                request_id = engine.next_request_id()
                engine.add_request(request_id, prompt_token_ids=tokens, sampling_params=self.params, kv_fork=fork,
                                   keep_kv=True, lora_request=self.lora_request)
                self.to_release.append(request_id)
                request_ids.append(request_id)
        except BaseException:  # nothing of the step stays queued
            self.llm._abort_all(request_ids)
            raise
        outputs = self.llm._run(request_ids, use_tqdm=False)
        if self.progress is not None:
            self.progress.update(1)
        for request_id in self.held.values():
            engine.release_kv(request_id)
        self.held = {tuple(output.prompt_token_ids): output.request_id for output in outputs}
        return [output.outputs[0].logprobs[0] for output in outputs]

    def release(self) -> None:
        """Free every block a step's request still holds (after the search, or when it failed)."""
        for request_id in self.to_release:
            self.llm.engine.release_kv(request_id)
        self.to_release, self.held = [], {}
        if self.progress is not None:
            self.progress.close()


def offline_max_num_batched_tokens(engine_options: dict[str, Any]) -> int:
    """The offline step budget for an engine with these options: twice a server's on its device, and at least
    its max_num_seqs (as given, else the device's default)."""
    device = likely_device(engine_options.get("device", "auto"))
    budget = OFFLINE_CUDA_MAX_NUM_BATCHED_TOKENS if device == "cuda" else OFFLINE_MAX_NUM_BATCHED_TOKENS
    max_num_seqs = engine_options.get("max_num_seqs")
    if not isinstance(max_num_seqs, int):  # None, or a wrong value that EngineConfig refuses with a sentence
        max_num_seqs = DEFAULT_STEP_LIMITS[device][0]
    return max(budget, max_num_seqs)


def _attends_in_cpu_kernels(engine_options: dict[str, Any]) -> bool:
    """Whether an engine with these options runs on the CPU (float32 or bfloat16) with the C++ attention
    kernels asked for (backend "auto" or "cpu")."""
    device = resolve_device(engine_options.get("device", "auto"), torch.cuda.is_available())
    return (device == "cpu" and resolve_dtype(engine_options.get("dtype", "auto"), device) in ("float32", "bfloat16")
            and engine_options.get("attention_backend", "auto") in ("auto", "cpu"))


def _cache_salt_of(prompt: PromptType) -> str | None:
    """A dict prompt's ``cache_salt`` (vLLM's), checked; None for text or a dict without one."""
    return check_cache_salt(prompt.get("cache_salt")) if isinstance(prompt, dict) else None


def _prompt_key(prompt: PromptType) -> str:
    """A prompt as a dict key: equal prompts (a text, or a dict of the same fields) get equal keys."""
    return prompt if isinstance(prompt, str) else "\x00" + json.dumps(prompt, sort_keys=True, default=str)
