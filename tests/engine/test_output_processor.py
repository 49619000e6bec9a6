"""OutputProcessor: token ids from the core → RequestOutputs."""

import pytest

from ferry.engine.messages import EngineCoreOutput
from ferry.engine.output_processor import OutputProcessor
from ferry.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def tok(smollm):
    return smollm[1]


def test_tokens_after_a_stop_string_are_dropped_while_the_abort_is_in_flight(tok):
    """With n > 1 a stopped sequence may still get a token or two from the core before its
    abort lands; none of them may reach the text, the token ids or the usage."""
    op = OutputProcessor(tok)
    params = SamplingParams(n=2, stop=[" beta"], output_kind=RequestOutputKind.FINAL_ONLY, max_tokens=50)
    op.add_request("r", None, [1, 2], params, ["r#0", "r#1"])
    stopping = tok.encode(" alpha beta gamma delta")
    other = tok.encode(" one two three four")
    steps = min(len(stopping), len(other))
    aborted, final = [], None
    for i in range(steps):
        last = i == steps - 1
        outs, to_abort = op.process(
            [
                EngineCoreOutput("r#0", [stopping[i]]),  # keeps coming after " beta": the abort is late
                EngineCoreOutput("r#1", [other[i]], finish_reason="length" if last else None),
            ]
        )
        aborted += to_abort
        if outs:
            final = outs
    assert aborted == ["r#0"]  # once, when its stop string matched
    assert len(final) == 1 and final[0].finished
    first, second = final[0].outputs
    assert first.text == " alpha" and first.finish_reason == "stop" and first.stop_reason == " beta"
    assert tok.decode(first.token_ids) == " alpha beta"  # nothing after the token that completed the stop
    assert second.text == tok.decode(other[:steps]) and second.finish_reason == "length"
