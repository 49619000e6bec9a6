"""Token rate limits per API key: prompt, completion and total tokens per minute.

A sliding window of 60 s per key. A request is admitted on its estimate
(prompt tokens + its max_tokens) if the window's charges plus the estimate
stay within every limit of its key; the estimate is charged at once, so
concurrent requests cannot all slip under the same limit. When the response
ends, the charge is replaced by the tokens the response actually used (its
`usage`), so an early stop frees the rest of the estimate. A refused request
gets the seconds until enough of the window has expired (Retry-After).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ferry.gateway.auth import KeyLimits

WINDOW_S = 60.0


@dataclass
class Charge:
    at: float
    prompt: int
    completion: int


class TokenRateLimiter:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._windows: dict[str, deque[Charge]] = {}

    def _window(self, key: str, now: float) -> deque[Charge]:
        w = self._windows.setdefault(key, deque())
        while w and w[0].at <= now - WINDOW_S:
            w.popleft()
        return w

    def usage(self, key: str) -> tuple[int, int]:
        """(prompt, completion) tokens charged to `key` in the last minute."""
        w = self._window(key, self.clock())
        return sum(c.prompt for c in w), sum(c.completion for c in w)

    def admit(
        self, key: str, limits: KeyLimits, prompt: int, completion: int
    ) -> tuple[Charge | None, float | None, str]:
        """(the charge, 0, "") if admitted; else (None, seconds to wait, why), with wait None when
        the request alone is over a limit (waiting would never help)."""
        now = self.clock()
        w = self._window(key, now)
        checks = [
            ("prompt", limits.prompt_tokens_per_minute, lambda c: c.prompt, prompt),
            ("completion", limits.completion_tokens_per_minute, lambda c: c.completion, completion),
            ("total", limits.total_tokens_per_minute, lambda c: c.prompt + c.completion, prompt + completion),
        ]
        wait = 0.0
        why = ""
        for kind, limit, amount, want in checks:
            if limit is None:
                continue
            if want > limit:
                return (
                    None,
                    None,
                    f"this request needs {want} {kind} tokens, more than the key's {limit} per minute",
                )
            used = sum(amount(c) for c in w)
            if used + want > limit:
                # The earliest time enough old charges have left the window.
                need, t = used + want - limit, now
                for c in w:
                    need -= amount(c)
                    t = c.at + WINDOW_S
                    if need <= 0:
                        break
                if t - now > wait:
                    wait, why = t - now, f"{kind} tokens per minute limit {limit} reached"
        if why:
            return None, max(wait, 0.001), why
        charge = Charge(now, prompt, completion)
        w.append(charge)
        return charge, 0.0, ""

    @staticmethod
    def reconcile(charge: Charge, prompt: int | None, completion: int | None) -> None:
        """Replace the estimate by what the response used (None: keep that part of the estimate)."""
        if prompt is not None:
            charge.prompt = prompt
        if completion is not None:
            charge.completion = completion
