"""--enable-log-outputs' collector (request_log.py): each choice logged once, whole, as it finishes."""

from __future__ import annotations

import logging

from ferry.entrypoints.openai.request_log import RequestLogger
from ferry.outputs import CompletionOutput, RequestOutput
from ferry.sampling_params import RequestOutputKind, SamplingParams


def out(*choices) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], [CompletionOutput(i, t, ids, finish_reason=f) for i, t, ids, f in choices],
                         finished=all(f is not None for _, _, _, f in choices))  # fmt: skip


def logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ferry.requests"]


def test_deltas_are_joined_and_each_choice_logged_when_it_finishes(caplog):
    caplog.set_level(logging.INFO, logger="ferry.requests")
    collector = RequestLogger(log_outputs=True).collector(SamplingParams(output_kind=RequestOutputKind.DELTA))
    collector.add(out((0, "Hel", [5], None), (1, "Yo", [7], None)))
    collector.add(out((0, "lo", [6], "stop")))
    collector.add(out((1, "!", [8], "length")))
    assert logged(caplog) == [
        "Generated response r (choice 0): output: 'Hello', output_token_ids: [5, 6], finish_reason: stop",
        "Generated response r (choice 1): output: 'Yo!', output_token_ids: [7, 8], finish_reason: length",
    ]


def test_a_cumulative_choice_that_finished_is_not_logged_again(caplog):
    caplog.set_level(logging.INFO, logger="ferry.requests")
    collector = RequestLogger(log_outputs=True, max_log_len=3).collector(SamplingParams())  # CUMULATIVE
    collector.add(out((0, "Hi", [5], "stop"), (1, "Yo", [7], None)))
    collector.add(out((0, "Hi", [5], "stop"), (1, "Yo you", [7, 8, 9, 10], "length")))
    assert logged(caplog) == [
        "Generated response r (choice 0): output: 'Hi', output_token_ids: [5], finish_reason: stop",
        "Generated response r (choice 1): output: 'Yo ', output_token_ids: [7, 8, 9], finish_reason: length",
    ]


def test_no_collector_without_the_flag():
    assert RequestLogger(log_inputs=True, log_outputs=False).collector(SamplingParams()) is None
