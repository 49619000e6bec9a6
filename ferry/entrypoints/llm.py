"""The offline Python API: `LLM(model).generate(prompts, params)`, as vLLM's."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from ferry.config import EngineArgs
from ferry.engine.input_processor import PromptType
from ferry.engine.llm_engine import LLMEngine
from ferry.entrypoints.beam_search import BeamSearch, BeamSearches, BeamSearchOutput, BeamSearchParams
from ferry.lora_request import LoRARequest
from ferry.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput
from ferry.sampling_params import PoolingParams, RequestOutputKind, SamplingParams

Message = dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.llm_engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._counter = itertools.count()
        self._sampling_defaults: dict[str, Any] | None = None  # read on first use

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an existing engine (e.g. one sharing already-loaded weights)."""
        llm = cls.__new__(cls)
        llm.llm_engine = engine
        llm._counter = itertools.count()
        llm._sampling_defaults = None
        return llm

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without sampling_params: the model's generation_config.json
        defaults (temperature, top_p, top_k, min_p, repetition_penalty), as vLLM's LLM does."""
        from ferry.models.generation_config import sampling_defaults
        from ferry.models.paths import resolve_model_path

        args = self.llm_engine.args
        if self._sampling_defaults is None:
            self._sampling_defaults = sampling_defaults(resolve_model_path(args.model, args.load_format))
        return SamplingParams(**self._sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order.

        A prompt is a string, `{"prompt_token_ids": [...]}` or `{"prompt": str}`.
        `lora_request`: the LoRA adapter every prompt runs under, or one per prompt (None: the
        base model); loaded on first use (`LLM(..., enable_lora=True)`).
        A bad prompt or parameter raises ValueError before anything runs.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params):
            params = list(sampling_params)
        else:
            raise ValueError("sampling_params must be SamplingParams, or a list of them (one per prompt), got "
                             f"{type(sampling_params).__name__}")  # fmt: skip
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(next(self._counter))
                engine.add_request(
                    rid,
                    prompt,
                    p.clone(output_kind=RequestOutputKind.FINAL_ONLY),
                    priority=priority[i] if priority else 0,
                    lora_request=loras[i],
                )
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)  # nothing half-queued survives a bad prompt
            raise
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt: the model's final hidden states pooled (PoolingParams; default
        the engine's --pooling-type, normalised), in prompt order."""
        params = SamplingParams(max_tokens=1, pooling=pooling_params or PoolingParams())
        outs = self.generate(prompts, params, use_tqdm=use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding), o.finished)
                for o in outs]  # fmt: skip

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: each prompt's `beam_width` best beams (ferry/entrypoints/beam_search.py),
        best first; a beam's `text` is its whole sequence's, the prompt's included, as vLLM's."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        engine = self.llm_engine
        eos = set(engine.info.eos_token_ids)
        searches = BeamSearches([BeamSearch(engine.tokenize(p)[1], params, eos, engine.info.max_model_len)
                                 for p in prompts])  # fmt: skip
        step = params.step_params()
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        while batch := searches.next_round():
            sequences = [{"prompt_token_ids": tokens, **({"cache_salt": salts[i]} if salts[i] else {})}
                         for i, tokens in batch]  # fmt: skip
            searches.advance(self.generate(sequences, step, use_tqdm=False, lora_request=lora_request))
        tok = engine.tokenizer
        results = []
        for best in searches.best():
            for beam in best:
                beam.text = tok.decode(beam.tokens, skip_special_tokens=True) if tok is not None else None
            results.append(BeamSearchOutput(best))
        return results

    def score(
        self,
        text_1: PromptType | Sequence[PromptType],
        text_2: PromptType | Sequence[PromptType],
        *,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score` for an embedding model: the cosine similarity of each pair's normalised
        embeddings. One `text_1` is scored against each `text_2`; lists of one length pairwise."""
        firsts = [text_1] if isinstance(text_1, (str, dict)) else list(text_1)  # as generate() reads prompts
        seconds = [text_2] if isinstance(text_2, (str, dict)) else list(text_2)
        if not firsts or not seconds or len(firsts) not in (1, len(seconds)):
            raise ValueError(f"text_1 has {len(firsts)} prompts and text_2 {len(seconds)}: give one text_1, or "
                             "as many as text_2 (scored pairwise)")  # fmt: skip
        embedded = self.embed([*firsts, *seconds], PoolingParams(normalize=True), use_tqdm=use_tqdm)
        outs = []
        for i, b in enumerate(embedded[len(firsts) :]):
            a = embedded[i if len(firsts) > 1 else 0]
            similarity = sum(x * y for x, y in zip(a.outputs.embedding, b.outputs.embedding))
            outs.append(ScoringRequestOutput(b.request_id, a.prompt_token_ids + b.prompt_token_ids,
                                             ScoringOutput(max(-1.0, min(1.0, similarity)))))  # fmt: skip
        return outs

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate. Messages take
        OpenAI's shapes, as the server's (content parts, `developer`, tool calls and results);
        each output's `prompt` is the rendered text. ValueError for messages or a template that
        cannot be rendered."""
        from pydantic import ValidationError

        from ferry.entrypoints.openai.chat_prompt import render_chat_prompt
        from ferry.entrypoints.openai.protocol import ChatPrompt, OpenAIError

        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        if not messages:
            raise ValueError("messages: give a conversation, or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            try:
                body = ChatPrompt.model_validate({"messages": conv, "add_generation_prompt": add_generation_prompt})
                prompts.append(render_chat_prompt(tok, body, chat_template))
            except ValidationError as e:
                raise ValueError(f"messages: {e}") from None
            except OpenAIError as e:
                raise ValueError(str(e)) from None
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]
