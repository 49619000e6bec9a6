"""How many drafts each request verifies in a step: as many as pay for themselves.

A draft token costs a row of the verify step whether it is accepted or not, and it pays only when
every draft before it is accepted too. So the j-th draft of a request is worth the chance that
drafts 1..j are all accepted, in expected tokens, and it costs the step `b` seconds (its row) on
top of `a + b * rows`. Adding a draft raises the step's throughput (expected tokens
over seconds, E / T) exactly when its worth g satisfies g * T > b * E. `allocate` adds drafts,
most valuable first, while that holds:

- at batch 1 on a GPU (b ~ 0) every draft with any chance pays, up to `num_speculative_tokens`;
- on a CPU, where a row costs a sizeable share of a step, only drafts likely to be kept;
- in a large batch (b * rows >> a, so b * E / T nears 1) almost none: speculation switches itself
  off where it would cost throughput, per step, with no batch-size threshold to tune;
- a request whose drafts keep failing gets none, until its estimate drifts back (below).

The chances are tracked per request and draft position (`AcceptanceTracker`): decayed counts of
accepted and rejected drafts, over the same counts pooled across requests. A request that copies
its prompt keeps high chances; one writing new text low ones; the decay follows a request from one
to the other. Positions are counted apart because acceptance is not independent from one draft to
the next: a copied run is usually kept whole, so draft 8's chance given drafts 1-7 is far above
draft 1's (a single per-request rate, tried first, priced the 8th draft of a copying request at
0.9^8 = 0.43 where whole runs of 8 were kept most of the time, and kept runs short). While a
request gets no drafts its evidence fades back toward the pooled prior, so it is tried again now
and then (a request never tried again could not notice that it started copying).

A step's cost by its rows comes from the engine's own steps (`StepCostModel`: a running mean per
row count), so the policy follows the machine and the batch it is at; `b` is then the measured
cost of the step's next row.
"""

from __future__ import annotations

import bisect
import heapq
import weakref

from ferry.core.request import Request

# Past the row counts measured: a further row's cost as a share of one row's at the smallest count
# measured. Optimistic on purpose (on 2 CPU cores it is ~0.3 at a 1-row step), so that untried
# draft lengths get tried and measured rather than assumed too dear.
PRIOR_ROW_COST = 0.1
# A new step's weight in its row count's running mean.
STEP_WEIGHT = 0.2

# Acceptance: a request's evidence at a position decays by this per verification that reaches it,
# and by IDLE_DECAY per step without drafts; the pooled evidence by POOLED_DECAY.
EVIDENCE_DECAY = 0.9
IDLE_DECAY = 0.9
POOLED_DECAY = 0.99
PRIOR_WEIGHT = 1.0  # trials' worth of the pooled chance in a request's estimate
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0  # the pooled chance is 1/2 before any evidence


class StepCostModel:
    """Seconds a step takes by the rows it runs, from the engine's own steps: a running mean per
    row count measured; an unmeasured count is assumed cheap (`seconds`), so that the policy tries
    longer drafts and measures them. (A line fitted through all steps was tried first: one early
    17-row step set a slope that kept every later step at 3 rows, never measured otherwise. The
    cost is not a line anyway: the CPU step grows slowly to 4 rows, the int8-dot kernels'
    pass width, then faster; a GPU's is flat until its compute saturates.)"""

    def __init__(self) -> None:
        self._mean: dict[int, float] = {}
        self._rows: list[int] = []  # the counts seen, sorted

    def observe(self, rows: int, seconds: float) -> None:
        """One step: its rows (tokens through the model) and its seconds."""
        if rows < 1 or not seconds > 0:
            return
        if rows in self._mean:
            self._mean[rows] += STEP_WEIGHT * (seconds - self._mean[rows])
        else:
            self._mean[rows] = seconds
            bisect.insort(self._rows, rows)

    def seconds(self, rows: int) -> float | None:
        """A step of `rows` rows, or None before any step. A count not measured yet is taken at
        the lower of: linear between the counts measured around it, and the optimistic prior past
        the one below it. So it looks cheap until measured, and is tried and measured (a single
        slow measurement far above, such as a cold first step, cannot keep the counts between
        unmeasured and unused)."""
        seen = self._rows
        if not seen:
            return None
        if rows in self._mean:
            return self._mean[rows]
        slope = PRIOR_ROW_COST * self._mean[seen[0]] / seen[0]
        i = bisect.bisect_left(seen, rows)
        if i == 0:
            return max(self._mean[seen[0]] - slope * (seen[0] - rows), 0.0)
        lo = seen[i - 1]
        guess = self._mean[lo] + slope * (rows - lo)
        if i < len(seen):
            hi = seen[i]
            t_lo, t_hi = self._mean[lo], self._mean[hi]
            guess = min(guess, t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo))
        return guess


