"""Beam search, as vLLM runs it: on top of the engine, one token a round.

Each round every live beam of every prompt is sent as a prompt of its own (its prompt and the tokens
it has so far) for one token with the `2 * beam_width` most likely next tokens' logprobs; the prefix
cache keeps what the beams share, so a round costs about a decode step per beam. Each candidate (a
beam and one of its next tokens) scores its cumulative logprob divided by its length (prompt
included, a final EOS not) to the power `length_penalty`; a prompt keeps its `beam_width` best
candidates, and those that end in EOS are set aside as finished. After `max_tokens` rounds, or when
no beam is left, the `beam_width` best of the finished and the live beams are the answer.

`BeamSearch` is that bookkeeping for one prompt and `BeamSearches` the rounds of several together;
`LLM.beam_search` and the server's `use_beam_search` drive them, the one with `generate`, the other
with the async engine: each only sends a round's sequences and hands back the answers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ferry.outputs import Logprob
from ferry.sampling_params import InvalidParameterError, RequestOutputKind, SamplingParams

MAX_BEAM_WIDTH = 128  # as `n`: each round sends this many sequences a prompt
MAX_LENGTH_PENALTY = 10.0  # length ** penalty stays a float for any context


@dataclass
class BeamSearchParams:
    """vLLM's: `beam_width` beams kept, at most `max_tokens` rounds; `length_penalty` the exponent
    of the length a beam's cumulative logprob is divided by (0: none, larger favours long beams)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # (the next tokens are the most likely ones whatever it is, as in vLLM)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if type(self.beam_width) is not int or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise InvalidParameterError("beam_width", f"beam_width must be in [1, {MAX_BEAM_WIDTH}]")
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise InvalidParameterError("max_tokens", "max_tokens must be an integer >= 1")
        if (isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float))
                or not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY):  # fmt: skip
            raise InvalidParameterError("length_penalty", f"length_penalty must be a number in "
                                        f"[-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}]")  # fmt: skip

    def step_params(self) -> SamplingParams:
        """One round's request for a beam: one token, with the logprobs of the candidates."""
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width,
                              ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip


@dataclass
class BeamSearchSequence:
    """A beam: its tokens (the prompt's first), per generated token the candidates' logprobs,
    and its cumulative logprob; `text` (the generated part) is filled when it is returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    """What `LLM.beam_search` returns per prompt: its best beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: set[int], length_penalty: float) -> float:
    """vLLM's: cumulative logprob / length ** length_penalty (a final EOS not counted)."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / max(length, 1) ** length_penalty


class BeamSearch:
    """One prompt's beams through the rounds."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: set[int],
                 max_model_len: int) -> None:  # fmt: skip
        if len(prompt_token_ids) >= max_model_len:
            raise InvalidParameterError("prompt", f"prompt has {len(prompt_token_ids)} tokens, but max_model_len is "
                                        f"{max_model_len}: no room left to generate")  # fmt: skip
        self.params = params
        self.eos = set() if params.ignore_eos else set(eos_token_ids)  # what finishes a beam
        self.eos_ids = set(eos_token_ids)  # a final one is left out of a beam's length, as vLLM's
        self.prompt_len = len(prompt_token_ids)
        self.rounds = min(params.max_tokens, max_model_len - self.prompt_len)  # a beam's tokens fit the context
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []

    def advance(self, candidates: list[dict[int, Logprob]]) -> None:
        """One round: `candidates[i]`, the next-token logprobs after beam i."""
        new = []
        for beam, top in zip(self.beams, candidates):
            for token, lp in top.items():
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top], beam.cum_logprob + lp.logprob)
                if token in self.eos:
                    child.finish_reason = "stop"
                    self.finished.append(child)
                else:
                    new.append(child)
        new.sort(key=self._score, reverse=True)
        self.beams = new[: self.params.beam_width]
        # (a finished beam's score is final: only the beam_width best can ever be returned)
        self.finished = sorted(self.finished, key=self._score, reverse=True)[: self.params.beam_width]

    def done(self, rounds: int) -> bool:
        return not self.beams or rounds >= self.rounds

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best of the finished and the live beams, best first."""
        for beam in self.beams:
            beam.finish_reason = "length"
        ranked = sorted(self.finished + self.beams, key=self._score, reverse=True)
        return ranked[: self.params.beam_width]

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam, self.eos_ids, self.params.length_penalty)


class BeamSearches:
    """Several prompts' searches, round by round: `next_round()` gives the sequences to send (each
    with its prompt's index), `advance(outputs)` takes the engine's answers to them, in order."""

    def __init__(self, searches: list[BeamSearch]) -> None:
        self.searches = searches
        self.rounds = 0
        self._live: list[BeamSearch] = []

    def next_round(self) -> list[tuple[int, list[int]]]:
        """(prompt index, tokens) of every live beam; empty once every search is done."""
        live = [i for i, s in enumerate(self.searches) if not s.done(self.rounds)]
        self._live = [self.searches[i] for i in live]
        return [(i, beam.tokens) for i in live for beam in self.searches[i].beams]

    def advance(self, outputs: Iterable) -> None:
        """The round's answers (RequestOutputs, in the order `next_round` gave the sequences).
        RuntimeError if a beam's request ended without a token."""
        outs = iter(outputs)
        for search in self._live:
            search.advance([candidates_of(next(outs)) for _ in search.beams])
        self.rounds += 1

    def best(self) -> list[list[BeamSearchSequence]]:
        """Each prompt's best beams, best first (BeamSearch.best)."""
        return [s.best() for s in self.searches]


def candidates_of(output) -> dict[int, Logprob]:
    """A round's answer for one beam: its next tokens' logprobs. RuntimeError if the request did
    not run (aborted: e.g. its adapter unloaded meanwhile)."""
    completion = output.outputs[0]
    if not completion.logprobs:
        raise RuntimeError(f"a beam's request ended without a token ({completion.finish_reason})")
    return completion.logprobs[0]
