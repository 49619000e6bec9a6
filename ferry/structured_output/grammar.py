"""`StructuredOutputsParams` → an llguidance grammar, validated.

The grammar's text is its identity: validation results (here) and compiled matchers (compiler.py)
are cached by it. Validation compiles the grammar without a tokenizer, within llguidance's default
parser limits (grammar size, lexer fuel), so no schema or regex can make it run long; the spec itself
is bounded in bytes before anything parses it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance

from ferry.sampling_params import InvalidParameterError, StructuredOutputsParams

MAX_SPEC_BYTES = 256 << 10  # a schema, regex, grammar or the choices together
MAX_CHOICES = 4096
# Between JSON tokens: a few spaces, then at most one line break and an indentation. An unbounded
# run (llguidance's default) let a sampled small model pad with spaces until max_tokens cut its JSON
# off; a bound of 64 of any of them still let it write sixty blank lines after every value (CI,
# SmolLM2 at temperature 0.8). Pretty-printed JSON never needs two line breaks in a row; 48 columns
# of indentation is twelve levels of four (llama.cpp's JSON grammars bound it the same way).
DEFAULT_JSON_WHITESPACE = r"[\x20\x09]{0,8}(\x0D?\x0A[\x20\x09]{0,48})?"


def _json_options(params: StructuredOutputsParams) -> dict:
    if params.disable_any_whitespace:
        return {"whitespace_flexible": False}
    return {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern or DEFAULT_JSON_WHITESPACE}


def grammar_of(params: StructuredOutputsParams, param: str = "structured_outputs") -> str:
    """The llguidance grammar of `params` (not yet validated). `param` names the request field the
    spec came from, for the error (e.g. `response_format`)."""
    kind = params.kind
    spec = getattr(params, kind)
    size = len(spec.encode()) if isinstance(spec, str) else len(json.dumps(spec)) if kind != "json_object" else 0
    if size > MAX_SPEC_BYTES:
        raise InvalidParameterError(param, f"the {kind} spec has {size} bytes, more than the {MAX_SPEC_BYTES} allowed")
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else spec
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise InvalidParameterError(param, "a JSON schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_json_options(params))
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            if len(spec) > MAX_CHOICES:
                raise InvalidParameterError(param, f"at most {MAX_CHOICES} choices, got {len(spec)}")
            return llguidance.grammar_from("choice", spec)
        return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF (converted to Lark)
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
        if isinstance(e, InvalidParameterError):
            raise
        raise InvalidParameterError(param, f"invalid {kind}: {e}") from None


_validated: OrderedDict[str, str] = OrderedDict()  # grammar → "" or llguidance's error
_validated_lock = threading.Lock()
_MAX_VALIDATED = 1024


def check(params: StructuredOutputsParams, param: str = "structured_outputs") -> str:
    """The grammar of `params`, or InvalidParameterError naming `param` with llguidance's message.
    Cached by content: a schema sent again costs a dict lookup."""
    grammar = grammar_of(params, param)
    with _validated_lock:
        error = _validated.get(grammar)
        if error is not None:
            _validated.move_to_end(grammar)
    if error is None:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        error = messages[0] if is_error else ""  # warnings (e.g. an ignored keyword) do not refuse it
        with _validated_lock:
            _validated[grammar] = error
            while len(_validated) > _MAX_VALIDATED:
                _validated.popitem(last=False)
    if error:
        raise InvalidParameterError(param, f"invalid {params.kind} for structured output: {error.strip()[:2000]}")
    return grammar


def clear_validation_cache() -> None:
    """Forget every validation result (`ferry bench structured` times validation cold)."""
    with _validated_lock:
        _validated.clear()
