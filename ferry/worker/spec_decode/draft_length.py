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

A step's cost by its rows comes from the engine's own steps (`StepCostModel`: a line fitted
through recent steps), so the policy follows the machine and the batch it is at. A draft model
(or early exit) adds its own cost per draft: one draft pass per position, shared by the requests
drafting, priced by a second line through the draft's passes. The policy then runs before the
draft model does, so drafts it would not verify are never drafted; where drafting costs about as
much as the tokens it could save (early exit through most of the target's layers, untrained for
it), no drafts pay and speculation stays off.

Early exit verifies its drafts through the target's last layers only, from where the draft left
off, so its verify steps cost a fraction of a whole step and a verify row a fraction of a whole
row. Those steps get a line of their own, and an early-exit draft's row is priced by its slope:
fitted into the whole steps' line, as they once were, they tilted it flat (more rows, yet cheaper
steps), and every draft's verify row then looked free. A step in which some requests ran from
their streams and others the whole model (two forwards, the common case in a batch whose requests
draft unevenly) is split by the line already known: what the whole steps' line says its whole rows
cost, the rest is its stream rows' (or the other way round); with neither line yet it counts as a
whole step, so the policy always has a line to decide by. Such a step pays the verify forward's
fixed cost on top of the whole one's, so a batch where only some requests would draft drafts only
if the step still gains with that cost counted.
"""

from __future__ import annotations

import heapq
import weakref

from ferry.core.request import Request

# Before a slope can be fitted: a row's cost as a share of the step's fixed part. Optimistic on
# purpose (on 2 CPU cores it is ~0.25), so that longer drafts get tried and measured.
PRIOR_ROW_COST = 0.1
# A step's weight in the fit decays by this per later step (~50 steps of memory).
STEP_DECAY = 0.98
# Steps whose rows spread less than this (weighted standard deviation) fit no slope.
MIN_ROW_SPREAD = 0.5

# Acceptance: a request's evidence at a position decays by this per verification that reaches it,
# and by IDLE_DECAY per step without drafts; the pooled evidence by POOLED_DECAY.
EVIDENCE_DECAY = 0.9
IDLE_DECAY = 0.9
POOLED_DECAY = 0.99
PRIOR_WEIGHT = 1.0  # trials' worth of the pooled chance in a request's estimate
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0  # the pooled chance is 1/2 before any evidence
# Every this many verifications of a request, all its drafts (see AdaptiveDraftLength).
EXPLORE_EVERY = 8


class StepCostModel:
    """Seconds a step takes by its rows, a + b * rows: a weighted least-squares line through the
    engine's recent steps (each step's weight decays by STEP_DECAY per later step, so the line
    follows the machine and the batch it is at). A row count's first step is left out: the first
    step of a shape is slow (buffers allocated, code and weights cold), and one cold 17-row step
    in the fit kept every later step at 3 rows. Until the steps span enough row counts to fit a
    slope, a row is taken to cost PRIOR_ROW_COST of the fixed part: optimistic, so that longer
    drafts get tried, which spreads the row counts. (A mean per row count, tried too, was at
    the mercy of a few noisy steps per count: one slow 5-row step priced it above 6 rows.)"""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._seen: set[int] = set()

    def observe(self, rows: int, seconds: float) -> None:
        """One step: its rows (tokens through the model) and its seconds."""
        if rows < 1 or not seconds > 0:
            return
        if rows not in self._seen:
            self._seen.add(rows)
            return
        d = STEP_DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None before any step counted. b is never negative (a step does not cost
        less for more rows; noise can tilt a fit that way), nor a."""
        if self._w == 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var >= MIN_ROW_SPREAD**2:
            b = max(0.0, (self._xy / self._w - mx * my) / var)
            if my - b * mx > 0:
                return my - b * mx, b
        a = my / (1.0 + PRIOR_ROW_COST * mx)  # no usable slope: the prior's split at the rows seen
        return a, PRIOR_ROW_COST * a

    def seconds(self, rows: int) -> float | None:
        """A step of `rows` rows, or None before any step counted."""
        ab = self.coefficients()
        return None if ab is None else ab[0] + ab[1] * rows


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

    def idle(self, request: Request | None) -> None:
        """A step in which the request had drafts to offer but got none: its evidence fades. With
        None: a step in which no request got any, though some had drafts: the pooled evidence
        fades (else, once it fell low enough that nobody drafts, nothing could ever raise it:
        every request starts from it, and none would be tried again)."""
        evidence = self._counts.get(request) if request is not None else self._pooled
        if evidence is not None:
            for counts in evidence:
                for j in range(self.k):
                    counts[j] *= IDLE_DECAY


