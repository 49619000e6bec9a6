"""Per-request sampling parameters, with vLLM's names and semantics."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

# Temperatures below this sample greedily, as in vLLM.
_GREEDY_EPS = 1e-5


class InvalidParameterError(ValueError):
    """A bad request parameter; `param` names it (the OpenAI error body's `param`)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a grammar (vLLM's `structured_outputs`): exactly one of a
    JSON schema (`json`, a dict or its JSON text), any JSON object (`json_object`), a regular
    expression (`regex`), one of some strings (`choice`), or a Lark / GBNF grammar (`grammar`).

    `disable_any_whitespace` allows no whitespace between JSON tokens (compact output);
    `whitespace_pattern` replaces the regex of what may stand between them. Compiled by
    llguidance (`ferry/structured_output/`).

    `after_token_ids`: the grammar applies only from the token after these appear in the output
    (a reasoning model's `</think>`: the server's `--reasoning-parser` sets it, so the answer
    follows the grammar and the thinking before it is free)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    after_token_ids: list[int] | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            why = "none was" if not given else f"got {', '.join(given)}"
            raise InvalidParameterError(
                "structured_outputs", f"structured_outputs needs exactly one of {', '.join(self.KINDS)}; {why}"
            )
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise InvalidParameterError("structured_outputs.choice", "choice must be a non-empty list of strings")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParameterError(f"structured_outputs.{name}", f"{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidParameterError("structured_outputs.json", "json must be a JSON schema (an object or its text)")
        if self.after_token_ids is not None and (
            not isinstance(self.after_token_ids, list) or not self.after_token_ids
            or not all(type(t) is int and t >= 0 for t in self.after_token_ids)
        ):  # fmt: skip
            raise InvalidParameterError("structured_outputs.after_token_ids", "after_token_ids must be token ids")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


POOLING_TYPES = ("last", "mean", "cls")


@dataclass
class PoolingParams:
    """Embed the prompt instead of generating from it (`LLM.embed`, `/v1/embeddings`): the model's
    final hidden states (after its last norm) pooled over the prompt: the `last` token's (what
    decoder embedding models such as e5-mistral and gte-Qwen are trained for), the `mean` of all,
    or the first (`cls`); L2-normalised unless `normalize` is False. `pooling_type` None: the
    engine's `--pooling-type`."""

    pooling_type: str | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidParameterError("pooling_type", f"pooling_type must be one of {', '.join(POOLING_TYPES)}")


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` reports for a request (vLLM's names)."""

    CUMULATIVE = 0  # all tokens and text so far, every step
    DELTA = 1  # only what is new since the last report (streaming)
    FINAL_ONLY = 2  # one report, when the request finishes


@dataclass
class SamplingParams:
    """How to sample the continuation of one prompt.

    Lower-level semantics follow vLLM: `temperature == 0` is greedy; `top_k`
    of 0 or -1 disables top-k; penalties apply before temperature; logprobs
    are of the raw model distribution; `stop` strings are excluded from the
    text unless `include_stop_str_in_output`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    # vLLM's: the logprob of every prompt token after the first (and its rank), with this many of
    # the most likely alternatives; such a request computes its whole prompt (no prefix-cache hits).
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled (every other logit masked); None: any.
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never to generate. Each is tokenized as it would start the text and as it would
    # follow a space; a step forbids a word's last token when the output ends with the tokens before it.
    bad_words: list[str] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context holds, less one).
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrain the output to a grammar (JSON schema, regex, choice, Lark); None: unconstrained.
    structured_outputs: StructuredOutputsParams | None = None
    # Set: embed the prompt (one pooled vector, no tokens); see PoolingParams.
    pooling: PoolingParams | None = None
    # Filled by the engine from the model's config (EOS ids); not a user knob.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the input processor from `bad_words` (the tokenizer lives there, not in the core).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop = list(self.stop)
        else:
            raise InvalidParameterError("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise InvalidParameterError(
                "stop_token_ids", f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("allowed_token_ids", "bad_words"):
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        if self.top_k == -1:
            self.top_k = 0
        self.verify()
        if 0.0 < self.temperature < _GREEDY_EPS:
            self.temperature = 0.0  # dividing logits by it would overflow float32 into NaN
        self.all_stop_token_ids = set(self.stop_token_ids)

    def verify(self) -> None:
        """Raise ValueError naming the first invalid field."""

        def bad(name: str, why: str) -> None:
            raise InvalidParameterError(name, f"{name} {why}, got {getattr(self, name)!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(name, "must be a finite number")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.temperature < 0.0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", "must be a non-negative integer")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            bad("prompt_logprobs", "must be a non-negative integer")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63 - self.n):
            bad("seed", "must be an integer in [-2**63, 2**63 - n)")
        if any(not s for s in self.stop):
            bad("stop", "must not contain empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b)
                for b in self.logit_bias.values()
            ):
                bad("logit_bias", "must map token ids to finite numbers")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
            or any(type(t) is not int or t < 0 for t in self.allowed_token_ids)
        ):  # fmt: skip
            bad("allowed_token_ids", "must be a non-empty list of token ids")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            bad("bad_words", "must be a list of non-blank strings")
        if self.truncate_prompt_tokens is not None and (
            type(self.truncate_prompt_tokens) is not int or self.truncate_prompt_tokens == 0
            or self.truncate_prompt_tokens < -1
        ):  # fmt: skip
            bad("truncate_prompt_tokens", "must be -1 (the context's length) or an integer >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


def truncated_prompt(ids: list, truncate_prompt_tokens: int | None, max_model_len: int) -> list:
    """The prompt `truncate_prompt_tokens` leaves (vLLM's): its last k tokens; -1: as many as the
    context holds with room for one token generated; None: all of it."""
    if truncate_prompt_tokens is None:
        return ids
    keep = max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return ids[-keep:] if len(ids) > keep else ids


def resolve_stop_token_ids(params: SamplingParams, eos_token_ids: set[int]) -> None:
    """Fill `all_stop_token_ids`: the user's stop ids plus EOS unless `ignore_eos` (sets do not
    cross the API -> core wire, so the core resolves them again)."""
    params.all_stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
