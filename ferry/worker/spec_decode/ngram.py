"""Prompt-lookup (n-gram) drafts: the model is often about to repeat something already in its
context (an edited passage, code it was shown, a name), so the tokens that followed the latest
earlier occurrence of the sequence's last n tokens are a cheap guess at what comes next.

Per request an index maps every `prompt_lookup_min`-gram to the positions that followed it,
extended as tokens arrive (a dict update per token, not a scan of the context per step). A
lookup walks the latest candidates first, measures how far back each one matches (up to
`prompt_lookup_max` tokens) and takes the longest match; among equals, the one with the most
tokens after it (up to the drafts wanted: a match near the end has few), then the latest.
Candidates per lookup are capped, so a context of one token repeated costs no more than any other.
"""

from __future__ import annotations

import weakref

from ferry.core.request import Request

# Latest occurrences of the min-gram tried per lookup: bounds a step's work on repetitive input.
MAX_CANDIDATES = 32


class _NgramIndex:
    """A request's min-gram -> the positions right after each of its occurrences, oldest first."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.covered = 0  # tokens indexed so far
        self.follows: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that now have a following token (each ends before the last token)."""
        n = self.n
        for end in range(max(self.covered, n), len(tokens)):
            self.follows.setdefault(tuple(tokens[end - n : end]), []).append(end)
        self.covered = max(self.covered, len(tokens))


class NgramProposer:
    """`propose` drafts for decoding requests from their own prompt and output."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        # Dropped with the request: nothing to clean up when it finishes or is aborted.
        self._indexes: weakref.WeakKeyDictionary[Request, _NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the longest match of the context's suffix."""
        tokens = request.all_token_ids
        L = len(tokens)
        if max_tokens < 1 or L <= self.min_n:
            return []
        index = self._indexes.get(request)
        if index is None:
            index = self._indexes[request] = _NgramIndex(self.min_n)
        index.extend(tokens)
        candidates = index.follows.get(tuple(tokens[L - self.min_n :]))
        if not candidates:
            return []
        best, best_follow = (0, 0), -1
        for follow in reversed(candidates[-MAX_CANDIDATES:]):
            # follow - min_n .. follow - 1 equals the last min_n tokens; extend the match backwards.
            length = self.min_n
            while (
                length < self.max_n
                and follow - length - 1 >= 0
                and tokens[follow - length - 1] == tokens[L - length - 1]
            ):
                length += 1
            score = (length, min(L - follow, max_tokens))
            if score > best:
                best, best_follow = score, follow
                if score == (self.max_n, max_tokens):
                    break
        return tokens[best_follow : best_follow + max_tokens]
