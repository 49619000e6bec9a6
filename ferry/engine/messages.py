"""Messages between the API process and the EngineCore process (msgspec, never pickle).

API -> core: `AddRequest`, `AbortRequests`, `UtilityCall` (a tagged union, `InputMessage`).
core -> API: `CoreReady` once loaded and warmed, then `CoreOutputs` after every step (and as a
heartbeat when idle), `UtilityResult` for each call, `KVTransferDone` for each KV transfer
(disaggregated serving), and `CoreFailed` right before the core process exits on an error.
"""

from __future__ import annotations

import msgspec

from ferry.kv_transfer.outcome import KVTransferDone
from ferry.sampling_params import InvalidParameterError, SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True):
    """One sequence to generate: a user request with n > 1 becomes n of these."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # already resolved against max_model_len
    priority: int = 0
    arrival_time: float = 0.0  # time.monotonic(): system-wide on Linux, so comparable across processes
    cache_salt: str | None = None  # keys the prompt's block hashes (core/block_hash.py)
    # Prefill/decode disaggregation (kv_transfer/connector.py). Prefill side: once finished, send the
    # prompt's KV blocks to the decode worker's receiver at `kv_target` (None: to Redis).
    kv_export: bool = False
    kv_target: str | None = None
    # Decode side: the token(s) the prefill worker sampled, emitted first and continued from.
    prefilled_token_ids: list[int] = []
    lora_name: str | None = None  # the LoRA adapter it runs under (one the core loaded), None: the base model


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    # Per new token: (logprob, rank, top ids, top logprobs).
    new_logprobs: list[tuple[float, int, list[int], list[float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    # The last new token is the EOS or stop token id that ended the request: in the token ids, not
    # in the text (unless include_stop_str_in_output), as in vLLM.
    stop_token: bool = False
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's vector (it has no tokens)
    # With the first token, for sampling_params.prompt_logprobs: per prompt token from the second,
    # as new_logprobs.
    prompt_logprobs: list[tuple[float, int, list[int], list[float]]] | None = None
    # Seconds from arrival to first scheduling; set on a request's first output only.
    queue_time: float | None = None


class EngineStats(msgspec.Struct):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    num_evictions: int
    # Speculative decoding (vLLM's spec_decode_* counters): requests that verified drafts, the
    # drafts verified and kept, and kept drafts by their position (0 = the first draft).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    step_tokens: int = 0  # the tokens of the step these stats follow (0: sent without one)

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        """Tokens a verifying request gains per step: the kept drafts plus the model's own."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None


class EngineInfo(msgspec.Struct):
    """What the API process needs to validate and tokenize without the model."""

    model_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_kv_blocks: int
    max_logprobs: int = 20  # per token, per request (--max-logprobs; -1 there is the vocabulary's size here)
    # Where the core publishes KV events (core/kv_events.py); None unless enabled.
    kv_events_host: str | None = None
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    block_hash_salt: str | None = None  # the fingerprint of the deployment salt of block hashes, if any
    # Prefill/decode disaggregation: this worker's role, how it sends KV blocks, where it receives them.
    kv_role: str = "both"
    kv_transfer: str | None = None
    kv_receiver: str | None = None  # tcp://host:port
    kv_redis: bool = False  # pulls missing prefix blocks from Redis
    # Seconds each start-up phase took (`ferry bench startup`, /ferry/info): the core process's own
    # start (interpreter and imports), weight loading, KV-cache sizing and allocation (CUDA graphs
    # included), warm-up; the API process adds its own start, the tokenizer, and the total to ready.
    startup_seconds: dict[str, float] = msgspec.field(default_factory=dict)
    # The LoRA adapters loaded (--lora-modules), which requests may name: name -> their files' digest.
    lora_digests: dict[str, str] = {}


# -- API -> core ---------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class LoRAInUseError(InvalidParameterError):
    """An unload or in-place replace of an adapter that requests still run under (the server's 409)."""


class LoRANotLoadedError(InvalidParameterError):
    """An unload of an adapter the core does not hold."""


# The core's refusals the API process tells apart, by their name in a UtilityResult (`error_kind`):
# raised again there as the same class, so no caller matches words of the message.
UTILITY_ERRORS: dict[str, type[InvalidParameterError]] = {
    "lora_in_use": LoRAInUseError,
    "lora_not_loaded": LoRANotLoadedError,
    "invalid_parameter": InvalidParameterError,
}


def utility_error_kind(e: Exception) -> str | None:
    """The name under which `e` crosses to the API process (the most specific class's), if any."""
    return next((kind for kind, cls in UTILITY_ERRORS.items() if isinstance(e, cls)), None)


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    method: str  # "ping" | "stats" | "reset_prefix_cache" | "add_lora" | "remove_lora" | "shutdown"
    args: list[str] = []  # add_lora: [name, path] or [name, path, "replace"]; remove_lora: [name]


InputMessage = AddRequest | AbortRequests | UtilityCall


# -- core -> API ---------------------------------------------------------------


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    info: EngineInfo


class CoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[EngineCoreOutput]
    stats: EngineStats


class UtilityResult(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    ok: bool
    value: EngineStats | str | None = None  # stats; add_lora: the adapter's digest
    error: str | None = None
    error_kind: str | None = None  # a key of UTILITY_ERRORS: the refusal's class
    error_param: str | None = None  # its `param`


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str


OutputMessage = CoreReady | CoreOutputs | UtilityResult | CoreFailed | KVTransferDone
