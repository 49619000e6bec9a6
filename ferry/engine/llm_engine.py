"""LLMEngine: the synchronous step API (add_request / abort_request / step) in one process.

A thin façade: `build_engine_core` makes the core (model, runner, KV cache, scheduler), the
InputProcessor validates and tokenizes, the OutputProcessor turns token ids into text. The
server splits the same pieces across two processes (async_llm.py, core_proc.py).
"""

from __future__ import annotations

import torch

from ferry.config import EngineArgs
from ferry.core.block_hash import hash_prompt_blocks
from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.scheduler import Scheduler
from ferry.engine.builder import build_engine_core
from ferry.engine.input_processor import InputProcessor, PromptType
from ferry.engine.messages import EngineInfo, EngineStats
from ferry.engine.output_processor import OutputProcessor
from ferry.kv_transfer.blocks import KVBlocks, export_blocks, import_blocks
from ferry.lora_request import LoRARequest, lora_name_of
from ferry.models.config import ModelConfig
from ferry.models.llama import LlamaForCausalLM
from ferry.outputs import RequestOutput
from ferry.sampling_params import SamplingParams
from ferry.worker.model_loading import LoadedModel
from ferry.worker.model_runner import ModelRunner
from ferry.worker.tp_worker import TensorParallelWorkers


class LLMEngine:
    def __init__(
        self,
        args: EngineArgs,
        *,
        model=None,
        tokenizer=None,
        device=None,
        dtype=None,
        draft_model: LoadedModel | None = None,
        freeze_heap: bool | None = None,
    ) -> None:
        """Build an engine; pass an already loaded `model` (with tokenizer, device, dtype) to reuse
        it, and a loaded `draft_model` for speculative method draft_model. `freeze_heap`: see
        build_engine_core (by default, only when the engine loads its own model)."""
        self.args = args
        loaded = LoadedModel(model, tokenizer, device, dtype, str(args.model or "")) if model is not None else None
        self.core = build_engine_core(args, loaded, draft_model, freeze_heap=freeze_heap)
        self.input_processor = InputProcessor(self.core.tokenizer, self.core.info)
        self.output_processor = OutputProcessor(self.core.tokenizer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any)."""
        self.core.shutdown()

    # -- what the core is made of (for tools, benchmarks and tests) -------------------

    @property
    def info(self) -> EngineInfo:
        return self.core.info

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def kv(self) -> KVCacheManager:
        return self.core.kv

    @property
    def tp_workers(self) -> TensorParallelWorkers | None:
        return self.core.tp_workers

    @property
    def model(self) -> LlamaForCausalLM:
        return self.core.runner.model

    @property
    def model_config(self) -> ModelConfig:
        return self.core.runner.model.config

    @property
    def device(self) -> torch.device:
        return self.core.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.core.runner.dtype

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.core.runner.cache_dtype

    @property
    def max_model_len(self) -> int:
        return self.core.info.max_model_len

    # -- requests ---------------------------------------------------------

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | str | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError naming the bad field, changing nothing.
        `lora_request`: the LoRA adapter it runs under, loaded now if it is a LoRARequest with a
        path that is not loaded yet (engines built with enable_lora); an adapter so loaded stays
        loaded if the request itself is then refused, as in vLLM."""
        if isinstance(lora_request, LoRARequest) and lora_request.lora_path:
            self.add_lora(lora_request)
        # A finished child of a request still running (x#0 of x) keeps its id until x ends: a new
        # request with that id would take over its place in the output processor.
        in_use = self.output_processor.requests.keys() | self.output_processor.seq_to_request.keys()
        in_use |= self.scheduler.requests.keys()
        req = self.input_processor.process(
            request_id, prompt, params or SamplingParams(), priority=priority, arrival_time=arrival_time, in_use=in_use,
            lora_name=lora_name_of(lora_request),
        )  # fmt: skip
        self.output_processor.add_request(request_id, req.prompt, req.prompt_token_ids, req.params, req.seq_ids)
        for core_request in req.core_requests:
            self.core.add_request(core_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter (vLLM's `add_lora`) unless one of its name is loaded; whether it
        loaded it. ValueError naming why not (EngineCore.add_lora), the model unchanged."""
        return self.core.add_lora(lora_request.lora_name, lora_request.lora_path)

    def remove_lora(self, lora_name: str) -> None:
        """Unload adapter `lora_name`; ValueError while requests still run under it."""
        self.core.remove_lora(lora_name)

    def list_loras(self) -> list[str]:
        """The LoRA adapters loaded, by name."""
        return list(self.core.runner.loras)

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.core.abort_requests(self.output_processor.seq_ids(rid))
            self.output_processor.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; returns outputs of the requests that progressed."""
        core_outputs = self.core.step()
        outputs, to_abort = self.output_processor.process(core_outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs

    def export_kv(self, prompt_token_ids: list[int], skip: set[bytes] | frozenset = frozenset()) -> KVBlocks:
        """The KV blocks this engine still caches for a prompt's full blocks (after its prefill),
        without the leading ones in `skip` (kv_transfer/blocks.py)."""
        if self.tp_workers is not None:
            raise ValueError("KV export does not support tensor or pipeline parallelism yet")
        hashes = hash_prompt_blocks(prompt_token_ids, self.kv.block_size, deployment_salt=self.kv.block_hash_salt)
        return export_blocks(self.kv, self.runner.kv_caches, hashes, skip)

    def import_kv(self, blocks: KVBlocks) -> int:
        """Publish another engine's blocks in this prefix cache; returns how many were new."""
        if self.tp_workers is not None:
            raise ValueError("KV import does not support tensor or pipeline parallelism yet")
        return import_blocks(self.kv, self.runner.kv_caches, blocks)

    def get_stats(self) -> EngineStats:
        return self.core.stats()
