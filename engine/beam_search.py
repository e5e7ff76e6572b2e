"""Beam search over the engine (vLLM's ``LLM.beam_search``), ranked as transformers' ``generate(num_beams=...)``
ranks its beams, so that its beams are transformers' on the same weights.

It runs outside the scheduler, one token at a time: each step asks the engine for one token of every live beam of
every prompt, in one batch, with the top ``2 * beam_width`` log probabilities of the next token. ``LLM.beam_search``
and a decode worker's search (``decode_service/beam_search.py``, what the router's ``beam_search`` and the
gateway's ``use_beam_search`` run) have each beam fork the KV of the beam it grew from (request.KVFork), so a step
computes one token a beam (vLLM's server shares it through its prefix cache instead: whole blocks only, a beam's
last partial block recomputed every step). Of the
``2 * beam_width`` best continuations of a prompt's beams (by cumulative log probability), those among the first
``beam_width`` that end in the end-of-sequence token (unless ``ignore_eos``), or reach ``max_tokens``, are
finished, scored by their cumulative log probability over their generated length (the end-of-sequence token
counted) to the power ``length_penalty``, and the best ``beam_width`` finished ones kept; the first ``beam_width``
that are not finished live on. The search of a prompt ends when no live beam could beat its worst kept finished
one (transformers' heuristic with ``early_stopping`` false: the best live beam scored at its current length) or
at ``max_tokens``. vLLM ranks differently (the prompt counted in every beam's length, every end-of-sequence
candidate kept), which favours beams that end early over transformers' choice; splitserve follows
transformers, the reference its tests hold it to.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass, field

from splitserve.common.beam_search_params import MAX_CANDIDATES, BeamSearchParams
from splitserve.engine.request import KVFork

__all__ = ["MAX_CANDIDATES", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "beam_candidates",
           "beam_forks", "beam_search", "beam_search_steps", "generated_tokens"]

@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` (the prompt's, then the generated), each generated token's candidates' log
    probabilities (``logprobs``), their sum (``cum_logprob``) and, once returned, the generated ``text`` (a final
    end-of-sequence token left out)."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best ``beam_width`` beams, best first (vLLM's ``BeamSearchOutput``), and its length."""

    sequences: list[BeamSearchSequence]
    prompt_len: int = 0


def beam_search(prompts: list[list[int]], params: BeamSearchParams, step: Callable[[list[list[int]]], list[dict]],
                eos_token_ids: Collection[int], decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
    """Each prompt's best beams, best first.

    Args:
        prompts: each prompt's token ids.
        step: given token sequences, each one's next-token log probabilities ``{token_id: logprob}`` (the top
            ``2 * beam_width`` at least), in order.
        eos_token_ids: the tokens that finish a beam (the model's end-of-sequence ids).
        decode: token ids to text.
    """
    steps = beam_search_steps(prompts, params, eos_token_ids)
    try:
        sequences = next(steps)
        while True:
            sequences = steps.send(step(sequences))
    except StopIteration as done:
        outputs = done.value
    for output in outputs:
        for beam in output.sequences:
            beam.text = decode(generated_tokens(beam, output.prompt_len, params, eos_token_ids))
    return outputs


def beam_search_steps(prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: Collection[int]
                      ) -> Generator[list[list[int]], list[dict], list[BeamSearchOutput]]:
    """The search as a generator, for a caller that steps the model its own way: it yields the token sequences of
    a step, is sent each one's next-token log probabilities, and returns each prompt's best beams (their ``text``
    not set)."""
    params.check()
    width = params.beam_width
    ends = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
    kept = max(2, 1 + len(ends)) * width  # continuations considered a step, as transformers keeps them
    searches = [_Search(prompt, width) for prompt in prompts]
    for length in range(1, params.max_tokens + 1):
        open_searches = [search for search in searches if search.live]
        if not open_searches:
            break
        beams = [beam for search in open_searches for beam in search.live]
        distributions = iter((yield [beam.tokens for beam in beams]))
        for search in open_searches:
            candidates = []
            for beam in search.live:
                distribution = next(distributions)
                candidates += [(beam.cum_logprob + logprob, token_id, beam, distribution)
                               for token_id, logprob in distribution.items()]
            candidates.sort(key=lambda candidate: -candidate[0])  # stable: ties keep the beams' order
            search.advance(candidates[:kept], length, length == params.max_tokens, ends, params.length_penalty)
    return [BeamSearchOutput(search.finished, len(search.prompt)) for search in searches]


def beam_candidates(beam_width: int, eos_token_ids: Collection[int]) -> int:
    """The next-token log probabilities a step asks for: as many continuations as the search considers (two a
    beam, more for a model with several end-of-sequence ids, as transformers keeps them), at most
    ``MAX_CANDIDATES``."""
    return min(MAX_CANDIDATES, max(2, 1 + len(eos_token_ids)) * beam_width)


def beam_forks(sequences: list[list[int]], held: dict[tuple[int, ...], str]) -> list[KVFork | None]:
    """Each of a step's sequences' fork of the request it grew from (``held``: the last step's requests, by their
    tokens), None for a sequence that grew from none held; the last sequence to grow from a request takes over its
    partial block (``take_tail``), the others copy it."""
    parents = [held.get(tuple(tokens[:-1])) for tokens in sequences]
    last_fork = {parent: index for index, parent in enumerate(parents)}
    return [None if parent is None else KVFork(parent, take_tail=last_fork[parent] == index)
            for index, parent in enumerate(parents)]


def generated_tokens(beam: BeamSearchSequence, prompt_len: int, params: BeamSearchParams,
                     eos_token_ids: Collection[int]) -> list[int]:
    """A beam's generated tokens, without a final end-of-sequence token (unless ``ignore_eos``)."""
    generated = beam.tokens[prompt_len:]
    if generated and not params.ignore_eos and generated[-1] in eos_token_ids:
        generated = generated[:-1]
    return generated


class _Search:
    """One prompt's beams: the live ones and the best finished ones (at most ``width`` of each)."""

    def __init__(self, prompt: list[int], width: int) -> None:
        self.prompt, self.width = list(prompt), width
        self.live = [BeamSearchSequence(list(prompt))]
        self.finished: list[BeamSearchSequence] = []
        self.scores: list[float] = []  # the finished beams', in their order (best first)

    def advance(self, candidates: list, length: int, last: bool, ends: frozenset[int],
                length_penalty: float) -> None:
        """Take one step's best continuations (``(cumulative log probability, token, beam, distribution)``, best
        first): finish those among the first ``width`` that end or reach the last step, keep the first ``width``
        others live, and close the search when no live beam can beat the worst finished one."""
        grown = [(score, BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [distribution], score),
                  last or token_id in ends) for score, token_id, beam, distribution in candidates]
        for rank, (score, child, done) in enumerate(grown):
            if done and rank < self.width:
                self._finish(child, score / length ** length_penalty)
        self.live = [child for _, child, done in grown if not done][: self.width]
        if len(self.finished) == self.width and self.live \
                and self.live[0].cum_logprob / length ** length_penalty <= self.scores[-1]:
            self.live = []

    def _finish(self, beam: BeamSearchSequence, score: float) -> None:
        index = next((index for index, kept in enumerate(self.scores) if score > kept), len(self.scores))
        if index < self.width:
            self.scores.insert(index, score)
            self.finished.insert(index, beam)
            del self.scores[self.width:], self.finished[self.width:]
