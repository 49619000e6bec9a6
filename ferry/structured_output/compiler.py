"""Compile grammars for the engine core, off its loop, and keep each request's matcher.

`GrammarCompiler.submit` hands a grammar to one background thread (llguidance drops the GIL while
it builds the lexer and parser, 1 ms for a typical schema, up to its limits for a huge one), so
the core keeps stepping the batch while a new request's grammar compiles. Compiled grammars are
cached by their text (LRU): a request with a schema seen before gets a copy of the compiled
matcher at once (`deep_copy` shares the compiled grammar; microseconds).

A request's `GrammarState` follows its output tokens: `accept` each kept token; nothing else moves
it. Preemption keeps a request's tokens, so its state stays valid; drafts (speculative decoding)
are consumed only while their rows' masks are filled and rolled back at once (bitmask.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance

from ferry.sampling_params import StructuredOutputsParams
from ferry.structured_output.grammar import grammar_of

logger = logging.getLogger(__name__)


class GrammarState:
    """One request's position in its grammar.

    With `after` (token ids; a reasoning model's `</think>`), the grammar is closed until the output
    has produced them: tokens before are free and only watched for the marker, and the matcher
    starts at the token after it."""

    __slots__ = ("matcher", "after", "source", "open", "_before", "_matched")

    def __init__(self, matcher: llguidance.LLMatcher, after: list[int] | None = None, source: str = "") -> None:
        self.matcher = matcher
        self.source = source  # the grammar's text (GrammarCompiler's cache key)
        self.after = list(after) if after else None
        self.open = self.after is None
        self._before: list[int] = []  # the output's tokens while closed (only their tail is needed)
        self._matched = 0  # tokens the matcher consumed (for `restore`)

    def accept(self, token: int) -> bool:
        """Advance over a kept token; False if the grammar forbids it (the matcher is then in error)."""
        if not self.open:
            self._watch(token)
            return True
        if not self.matcher.consume_token(token):
            return False
        self._matched += 1
        return True

    def _watch(self, token: int) -> None:
        before, after = self._before, self.after
        before.append(token)
        if len(before) >= len(after) and before[-len(after) :] == after:
            self.open = True
        elif len(before) > 4 * len(after) + 64:  # keep the tail only: a long reasoning is no memory cost
            del before[: len(before) - len(after)]

    def mark(self) -> tuple[bool, list[int] | None, int]:
        """Where the state is now, for `restore` after trying drafts: while closed, the output's last
        len(after) - 1 tokens (all a marker still to come can use; drafts watched may trim the
        tail down to theirs, so a length to cut back to would not do)."""
        tail = None
        if not self.open:
            keep = len(self.after) - 1
            tail = self._before[max(0, len(self._before) - keep) :] if keep else []
        return self.open, tail, self._matched

    def try_consume(self, tokens: list[int]) -> bool:
        """Advance over drafts while the grammar allows them; False at the first it forbids (which
        leaves the matcher out of error, unlike `accept`)."""
        for i, token in enumerate(tokens):
            if self.open:
                n = self.matcher.try_consume_tokens(tokens[i:])
                self._matched += n
                return n == len(tokens) - i
            self._watch(token)
        return True

    def restore(self, mark: tuple[bool, list[int] | None, int]) -> None:
        """Back to `mark` (taken by `mark()` before `try_consume`)."""
        was_open, tail, matched = mark
        if self._matched > matched:
            self.matcher.rollback(self._matched - matched)
            self._matched = matched
        if tail is not None:
            self._before = list(tail)
        self.open = was_open

    def is_stopped(self) -> bool:
        """Nothing may follow but EOS: the output is complete."""
        return self.open and self.matcher.is_stopped()

    def failed(self) -> bool:
        """The matcher is in error: the output need not follow the grammar any more (a forbidden
        token, or llguidance's limits reached, by this copy or another of its grammar)."""
        return self.open and self.matcher.is_error()

    def error(self) -> str:
        return self.matcher.get_error()


class GrammarCompiler:
    """Compiles grammars in a background thread for one engine's tokenizer and vocabulary.

    `load_tokenizer` returns the tokenizer: transformers' (fast), or the `tokenizers.Tokenizer` it would
    run (what an engine core reads from tokenizer.json: it loads no tokenizer at start, its API process
    tokenizes); None: the model has none, and structured output is refused. It is called in the compile
    thread when the first grammar needs it."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: set[int],
                 max_cached: int = 256) -> None:  # fmt: skip
        self.load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_cached = max_cached
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # grammar → a fresh matcher
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.num_compiled = 0  # grammars compiled (cache misses)
        self.compile_seconds = 0.0

    def submit(self, params: StructuredOutputsParams) -> Future[GrammarState]:
        """A future of a new request's state; already done when the grammar is cached."""
        grammar = grammar_of(params)
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
        if template is not None:
            done: Future[GrammarState] = Future()
            done.set_result(GrammarState(template.deep_copy(), params.after_token_ids, grammar))
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ferry-grammar")
        return self._pool.submit(self._compile, grammar, params.after_token_ids)

    def _compile(self, grammar: str, after: list[int] | None = None) -> GrammarState:
        start = time.perf_counter()
        with self._lock:
            template = self._compiled.get(grammar)  # compiled while this one waited in the queue
        if template is None:
            template = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"the grammar does not compile: {template.get_error()}")
            with self._lock:
                self._compiled[grammar] = template
                while len(self._compiled) > self.max_cached:
                    self._compiled.popitem(last=False)
            self.num_compiled += 1
            self.compile_seconds += time.perf_counter() - start
        return GrammarState(template.deep_copy(), after, grammar)

    def forget(self, state: GrammarState) -> None:
        """After `state` failed: copies of a compiled grammar share what llguidance builds as it
        goes (its lexer), and one that exhausts its limits leaves every later copy failing at
        its first mask, allowing only EOS. The next request compiles the grammar afresh."""
        with self._lock:
            self._compiled.pop(state.source, None)

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (~0.5 s to build for a 49k vocabulary: once, in the
        compile thread). Its vocabulary is the model's, which may be padded past the tokenizer's."""
        if self._ll_tokenizer is None:
            tokenizer = self.load_tokenizer()
            if tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer")
            if hasattr(tokenizer, "backend_tokenizer"):  # transformers': llguidance reads its backend's JSON
                from llguidance.hf import from_tokenizer

                n_vocab = max(self.vocab_size, len(tokenizer))
                self._ll_tokenizer = from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=self.eos_token_ids)
            else:  # that backend itself (tokenizers.Tokenizer), as llguidance.hf would serialize it
                n_vocab = max(self.vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
                self._ll_tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=n_vocab,
                                                            eos_token=self.eos_token_ids)  # fmt: skip
        return self._ll_tokenizer

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
