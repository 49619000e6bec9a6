"""ferry: an LLM inference engine with a paged KV cache and continuous batching.

`LLM` and `LLMEngine` are imported on first use (PEP 562): `import ferry` and the API server's
process must not load the model code behind them.
"""

from typing import TYPE_CHECKING

from ferry.config import EngineArgs
from ferry.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams
from ferry.lora_request import LoRARequest
from ferry.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput, ScoringRequestOutput
from ferry.sampling_params import PoolingParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from ferry.engine.llm_engine import LLMEngine
    from ferry.entrypoints.llm import LLM

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "StructuredOutputsParams",
    "PoolingParams",
    "EmbeddingRequestOutput",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "LoRARequest",
    "BeamSearchParams",
    "BeamSearchOutput",
    "ScoringRequestOutput",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from ferry.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from ferry.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'ferry' has no attribute {name!r}")
