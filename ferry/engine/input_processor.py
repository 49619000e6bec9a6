"""Turns a user prompt + SamplingParams into validated EngineCoreRequests.

Runs wherever requests enter: in `LLMEngine` (same process as the model) and
in the API server's process (which has only the tokenizer and `EngineInfo`).
Every check happens here, before anything is queued, so a bad request raises
`InvalidParameterError` naming the field and changes no state.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from ferry.engine.messages import EngineCoreRequest, EngineInfo
from ferry.sampling_params import InvalidParameterError, SamplingParams, resolve_stop_token_ids, truncated_prompt
from ferry.structured_output.grammar import check as check_grammar

# A dict holds "prompt" (text) and/or "prompt_token_ids", and may hold vLLM's "cache_salt".
PromptType = str | dict[str, Any] | list[int]


@dataclass
class ProcessedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seq_ids: list[str]  # one core request per sequence: `<id>` for n == 1, else `<id>#0` ...
    core_requests: list[EngineCoreRequest]


def context_length_message(max_model_len: int, num_prompt: int, max_tokens: int) -> str:
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the completion). "
        "Please reduce the length of the prompt or completion."
    )


def _token_id(t):
    """`t` as a Python int when it is an integer of another kind (numpy's, a 0-d torch tensor's);
    else as it is, for the check that names it."""
    if isinstance(t, int) or isinstance(t, (float, str, bytes)):
        return t
    try:
        return operator.index(t)
    except TypeError:
        return t


def bad_words_token_ids(tokenizer, bad_words: list[str]) -> list[list[int]]:
    """Each bad word's token ids as vLLM finds them: the word (leading blanks dropped) as it would
    start the text, and again after a space where that gives another first token and as many tokens
    (a word inside the text)."""
    out: list[list[int]] = []
    for word in bad_words:
        word = word.lstrip()
        alone = tokenizer.encode(word, add_special_tokens=False)
        if not alone:  # nothing the tokenizer keeps: no token to forbid
            continue
        out.append(alone)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return out


def check_logprobs(params: SamplingParams, limit: int, logprobs_field: str = "logprobs") -> None:
    """Hold a request's logprobs and prompt_logprobs to `limit` (--max-logprobs), in vLLM's words;
    `logprobs_field`: what the client called it (a chat's `top_logprobs`)."""
    for name, field, asked in (("sample", logprobs_field, params.logprobs),
                               ("prompt", "prompt_logprobs", params.prompt_logprobs)):  # fmt: skip
        if asked is not None and asked > limit:
            raise InvalidParameterError(field, f"Requested {name} logprobs of {asked}, which is greater than max "
                                               f"allowed: {limit} (--max-logprobs)")  # fmt: skip


class InputProcessor:
    def __init__(self, tokenizer, info: EngineInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.eos_token_ids = set(info.eos_token_ids)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidParameterError("prompt", "prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list):
            return None, list(prompt)
        if not isinstance(prompt, str):
            raise InvalidParameterError(
                "prompt", f"prompt must be a string, a token-id list or a dict, got {type(prompt).__name__}"
            )
        if self.tokenizer is None:
            raise InvalidParameterError(
                "prompt",
                "this model has no tokenizer (--load-format dummy, or a directory without tokenizer files): "
                "send token ids, e.g. {'prompt_token_ids': [...]}",
            )
        return prompt, self.tokenizer.encode(prompt)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        in_use: Container[str] = (),
        strict_context: bool = False,
        asked_max_tokens: int | None = None,
        lora_name: str | None = None,
    ) -> ProcessedRequest:
        """Validate and build the core requests.

        `strict_context`: reject prompt + max_tokens > max_model_len (the server's behaviour,
        as OpenAI's) instead of shortening max_tokens to the room left (LLM.generate's); the
        max_tokens held against the room is `asked_max_tokens`, the client's, where given (the
        params' may be lower: the model's max_new_tokens caps it), as vLLM checks.
        """
        if lora_name is not None and lora_name not in self.info.lora_digests:
            loaded = ", ".join(self.info.lora_digests) or "none"
            raise InvalidParameterError("model", f"no LoRA adapter named {lora_name!r} is loaded (loaded: {loaded})")
        text, ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            kept = truncated_prompt(ids, params.truncate_prompt_tokens, self.info.max_model_len)
            text, ids = (text, ids) if len(kept) == len(ids) else (None, kept)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidParameterError("cache_salt", "cache_salt must be a non-empty string")
        info = self.info
        if not ids:
            raise InvalidParameterError("prompt", "prompt must not be empty")
        if len(ids) >= info.max_model_len:  # before any per-token work: a huge list costs nothing more
            raise InvalidParameterError(
                "prompt",
                f"prompt has {len(ids)} tokens, but max_model_len is {info.max_model_len}: "
                "no room left to generate; shorten the prompt",
            )
        vocab = info.vocab_size
        ids = [_token_id(t) for t in ids]  # numpy or torch integers as ints
        bad = next((t for t in ids if type(t) is not int or not 0 <= t < vocab), None)
        if bad is not None:
            why = f"outside the vocabulary [0, {vocab})" if type(bad) is int else "not a token id (an integer)"
            raise InvalidParameterError("prompt", f"prompt_token_ids contains {bad!r}, {why}")
        room = info.max_model_len - len(ids)
        asked = asked_max_tokens if asked_max_tokens is not None else params.max_tokens
        if strict_context and asked is not None and asked > room:
            raise InvalidParameterError("max_tokens", context_length_message(info.max_model_len, len(ids), asked))
        if params.min_tokens > room:
            raise InvalidParameterError(
                "min_tokens", f"min_tokens ({params.min_tokens}) exceeds the {room} tokens left in the context"
            )
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidParameterError("stop_token_ids", f"stop_token_ids must be < vocabulary size {vocab}")
        if params.logit_bias and any(not 0 <= int(t) < vocab for t in params.logit_bias):
            raise InvalidParameterError("logit_bias", f"logit_bias keys must be token ids in [0, {vocab})")
        if params.allowed_token_ids is not None and any(t >= vocab for t in params.allowed_token_ids):
            raise InvalidParameterError("allowed_token_ids", f"allowed_token_ids must be token ids in [0, {vocab})")
        if params.bad_words and self.tokenizer is None:
            raise InvalidParameterError("bad_words", "bad_words need the model's tokenizer")
        check_logprobs(params, info.max_logprobs)
        if params.pooling is not None and (params.n != 1 or params.structured_outputs is not None
                                           or params.logprobs is not None):  # fmt: skip
            raise InvalidParameterError("pooling", "an embedding request takes n = 1, no grammar and no logprobs")
        if params.stop and self.tokenizer is None:
            raise InvalidParameterError("stop", "stop strings need a tokenizer; use stop_token_ids")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise InvalidParameterError("structured_outputs", "structured output needs the model's tokenizer")
            check_grammar(params.structured_outputs)  # cached: the server checked it already, off its loop
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        taken = [i for i in (request_id, *seq_ids) if i in in_use]
        if taken:
            raise InvalidParameterError(
                "request_id", f"request_id {request_id!r} is already in use ({taken[0]!r} is running)"
            )
        params = params.clone()
        if params.top_k >= vocab:
            params.top_k = 0  # keeps every token anyway; avoids huge ints on the device
        resolve_stop_token_ids(params, self.eos_token_ids)
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            if any(t >= vocab for word in params.bad_words_token_ids for t in word):  # a tokenizer's added tokens
                raise InvalidParameterError("bad_words", f"bad_words tokenize to ids past the vocabulary ({vocab})")
        if params.allowed_token_ids is not None:  # a step must have a token left to sample
            usable = set(params.allowed_token_ids) - {w[0] for w in params.bad_words_token_ids if len(w) == 1}
            if not usable:
                raise InvalidParameterError("allowed_token_ids", "bad_words forbid every allowed token")
            if params.min_tokens and usable <= params.all_stop_token_ids:
                raise InvalidParameterError("min_tokens", "every allowed token stops the request (EOS or a stop "
                                            "token), so min_tokens cannot be met")  # fmt: skip
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        # Stop strings are matched on text, in the process that detokenizes: the core never needs them.
        core_params = params.clone(stop=[]) if params.stop else params
        core_requests = []
        for i, sid in enumerate(seq_ids):
            child = core_params if params.seed is None or i == 0 else core_params.clone(seed=params.seed + i)
            child.all_stop_token_ids = params.all_stop_token_ids
            core_requests.append(EngineCoreRequest(sid, ids, child, max_tokens, priority, arrival, cache_salt,
                                                   lora_name=lora_name))  # fmt: skip
        return ProcessedRequest(request_id, text, ids, params, seq_ids, core_requests)
