"""Turns EngineCoreOutputs (token ids) into RequestOutputs (text), one per user request.

Holds per-sequence detokenizers, applies stop strings (returning the ids the
core must abort), and folds the n sequences of a request into one
RequestOutput according to its `output_kind`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferry.engine.detokenizer import IncrementalDetokenizer
from ferry.engine.messages import EngineCoreOutput
from ferry.outputs import CompletionOutput, Logprob, RequestOutput
from ferry.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class SequenceState:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # for DELTA outputs
    sent_logprobs: int = 0
    sent_finish: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: dict[str, SequenceState]  # core request id -> sequence
    num_cached_tokens: int = 0
    embedding: list[float] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs.values())


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.seq_to_request: dict[str, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seq_ids: list[str],
    ) -> None:
        seqs = {}
        for i, sid in enumerate(seq_ids):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
                params.min_tokens,
            )
            seqs[sid] = SequenceState(
                i,
                detok,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            self.seq_to_request[sid] = request_id
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, seqs)

    def seq_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return list(state.seqs) if state else []

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state:
            for sid in state.seqs:
                self.seq_to_request.pop(sid, None)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs to report and the core request ids to abort (stop strings)."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for co in core_outputs:
            rid = self.seq_to_request.get(co.request_id)
            if rid is None:
                continue  # aborted meanwhile
            state = self.requests[rid]
            seq = state.seqs[co.request_id]
            if seq.finish_reason is not None:
                continue  # a stop string ended it; the core's abort is still on its way
            state.num_cached_tokens = max(state.num_cached_tokens, co.num_cached_tokens)
            if co.embedding is not None:
                state.embedding = co.embedding
            if co.prompt_logprobs is not None and state.prompt_logprobs is None:  # n > 1: the same for all
                state.prompt_logprobs = [None, *(self._entry(tok, e) for tok, e in
                                                 zip(state.prompt_token_ids[1:], co.prompt_logprobs))]  # fmt: skip
            for j, tok in enumerate(co.new_token_ids):
                seq.token_ids.append(tok)
                if seq.logprobs is not None and co.new_logprobs:
                    seq.logprobs.append(self._entry(tok, co.new_logprobs[j]))
                    seq.cumulative_logprob += co.new_logprobs[j][0]
                if co.stop_token and j == len(co.new_token_ids) - 1 and not state.params.include_stop_str_in_output:
                    break  # the EOS or stop token id that ended it: an id, not text (vLLM's)
                stop = seq.detok.add_token(tok)
                if stop is not None:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    if co.finish_reason is None:
                        to_abort.append(co.request_id)
                    break
            if seq.finish_reason is None and co.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = co.finish_reason, co.stop_reason
            touched[rid] = state

        outputs = []
        for rid, state in touched.items():
            out = self._make_output(state)
            if out is not None:
                outputs.append(out)
            if state.finished:
                self.abort_request(rid)
        return outputs, to_abort

    def _entry(self, tok: int, logprob: tuple[float, int, list[int], list[float]]) -> dict[int, Logprob]:
        """One position's logprobs: its token's, then the top alternatives (ranked 1..k)."""
        lp, rank, top_ids, top_lps = logprob
        entry = {tok: Logprob(lp, rank, self._decode_one(tok))}
        for r, (tid, tlp) in enumerate(zip(top_ids, top_lps), start=1):
            if tid not in entry:
                entry[tid] = Logprob(tlp, r, self._decode_one(tid))
        return entry

    def _decode_one(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for seq in state.seqs.values():
            done = seq.finish_reason is not None
            if kind == RequestOutputKind.DELTA:
                toks = seq.token_ids[seq.sent_tokens :]
                lps = seq.logprobs[seq.sent_logprobs :] if seq.logprobs is not None else None
                text = seq.detok.delta(done)
                if not toks and not text and (not done or seq.sent_finish):
                    continue
                seq.sent_finish = done
                seq.sent_tokens = len(seq.token_ids)
                seq.sent_logprobs = len(seq.logprobs) if seq.logprobs is not None else 0
            else:
                toks, lps, text = list(seq.token_ids), seq.logprobs, seq.detok.flush_text(done)
            completions.append(
                CompletionOutput(seq.index, text, toks, seq.cumulative_logprob, lps, seq.finish_reason, seq.stop_reason)
            )
        if not completions:
            return None
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, finished,
                             state.num_cached_tokens, state.embedding, state.prompt_logprobs)  # fmt: skip
