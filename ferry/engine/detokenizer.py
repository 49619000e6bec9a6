"""Incremental detokenization and stop strings for one sequence.

Decoding a short window of recent tokens, not the whole output, keeps each
step O(1); a delta ending in U+FFFD (half of a multi-byte character) is held
back until the next token completes it. Stop strings are searched in the
accumulated text, so they match across token boundaries; while streaming,
the last `max(len(stop)) - 1` characters are held back so a half-seen stop
string is never sent. As in vLLM, a stop string counts only once `min_tokens`
tokens are out, and must end in the text after theirs.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.ids = list(prompt_token_ids[-6:])  # context so the first token decodes with its leading space
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.text = ""
        self.sent = 0  # characters of `text` already reported as deltas
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.stop_floor = 0  # stop strings must end past this much text (the first min_tokens tokens')

    def add_token(self, token_id: int) -> str | None:
        """Append a token; returns the stop string if one now ends the text."""
        if self.tokenizer is None:
            return None
        self.num_tokens += 1
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(
            self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special
        )
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            start = len(self.text)
            self.text += new
            if self.num_tokens <= self.min_tokens:
                self.stop_floor = len(self.text)
                return None
            return self._check_stop(max(start, self.stop_floor))
        return None

    def _check_stop(self, new_start: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            # Only a match that ends in the new characters is new.
            idx = self.text.find(s, max(new_start - len(s) + 1, 0))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)  # the earliest match in the text wins, whatever the list order
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        return s

    def delta(self, finished: bool) -> str:
        """Text not yet reported, holding back a possible stop-string prefix."""
        end = len(self.text) if finished else max(len(self.text) - self.hold, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def flush_text(self, finished: bool) -> str:
        """All text that may be shown now (cumulative)."""
        return self.text if finished else self.text[: max(len(self.text) - self.hold, 0)]
