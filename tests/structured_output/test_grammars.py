"""Grammars from structured-output specs: validation names the field, compiled grammars are cached
by content, and the batch bitmask allows exactly what the grammar allows (drafts rolled back)."""

from __future__ import annotations

import json

import pytest
import torch

from ferry.sampling_params import InvalidParameterError, StructuredOutputsParams
from ferry.structured_output import grammar as grammar_mod
from ferry.structured_output.bitmask import apply_bitmask, fill_bitmask
from ferry.structured_output.compiler import GrammarCompiler
from ferry.structured_output.grammar import MAX_CHOICES, MAX_SPEC_BYTES, check


@pytest.mark.parametrize(
    "spec, words",
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
        (dict(json="{not json"), "invalid json"),
        (dict(json="[1, 2]"), "JSON object"),
        (dict(regex="a(b"), "unclosed group"),
        (dict(grammar='start: foo\nfoo: "a" | bar'), "bar"),
        (dict(choice=[str(i) for i in range(MAX_CHOICES + 1)]), "choices"),
        (dict(regex="a" * (MAX_SPEC_BYTES + 1)), "bytes"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_field(spec, words):
    with pytest.raises(InvalidParameterError) as e:
        check(StructuredOutputsParams(**spec), "response_format")
    assert e.value.param == "response_format"
    assert words.lower() in str(e.value).lower()


@pytest.mark.parametrize("spec", [{}, dict(regex="a", choice=["b"]), dict(choice=[]), dict(choice=["a", 1])])
def test_exactly_one_well_formed_kind(spec):
    with pytest.raises(InvalidParameterError) as e:
        StructuredOutputsParams(**spec)
    assert e.value.param.startswith("structured_outputs")


def test_validation_is_cached_by_content(monkeypatch):
    calls = []
    real = grammar_mod.llguidance.LLMatcher.validate_grammar_with_warnings

    class Counting:
        @staticmethod
        def validate_grammar_with_warnings(g):
            calls.append(g)
            return real(g)

        grammar_from_json_schema = staticmethod(grammar_mod.llguidance.LLMatcher.grammar_from_json_schema)
        grammar_from_regex = staticmethod(grammar_mod.llguidance.LLMatcher.grammar_from_regex)

    monkeypatch.setattr(grammar_mod.llguidance, "LLMatcher", Counting)
    spec = StructuredOutputsParams(regex=r"cached-[0-9]{3}")
    assert check(spec) == check(StructuredOutputsParams(regex=r"cached-[0-9]{3}"))
    assert len(calls) == 1


@pytest.fixture(scope="module")
def compiler(smollm):
    tokenizer = smollm[1]
    c = GrammarCompiler(lambda: tokenizer, 49152, {tokenizer.eos_token_id})
    yield c
    c.shutdown()


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_compiled_once_then_copied_from_the_cache(compiler, smollm):
    tok = smollm[1]
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                         "required": ["n"], "additionalProperties": False})  # fmt: skip
    before = compiler.num_compiled
    first = compiler.submit(spec).result(timeout=60)
    again = compiler.submit(spec)
    assert again.done() and compiler.num_compiled == before + 1
    second = again.result()
    # Independent states: one advancing does not move the other.
    for t in _tokens(tok, '{"n": 12}'):
        assert first.accept(t)
    assert first.is_stopped() and not second.is_stopped()
    assert not second.accept(_tokens(tok, "hello")[0])  # not JSON: refused, the state in error
    assert second.error()


def test_a_grammar_whose_copies_broke_is_compiled_afresh(compiler, smollm):
    """A regex past llguidance's lexer budget fails in the matcher at run time, and the lexer is
    shared by every copy of the compiled grammar: cached copies then allowed only EOS, so later
    requests ended at once with "stop" and empty output. Such a state says it failed (its EOS ends
    the request "abort", not "stop"), and once the engine reports one, the next request gets the
    grammar compiled afresh."""
    tok = smollm[1]
    spec = StructuredOutputsParams(regex="((a{1000}){1000}){1000}")
    first = compiler.submit(spec).result(timeout=60)
    other = compiler.submit(spec).result(timeout=60)  # a copy of the cached one
    assert not first.failed() and not other.failed()
    before = compiler.num_compiled
    fill_bitmask([(first, [])], 49152)  # the step's mask, as the engine computes it before sampling
    assert not first.accept(_tokens(tok, "aaaa")[0])  # "too many expressions constructed"
    assert first.failed()
    fill_bitmask([(other, [])], 49152)  # the copy made before broke too: its EOS is no "stop"
    assert other.failed()
    broken = compiler.submit(spec).result(timeout=60)  # the cached one, as the engine had it
    fill_bitmask([(broken, [])], 49152)
    assert broken.failed() and compiler.num_compiled == before
    compiler.forget(first)  # what the engine does when a request's grammar fails
    fresh = compiler.submit(spec).result(timeout=60)
    fill_bitmask([(fresh, [])], 49152)
    assert compiler.num_compiled == before + 1 and not fresh.failed()


def test_gbnf_grammars_compile_too(compiler, smollm):
    state = compiler.submit(StructuredOutputsParams(grammar='root ::= "yes" | "no"')).result(timeout=60)
    for t in _tokens(smollm[1], "no"):
        assert state.accept(t)
    assert state.is_stopped()


