"""A request's prompt as the token ids the replica will see, for routing and rate limits.

The kv-aware and prefix policies hash the prompt's blocks exactly as the
replica will, and a token rate limit charges an estimate of the prompt's
tokens before it runs, so the gateway tokenizes as the server does: the
worker's own tokenizer (`/ferry/info` names it; `--tokenizer` overrides) and,
for chat, the same `render_chat_prompt` with the worker's `--chat-template`
if it has one. Tokenizers are loaded on first use and kept. A body this
cannot turn into ids (no tokenizer, a malformed body) gives None: the request
is then routed by load and the replica says what is wrong with it.
"""

from __future__ import annotations

import logging

from ferry.entrypoints.openai.protocol import MAX_BODY_BYTES, PromptLimits
from ferry.gateway.replicas import Worker
from ferry.sampling_params import truncated_prompt

logger = logging.getLogger(__name__)


def prompts_of(data: dict) -> object:
    """A body's prompt or prompts: /v1/completions' `prompt`, /v1/embeddings' `input` (None for chat)."""
    return data.get("prompt", data.get("input"))


class PromptTokenizer:
    def __init__(self, tokenizer: str | None = None, trust_remote_code: bool = False) -> None:
        self.tokenizer = tokenizer  # default: what each worker's /ferry/info names
        self.trust_remote_code = trust_remote_code  # a tokenizer that is its own code loads (the workers' flag)
        self._tokenizers: dict[str, object] = {}
        self._limits: dict[tuple[str, int], PromptLimits] = {}

    def prompt_limits(self, worker: Worker) -> PromptLimits | None:
        """The longest prompt `worker` can take, as its server bounds it before validation
        (protocol.precheck_body), for the same early refusal here; None before its /ferry/info is
        known. Text is bounded only once its tokenizer is loaded (never loaded here: this runs on
        the event loop), else by the body cap alone."""
        info = worker.info or {}
        max_model_len = info.get("max_model_len")
        if not isinstance(max_model_len, int) or max_model_len < 2:
            return None
        source = self.tokenizer or info.get("tokenizer") or ""
        tok = self._tokenizers.get(source)
        if tok is None:
            return PromptLimits(max_model_len - 1, MAX_BODY_BYTES)
        key = (source, max_model_len)
        if key not in self._limits:
            self._limits[key] = PromptLimits.of(max_model_len, tok)
        return self._limits[key]

    def _tokenizer(self, worker: Worker):
        source = self.tokenizer or (worker.info or {}).get("tokenizer")
        if not source:
            return None
        if source not in self._tokenizers:
            from ferry.tokenizer import load_tokenizer

            try:
                tok = load_tokenizer(source, self.trust_remote_code)
            except Exception as e:  # not on this host, or its own code without --trust-remote-code
                logger.warning("cannot load the tokenizer %s (%s): its workers' requests are routed by load, and "
                               "token limits charge an estimate", source, e)  # fmt: skip
                tok = None
            self._tokenizers[source] = tok  # once: a failure is not retried on every request
        return self._tokenizers[source]

    def token_ids(self, kind: str, data: dict, worker: Worker) -> list[int] | None:
        """The token ids the replica will see for this body (its first prompt, cut to the last
        `truncate_prompt_tokens` as the replica will), or None when they cannot be known here (the
        replica then reports whatever is wrong)."""
        ids = self._prompt_token_ids(kind, data, worker)
        k = data.get("truncate_prompt_tokens")
        max_model_len = (worker.info or {}).get("max_model_len")
        if ids is None or type(k) is not int or not (k >= 1 or k == -1) or type(max_model_len) is not int:
            return ids
        return truncated_prompt(ids, k, max_model_len)

    def _prompt_token_ids(self, kind: str, data: dict, worker: Worker) -> list[int] | None:
        if kind in ("score", "rerank"):  # several texts, each its own prompt: routed by load
            return None
        try:
            if kind in ("completions", "embeddings"):
                prompt = prompts_of(data)
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                    prompt = prompt[0]  # several prompts (inputs) go to one worker; route by the first
                if isinstance(prompt, list):
                    ok = all(type(t) is int and 0 <= t < 2**32 for t in prompt)
                    return prompt if ok else None  # out-of-range ids: the replica's 400 says why
                tok = self._tokenizer(worker)
                return tok.encode(prompt) if isinstance(prompt, str) and tok is not None else None
            from ferry.entrypoints.openai.chat_prompt import render_chat_prompt
            from ferry.entrypoints.openai.protocol import ChatCompletionRequest

            tok = self._tokenizer(worker)
            if tok is None:
                return None
            if kind == "responses":
                from ferry.entrypoints.openai.responses_protocol import ResponsesRequest

                body = ResponsesRequest.model_validate(data).to_chat()  # the chat it runs as, rendered as one
            else:
                body = ChatCompletionRequest.model_validate(data)
            # The worker's --chat-template, when it shows it (a keyed worker shows only a digest:
            # its chats are then hashed with the tokenizer's template, and match no cached block).
            return render_chat_prompt(tok, body, (worker.info or {}).get("chat_template"))["prompt_token_ids"]
        except Exception:  # a body the replica will reject: route it by load, let the replica say why
            return None

    def num_prompt_tokens(self, prompts: list, worker: Worker) -> int | None:
        """Prompt tokens over every prompt of a multi-prompt completion (strings or token-id lists),
        or None when they cannot be known here."""
        tok = self._tokenizer(worker)
        total = 0
        for p in prompts:
            if isinstance(p, list):
                total += len(p)
            elif isinstance(p, str) and tok is not None:
                total += len(tok.encode(p))
            else:
                return None
        return total