def allocate(
    worth: list[list[float]],
    num_rows: int,
    line: tuple[float, float] | None,
    draft_seconds: float = 0.0,
    row_seconds: float | None = None,
) -> list[int]:
    """Drafts per request that raise the step's expected tokens per second, greedily (see the
    module's docstring). `worth[i]`: what request i's drafts 1..n each add in expected tokens
    (non-increasing; n its drafts on offer); `num_rows`: the step's rows before any draft (its
    requests' own tokens); `line`: a step's seconds, a + b * rows (`StepCostModel.coefficients`
    of the steps measured so far; None: every draft);
    `draft_seconds`: what drafting one more token costs (a draft model's share of a pass);
    `row_seconds`: what a draft's verify row costs, where not a whole row's (`line`'s slope).
    With worth non-increasing per request and a step's cost linear in its rows, adding the most
    valuable draft while it raises the throughput reaches the best allocation there is (the tests
    check it against brute force)."""
    counts = [0] * len(worth)
    if line is None:
        return [len(w) for w in worth]
    a, row = line
    # A draft's price: its verify row and its drafting.
    b = (row if row_seconds is None else row_seconds) + draft_seconds
    seconds = a + row * num_rows
    expected = float(len(worth))  # each request gains its own token at least
    heap = [(-w[0], i) for i, w in enumerate(worth) if w and w[0] > 0]
    heapq.heapify(heap)
    while heap:
        gain = -heap[0][0]
        if gain * seconds <= b * expected:
            break  # the best remaining draft would lower the step's tokens per second
        _, i = heapq.heappop(heap)
        counts[i] += 1
        expected += gain
        seconds += b
        if counts[i] < len(worth[i]):
            heapq.heappush(heap, (-worth[i][counts[i]], i))
    return counts


class AdaptiveDraftLength:
    """The policy the proposer applies each step: its evidence (acceptance per request and
    position, step cost per row count) and `choose`, which cuts each request's drafts to the
    allocation. Every `EXPLORE_EVERY`-th time a request verifies drafts it verifies all it has:
    the positions past its usual allocation and the longer steps' cost are then measured rather
    than left at what the prior or a stale step said (without it a copying request stayed at 5 of
    8 drafts, its positions 6-8 priced from the pooled prior, never tried)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.acceptance = AcceptanceTracker(num_speculative_tokens)
        self.step_cost = StepCostModel()
        self.stream_step_cost = StepCostModel()  # early exit's verify steps, every row from a stream
        self.draft_pass_cost = StepCostModel()  # a draft model's passes, by the requests in them
        self._verifications: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()

    def choose(self, requests: list[Request], offered: list[int]) -> list[int]:
        """How many of the `offered[i]` drafts request i has (or could have drafted) to verify
        in the next step."""
        worth = [self.acceptance.worth(r, n) for r, n in zip(requests, offered)]
        drafting = sum(1 for n in offered if n)
        pass_seconds = self.draft_pass_cost.seconds(drafting) if drafting else None
        per_draft = pass_seconds / drafting if pass_seconds is not None else 0.0  # a pass serves them all
        whole, row = self.step_cost.coefficients(), None
        stream = self.stream_step_cost.coefficients()  # None unless early exit verified from streams
        if stream is not None:
            row = stream[1]
            passes = self.draft_pass_cost.coefficients()
            if whole is None and passes is not None:
                # Every step so far drafted, so none ran the whole model: such a step does what a
                # verify step of the same rows and a pass of the first layers for each do.
                whole = (stream[0] + passes[0], stream[1] + passes[1])
        counts = allocate(worth, len(requests), whole, per_draft, row)
        if stream is not None and whole is not None and any(counts) and not all(counts):
            # Early exit with some requests drafting and others not runs two forwards: the verify
            # forward's fixed cost comes on top of the whole one's, which `allocate` (a line per
            # row) does not charge. Draft only if the step still gains with it.
            tokens = len(requests) + sum(sum(w[:k]) for w, k in zip(worth, counts))
            plain = whole[0] + whole[1] * len(requests)
            seconds = plain + stream[0] + sum(counts) * (row + per_draft)
            if tokens / seconds <= len(requests) / plain:
                counts = [0] * len(counts)
        for i, (request, n) in enumerate(zip(requests, offered)):
            if counts[i]:
                seen = self._verifications.get(request, 0) + 1
                self._verifications[request] = seen
                if seen % EXPLORE_EVERY == 0:
                    counts[i] = n
            elif n:
                self.acceptance.idle(request)
        if not any(counts) and any(offered):
            self.acceptance.idle(None)
        return counts

    def observe_draft_pass(self, num_requests: int, seconds: float) -> None:
        """A draft model's pass drafted one token for each of `num_requests` requests in `seconds`."""
        self.draft_pass_cost.observe(num_requests, seconds)

    def observe_verification(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        self.acceptance.observe(request, num_drafts, num_accepted)

    def observe_step(self, num_rows: int, seconds: float, num_stream_rows: int = 0) -> None:
        """A decode-only step: `num_rows` rows in `seconds`, `num_stream_rows` of them verified from
        early exit's streams (the module's docstring says which line each kind of step goes in)."""
        whole_rows = num_rows - num_stream_rows
        if num_stream_rows == 0:
            self.step_cost.observe(num_rows, seconds)
        elif whole_rows == 0:
            self.stream_step_cost.observe(num_rows, seconds)
        else:  # two forwards: one half priced by its line, the rest is the other half's
            whole = self.step_cost.seconds(whole_rows)
            stream = self.stream_step_cost.seconds(num_stream_rows)
            if whole is not None and whole < seconds:
                self.stream_step_cost.observe(num_stream_rows, seconds - whole)
            elif stream is not None and stream < seconds:
                self.step_cost.observe(whole_rows, seconds - stream)
            else:
                self.step_cost.observe(num_rows, seconds)
