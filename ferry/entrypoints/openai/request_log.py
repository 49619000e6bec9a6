"""vLLM's request log: `--enable-log-requests` logs each request's prompt and sampling parameters
as it is added, `--enable-log-outputs` each finished choice's text and token ids, both cut to
`--max-log-len` characters (text) or ids. Off by default, as in vLLM: prompts and answers are the
users' data, and a log is read by more people than the API is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("ferry.requests")


def _cut(value: Sequence | None, max_len: int | None) -> Any:
    if value is None or max_len is None or len(value) <= max_len:
        return value
    return value[:max_len]


class RequestLogger:
    """Made when either log is asked for (`from_flags`); each logs what its flag names."""

    @staticmethod
    def from_flags(args) -> RequestLogger | None:
        if not (args.enable_log_requests or args.enable_log_outputs):
            return None
        return RequestLogger(args.enable_log_requests, args.enable_log_outputs, args.max_log_len)

    def __init__(self, log_inputs: bool = True, log_outputs: bool = False, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len
        self.logs_inputs = log_inputs
        self.logs_outputs = log_outputs

    def log_inputs(self, request_id: str, prompt: Any, params: Any, num_prompt_tokens: int) -> None:
        """`prompt`: the text, the token ids a client sent instead, or both ({"prompt", "prompt_token_ids"})."""
        if not self.logs_inputs:
            return
        if isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        else:
            text, ids = None, list(prompt)
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, num_prompt_tokens: %d.",
                    request_id, _cut(text, self.max_log_len), params, _cut(ids, self.max_log_len),
                    num_prompt_tokens)  # fmt: skip

    def log_output(self, request_id: str, index: int, text: str, token_ids: list[int], finish_reason: str | None):
        logger.info("Generated response %s (choice %d): output: %r, output_token_ids: %s, finish_reason: %s",
                    request_id, index, _cut(text, self.max_log_len), _cut(token_ids, self.max_log_len),
                    finish_reason)  # fmt: skip

    def collector(self, params) -> OutputCollector | None:
        """What logs a request's choices as they finish (None without --enable-log-outputs)."""
        if not self.logs_outputs:
            return None
        from ferry.sampling_params import RequestOutputKind

        return OutputCollector(self, cumulative=params.output_kind != RequestOutputKind.DELTA)


class OutputCollector:
    """A request's choices as they stream (deltas or whole), logged once each finishes."""

    def __init__(self, log: RequestLogger, cumulative: bool) -> None:
        self.log = log
        self.cumulative = cumulative  # the outputs carry everything so far (else deltas)
        self._text: dict[tuple[str, int], str] = {}
        self._ids: dict[tuple[str, int], list[int]] = {}
        self._logged: set[tuple[str, int]] = set()  # a finished choice reappears in later cumulative outputs

    def add(self, out) -> None:
        for c in out.outputs:
            key = (out.request_id, c.index)
            if key in self._logged:
                continue
            if self.cumulative:
                self._text[key], self._ids[key] = c.text, list(c.token_ids)
            else:
                self._text[key] = self._text.get(key, "") + c.text
                self._ids.setdefault(key, []).extend(c.token_ids)
            if c.finish_reason is not None:
                self._logged.add(key)
                self.log.log_output(out.request_id, c.index, self._text.pop(key), self._ids.pop(key), c.finish_reason)
