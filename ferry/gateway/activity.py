"""What the gateway's dashboard shows beside the workers' state: recent decisions and latency over time.

Prometheus (metrics.py) keeps counters and histograms for scraping; a page
that has no Prometheus beside it needs the recent events themselves and a
short history, so this keeps, in bounded memory:

- the last `keep` routing decisions (model, worker, reason, cached overlap)
  and the last `keep` prefill/decode decisions (where the prompt was
  prefilled, on which prefill and decode worker, how long the prefill hop
  with its KV transfer took);
- per time slot of `slot_seconds`, for the last `slots` slots: requests
  settled, output tokens, and the sums behind mean TTFT and TPOT.

No prompt, completion or API key is kept: the dashboard is read with the
admin key, but it has no need to see what tenants asked.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass
class _Slot:
    start: float  # wall-clock seconds (the page plots against its own clock)
    requests: int = 0
    output_tokens: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    tpot_sum: float = 0.0
    tpot_count: int = 0


class Activity:
    def __init__(self, keep: int = 50, slots: int = 150, slot_seconds: float = 2.0) -> None:
        self.routing: deque[dict] = deque(maxlen=keep)
        self.pd: deque[dict] = deque(maxlen=keep)
        self.slot_seconds = slot_seconds
        self._slots: deque[_Slot] = deque(maxlen=slots)

    def routed(self, model: str, worker: str, reason: str, overlap: float) -> None:
        self.routing.append({"time": time.time(), "model": model, "worker": worker, "reason": reason,
                             "overlap": overlap if overlap >= 0 else None})  # fmt: skip

    def pd_decided(self, model: str, decision: str, decode: str, prefill: str | None,
                   prefill_seconds: float | None) -> None:  # fmt: skip
        self.pd.append({"time": time.time(), "model": model, "decision": decision, "decode": decode,
                        "prefill": prefill, "prefill_seconds": prefill_seconds})  # fmt: skip

    def settled(self, output_tokens: int | None, ttft: float | None, tpot: float | None,
                now: float | None = None) -> None:  # fmt: skip
        """One response passed through whole or in part, with what it measured (at `now`, wall-clock
        seconds; default: this moment)."""
        s = self._slot(time.time() if now is None else now)
        s.requests += 1
        s.output_tokens += output_tokens or 0
        if ttft is not None:
            s.ttft_sum += ttft
            s.ttft_count += 1
        if tpot is not None:
            s.tpot_sum += tpot
            s.tpot_count += 1

    def _slot(self, now: float) -> _Slot:
        start = now - now % self.slot_seconds
        if not self._slots or self._slots[-1].start < start:
            self._slots.append(_Slot(start))
        return self._slots[-1]

    def series(self) -> list[dict]:
        """The slots with something in them, oldest first: mean TTFT/TPOT (None where nothing
        measured them), requests and output tokens per second."""
        return [
            {"time": s.start, "requests_per_s": s.requests / self.slot_seconds,
             "output_tokens_per_s": s.output_tokens / self.slot_seconds,
             "ttft": s.ttft_sum / s.ttft_count if s.ttft_count else None,
             "tpot": s.tpot_sum / s.tpot_count if s.tpot_count else None}
            for s in self._slots
        ]  # fmt: skip