class AcceptanceTracker:
    """Per request and draft position j: the chance that draft j is accepted given that drafts
    1..j-1 were. Positions differ (a request copying its prompt keeps a whole run or none of it, so
    the later positions' chances are higher than the first's), so each is counted apart: decayed
    counts per request, over a prior of the same counts pooled across all requests (itself over
    1 in 2)."""

    def __init__(self, num_positions: int) -> None:
        self.k = num_positions
        # Dropped with the request: nothing to clean up when it finishes or is aborted.
        self._counts: weakref.WeakKeyDictionary[Request, list[list[float]]] = weakref.WeakKeyDictionary()
        self._pooled = [[0.0] * num_positions, [0.0] * num_positions]  # accepted, trials per position

    def chances(self, request: Request, n: int) -> list[float]:
        """Per position 1..n, the conditional chance of acceptance."""
        pa, pt = self._pooled
        mine = self._counts.get(request)
        out = []
        for j in range(min(n, self.k)):
            prior = (pa[j] + PRIOR_ACCEPTED) / (pt[j] + PRIOR_TRIALS)
            accepted, trials = (mine[0][j], mine[1][j]) if mine is not None else (0.0, 0.0)
            out.append((accepted + PRIOR_WEIGHT * prior) / (trials + PRIOR_WEIGHT))
        return out

    def worth(self, request: Request, n: int) -> list[float]:
        """Expected tokens the request's drafts 1..n each add: the chance that it and every draft
        before it are accepted (non-increasing)."""
        out, p = [], 1.0
        for chance in self.chances(request, n):
            p *= chance
            out.append(p)
        return out

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verification: the first `num_accepted` of `num_drafts` drafts were kept. Positions
        1..num_accepted succeeded, the next one (if any) failed; later ones were not tried."""
        mine = self._counts.get(request)
        if mine is None:
            mine = self._counts[request] = [[0.0] * self.k, [0.0] * self.k]
        tried = min(num_drafts, num_accepted + 1, self.k)
        for counts, decay in ((mine, EVIDENCE_DECAY), (self._pooled, POOLED_DECAY)):
            for j in range(tried):
                counts[0][j] = decay * counts[0][j] + (j < num_accepted)
                counts[1][j] = decay * counts[1][j] + 1.0

    def idle(self, request: Request) -> None:
        """A step in which the request had drafts to offer but got none: its evidence fades."""
        mine = self._counts.get(request)
        if mine is not None:
            for counts in mine:
                for j in range(self.k):
                    counts[j] *= IDLE_DECAY


def allocate(worth: list[list[float]], num_rows: int, cost: StepCostModel | None) -> list[int]:
    """Drafts per request that raise the step's expected tokens per second, greedily (see the
    module's docstring). `worth[i]`: what request i's drafts 1..n each add in expected tokens
    (non-increasing; n its drafts on offer); `num_rows`: the step's rows before any draft (its
    requests' own tokens); `cost`: the steps measured so far (None or empty: every draft).
    With worth non-increasing per request and a step's cost linear in its rows, adding the most
    valuable draft while it raises the throughput reaches the best allocation there is (the tests
    check it against brute force); with a measured cost that is not linear, each draft is weighed
    against the next row's measured cost."""
    counts = [0] * len(worth)
    seconds = cost.seconds(num_rows) if cost is not None else None
    if seconds is None:
        return [len(w) for w in worth]
    rows = num_rows
    expected = float(len(worth))  # each request gains its own token at least
    heap = [(-w[0], i) for i, w in enumerate(worth) if w and w[0] > 0]
    heapq.heapify(heap)
    while heap:
        gain = -heap[0][0]
        more = cost.seconds(rows + 1)
        if gain * seconds <= (more - seconds) * expected:
            break  # the best remaining draft would lower the step's tokens per second
        _, i = heapq.heappop(heap)
        counts[i] += 1
        expected += gain
        seconds, rows = more, rows + 1
        if counts[i] < len(worth[i]):
            heapq.heappush(heap, (-worth[i][counts[i]], i))
    return counts