def test_bitmask_allows_what_the_grammar_allows_and_drafts_roll_back(compiler, smollm):
    tok = smollm[1]
    V = 49152
    state = compiler.submit(StructuredOutputsParams(choice=["cat", "dog"])).result(timeout=60)
    cat, dog = _tokens(tok, "cat"), _tokens(tok, "dog")
    assert len(cat) == len(dog) == 1
    # Row 0: the state now; row 1: after the draft "cat" (only EOS may follow); row 2: after a
    # draft the grammar forbids (left all-allowed: never used).
    mask = fill_bitmask([(state, []), (state, cat), (state, _tokens(tok, "bird"))], V)
    logits = torch.zeros(4, V)
    out = apply_bitmask(logits, [0, 1, 2], mask[:3])
    allowed0 = set(torch.isfinite(out[0]).nonzero().flatten().tolist())
    assert {cat[0], dog[0]} <= allowed0 and tok.encode(" the", add_special_tokens=False)[0] not in allowed0
    assert set(torch.isfinite(out[1]).nonzero().flatten().tolist()) == {tok.eos_token_id}
    assert torch.isfinite(out[2]).all() and torch.isfinite(out[3]).all()  # unconstrained row untouched
    assert torch.equal(logits, torch.zeros(4, V))  # a copy, not in place
    # The drafts were rolled back: the state still takes either word.
    assert state.accept(dog[0]) and state.is_stopped()


def test_a_gated_grammar_opens_at_its_marker_and_drafts_across_it_roll_back(compiler, smollm):
    """after_token_ids (reasoning): closed, every token is free and the mask allows all; drafts that
    complete the marker give the next row the grammar's mask; nothing moves for drafts."""
    tok = smollm[1]
    V = 49152
    marker = _tokens(tok, "</think>")
    words = _tokens(tok, " so I think")
    cat, dog = _tokens(tok, "cat"), _tokens(tok, "dog")
    state = compiler.submit(StructuredOutputsParams(choice=["cat", "dog"], after_token_ids=marker)).result(timeout=60)
    assert not state.open and not state.is_stopped()
    rows = [(state, []), (state, words), (state, words + marker), (state, marker + cat), (state, marker + words)]
    mask = fill_bitmask(rows, V)
    out = apply_bitmask(torch.zeros(len(rows), V), list(range(len(rows))), mask)
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()  # closed: free
    assert set(torch.isfinite(out[2]).nonzero().flatten().tolist()) >= {cat[0], dog[0]}
    assert not torch.isfinite(out[2]).all()  # open after the marker: the grammar's mask
    assert set(torch.isfinite(out[3]).nonzero().flatten().tolist()) == {tok.eos_token_id}
    assert torch.isfinite(out[4]).all()  # a draft the grammar forbids after the marker: unused row
    assert not state.open  # the drafts moved nothing
    for t in words + marker:
        assert state.accept(t)
    assert state.open and not state.is_stopped()
    assert state.accept(dog[0]) and state.is_stopped()


def test_drafts_past_the_watched_tails_length_roll_back_too(compiler, smollm):
    """A long reasoning keeps only the output's tail; drafts tried while closed may push it past that
    length and trim it to theirs. Rolled back, the real tail is back: a marker the next kept token
    completes opens the grammar (it stayed closed for good, the answer unconstrained)."""
    tok = smollm[1]
    marker = _tokens(tok, "</think>")
    assert len(marker) > 1  # the marker straddles the verify step
    filler = _tokens(tok, " hmm")[0]
    state = compiler.submit(StructuredOutputsParams(choice=["cat", "dog"], after_token_ids=marker)).result(timeout=60)
    for _ in range(4 * len(marker) + 64 - len(marker)):  # up to just under the length the tail is trimmed at
        assert state.accept(filler)
    for t in marker[:-1]:
        assert state.accept(t)
    fill_bitmask([(state, []), (state, [filler]), (state, [filler, filler])], 49152)
    assert not state.open
    assert state.accept(marker[-1]) and state.open
    # And an output shorter than a longer marker: a model that writes it at once, drafts tried between.
    long_marker = _tokens(tok, "</reasoning_ends_here>")
    assert len(long_marker) >= 4
    params = StructuredOutputsParams(choice=["cat", "dog"], after_token_ids=long_marker)
    state = compiler.submit(params).result(timeout=60)
    for t in long_marker[:-1]:
        assert state.accept(t)
        fill_bitmask([(state, [filler])], 49152)
    assert not state.open and state.accept(long_marker[-1]) and state.open


def test_a_json_object_spec_builds_a_json_grammar():
    g = json.loads(check(StructuredOutputsParams(json_object=True)))
    assert "grammars" in g


def test_json_takes_pretty_printing_but_no_run_of_blank_lines(compiler, smollm):
    """The default whitespace between JSON tokens: indentation and one line break per gap, as a
    pretty-printer writes; a second line break in a row is refused (a sampled small model wrote
    sixty of them after every value until max_tokens cut it off)."""
    tok = smollm[1]
    props = {"n": {"type": "integer"}, "s": {"type": "string"}}
    spec = StructuredOutputsParams(json={"type": "object", "properties": props, "required": ["n", "s"],
                                         "additionalProperties": False})  # fmt: skip
    for text in ('{"n":1,"s":"a"}', '{\n    "n": 12,\n    "s": "b"\n}', '{ "n" : 3 ,\r\n\t"s" : "c" }'):
        state = compiler.submit(spec).result(timeout=60)
        assert all(state.accept(t) for t in _tokens(tok, text)), text
        assert state.is_stopped(), text
    for text in ('{"n": 12\n\n', '{\n\n"n"', '{"n":' + " " * 9):
        state = compiler.submit(spec).result(timeout=60)
        accepted = [state.accept(t) for t in _tokens(tok, text)]
        assert not all(accepted), text
