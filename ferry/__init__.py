"""ferry: an LLM inference engine with a paged KV cache and continuous batching."""

from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.entrypoints.llm import LLM
from ferry.outputs import CompletionOutput, Logprob, RequestOutput
from ferry.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]
__version__ = "0.1.0"
