"""The scheduler's waiting queue: a heap by (priority, arrival), cache-aware within a small window.

Every operation the scheduler does per request costs O(log n) in the number
waiting: a push, a removal (lazy: the entry is skipped when it surfaces) and the
choice of the next request to admit. That choice looks at the `window` best
requests of the best priority present and takes the one with the longest
cached prompt prefix (FCFS among equals), so requests that can reuse blocks
go first (SGLang's longest-prefix-match policy) without the queue being
re-sorted, and the cache probed, for every waiting request on every step; a
queue of 2,000 costs what a queue of `window` does.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from ferry.core.request import Request

WINDOW = 16


class WaitingQueue:
    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: dict[str, int] = {}  # request id -> the sequence number of its live entry
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._live

    def __iter__(self) -> Iterator[Request]:
        """Live requests in (priority, arrival) order; O(n log n), for inspection and tests."""
        return iter([e[3] for e in sorted(self._heap) if self._live.get(e[3].request_id) == e[2]])

    def push(self, request: Request) -> None:
        seq = next(self._seq)
        self._live[request.request_id] = seq
        heapq.heappush(self._heap, (request.priority, request.arrival_time, seq, request))

    def remove(self, request: Request) -> None:
        """Forget a request (aborted while waiting); its heap entry is dropped when it surfaces."""
        self._live.pop(request.request_id, None)
        self._compact()

    def take_next(self, cached_tokens: Callable[[Request], int] | None = None) -> Request | None:
        """Remove and return the request to admit next: among up to `window` earliest arrivals of
        the best priority waiting, the one with the most cached prefix tokens (`cached_tokens`; no
        function: the earliest). Give it back with `push` if it cannot be admitted after all."""
        candidates: list[tuple[int, float, int, Request]] = []
        while self._heap and len(candidates) < (self.window if cached_tokens else 1):
            entry = heapq.heappop(self._heap)
            if self._live.get(entry[3].request_id) != entry[2]:
                continue  # removed
            if candidates and entry[0] != candidates[0][0]:
                heapq.heappush(self._heap, entry)
                break
            candidates.append(entry)
        if not candidates:
            return None
        best = 0
        if cached_tokens is not None and len(candidates) > 1:
            hits = [cached_tokens(e[3]) for e in candidates]
            best = max(range(len(candidates)), key=lambda i: (hits[i], -i))
        for i, entry in enumerate(candidates):
            if i != best:
                heapq.heappush(self._heap, entry)
        request = candidates[best][3]
        del self._live[request.request_id]
        return request

    def _compact(self) -> None:
        """Rebuild once dead entries are most of the heap, so its size stays O(live)."""
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._live):
            self._heap = [e for e in self._heap if self._live.get(e[3].request_id) == e[2]]
            heapq.heapify(self._heap)
