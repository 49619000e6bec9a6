"""What a user configures: the engine's arguments (vLLM's names, one `--flag` each), KV-event
publishing (`ferry serve --enable-kv-events`) and KV transfer between prefill and decode workers
(`--role`, `--kv-transfer`). Plain data and validation; nothing here imports the rest of ferry."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from typing import Any

_GiB = 1 << 30

# None / auto: as the checkpoint is stored: a quantized GGUF runs its blocks as stored on the CPU
#   and on CUDA (gguf), and so does a GPTQ/AWQ/compressed-tensors checkpoint (converted to the same
#   blocks at load, ferry/models/quantized_checkpoints.py); anything else in the model dtype.
# none: every weight in the model dtype (a GGUF's quantized tensors dequantized): the HF-exact reference.
# gguf: a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K tensors run as stored (ferry/layers/gguf_linear.py);
#   with --load-format dummy, random Q4_0 projections (ferry/models/dummy_weights.py).
# int8: per-channel int8 weights, per-token int8 activations (ferry/layers/int8_linear.py).
QUANTIZATION_METHODS = (None, "auto", "none", "gguf", "int8")

# auto: real weights from the checkpoint; dummy: the architecture from config.json, random weights.
LOAD_FORMATS = ("auto", "dummy")

# auto: flashinfer when it imports on CUDA, else triton on CUDA, else torch (ferry/layers/attention/).
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")

# Prefill/decode disaggregation (ferry/kv_transfer/): a worker's role, how it sends KV blocks,
# and how the blocks travel (raw: the cache dtype; int8: per-(token, head) scales, ferry/kv_transfer/blocks.py).
KV_ROLES = ("both", "prefill", "decode")
KV_TRANSPORTS = ("tcp", "shm", "redis")
KV_ENCODINGS = ("raw", "int8")
# --kv-cache-dtype: auto (the model dtype), a float dtype, or a quantized format with per-(token, head)
# scales stored beside the values (ferry/kv_quant.py; fp8 is fp8_e4m3).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3")


DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class EngineArgs:
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct GGUF
    tokenizer: str | None = None  # defaults to the model's own
    # vLLM's: load a tokenizer that is its own Python code (its tokenizer_config.json's auto_map).
    # ferry never runs a checkpoint's modelling code: its models are its own.
    trust_remote_code: bool = False
    # The most logprobs (or prompt_logprobs) one request may ask for per token (vLLM's default, 20);
    # -1: the vocabulary's size. Each costs a top-k over the vocabulary and ~30 bytes of answer.
    max_logprobs: int = 20
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantization: str | None = None  # None/auto (as stored) | none | gguf | int8 (dynamic W8A8: CPU and CUDA)
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | float32 | bfloat16 | float16 | int8 | fp8 | fp8_e4m3
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    max_model_len: int | None = None  # default: the model's context length
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides the memory budget below
    kv_cache_memory_bytes: int | None = None  # default: 2 GiB on CPU
    # CPU: fault the KV cache's pages in from an idle-priority thread as soon as it is allocated
    # (utils/lazy_zeros.py's Populator), so that requests do not pay each fresh page's first write
    # (~4.5 ms a 2 MiB page on a KVM guest); the whole cache is then resident, as a GPU's is.
    kv_cache_prefault: bool = False
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    # Tokens one step may compute. Without chunked prefill a prompt goes in one step, so unless set
    # it is then at least max_model_len (vLLM's default); set lower, that is an error.
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    load_format: str = "auto"  # auto | dummy (random weights, for benchmarks)
    attention_backend: str = "auto"  # auto | torch | triton | flashinfer
    enforce_eager: bool = False  # no CUDA graphs
    tensor_parallel_size: int = 1
    # Decoder layers split into this many stages, one after another, each tensor_parallel_size ranks;
    # micro-batches in flight keep the stages busy together (ferry/worker/tp_worker.py).
    pipeline_parallel_size: int = 1
    # Under TP, MoE experts placed whole across the ranks (num_experts / N each), not sliced.
    enable_expert_parallel: bool = False
    # Several hosts (torchrun's names): the world_size ranks split evenly over nnodes nodes, node r running
    # ranks r * world_size / nnodes on; node 0 runs the engine (and serves HTTP), the others start with
    # --node-rank and take node 0's engine arguments from the rendezvous store at master_addr:master_port
    # (ferry/worker/tp_worker.py). Node 0's master_addr must be reachable from the others.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one node only)
    # vLLM's --speculative-config: JSON text (or, from Python, a dict), e.g.
    # '{"method": "ngram", "num_speculative_tokens": 4}'; see SpeculativeConfig.
    speculative_config: str | None = None
    # Embeddings (PoolingParams): the pooling of requests that name none, and dynamic batching:
    # an embedding request waits up to embed_max_delay_ms for others, until embed_max_batch wait.
    pooling_type: str = "last"  # last | mean | cls
    embed_max_batch: int = 32
    embed_max_delay_ms: float = 5.0
    # LoRA adapters (PEFT directories) served beside the base model, as vLLM's --enable-lora: each
    # `name=path` (or {"name": ..., "path": ...}); requests choose one by name. max_loras: the most
    # adapters the running requests use together; max_lora_rank: the largest rank accepted;
    # max_cpu_loras (vLLM's name): the most adapters loaded at once (ferry keeps every loaded one on
    # the model's device, beside a KV cache sized before any loaded at run time), which bounds what
    # loading at run time can take; None: as vLLM, max_loras (or the number of lora_modules if more).
    enable_lora: bool = False
    lora_modules: list[str | dict] | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        self.speculative = SpeculativeConfig.parse(self.speculative_config)
        self.lora_adapters = parse_lora_modules(self.lora_modules)
        self._check_lora()
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1 (-1: the vocabulary's size), got {self.max_logprobs}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS):  # fmt: skip
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_model_len)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype in ("int8", "fp8", "fp8_e4m3") and self.block_size % 2:
            # its blocks hold their tokens' values in pairs (ferry/kv_quant.py)
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype} needs an even --block-size, got {self.block_size}"
            )
        if self.quantization not in QUANTIZATION_METHODS:
            choices = ", ".join(m for m in QUANTIZATION_METHODS if m)
            raise ValueError(f"quantization must be one of {choices} (or unset), got {self.quantization!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in [0, nnodes), got node_rank {self.node_rank} of nnodes {self.nnodes}"
            )
        if self.nnodes > 1:
            if self.world_size % self.nnodes:
                raise ValueError(f"{self.world_size} ranks (tensor x pipeline parallel) do not split evenly over "
                                 f"{self.nnodes} nodes")  # fmt: skip
            if not 0 < self.master_port < 65536:
                raise ValueError("several nodes need --master-port (and --master-addr: node 0's address)")
        if self.pipeline_parallel_size > 1 and self.speculative is not None:
            raise ValueError("speculative decoding does not run under pipeline parallelism yet: "
                             "drop --speculative-config or use --pipeline-parallel-size 1")  # fmt: skip
        if self.pooling_type not in ("last", "mean", "cls"):  # sampling_params.POOLING_TYPES (a layer apart)
            raise ValueError(f"pooling_type must be last, mean or cls, got {self.pooling_type!r}")
        if self.embed_max_batch < 1:
            raise ValueError(f"embed_max_batch must be >= 1, got {self.embed_max_batch}")
        if not 0.0 <= self.embed_max_delay_ms <= 10_000:
            raise ValueError(f"embed_max_delay_ms must be in [0, 10000], got {self.embed_max_delay_ms}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def max_loaded_loras(self) -> int:
        """The most LoRA adapters loaded at once (`max_cpu_loras`, or its default)."""
        if self.max_cpu_loras is not None:
            return self.max_cpu_loras
        return max(self.max_loras, len(self.lora_adapters))

    def _check_lora(self) -> None:
        if self.lora_adapters and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if not self.enable_lora:
            return
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < max(self.max_loras, len(self.lora_adapters)):
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}) and "
                             f"the number of lora_modules ({len(self.lora_adapters)})")  # fmt: skip
        if self.pipeline_parallel_size > 1:
            raise ValueError("LoRA adapters do not run under pipeline parallelism yet")
        if self.quantization == "int8":
            # SmoothQuant scales each layer's input columns (layers/smoothquant.py): an adapter's A would need them too
            raise ValueError("LoRA adapters do not run over --quantization int8 (SmoothQuant) yet")
        if self.speculative is not None and self.speculative.method == "early_exit":
            raise ValueError("LoRA adapters do not run with early-exit speculation (its drafts skip the adapters)")

    @property
    def world_size(self) -> int:
        """Ranks (processes, GPUs) the engine runs on: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one `--kebab-case` flag per field (the model is positional elsewhere)."""
        g = parser.add_argument_group("engine")
        for f in fields(cls):
            if f.name == "model":
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.type == "bool":
                g.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            elif f.type.startswith("list["):  # --lora-modules a=/path b=/path
                g.add_argument(flag, nargs="+", default=f.default)
            else:
                kind = {"int": int, "float": float, "str": str}[f.type.split(" ")[0]]
                g.add_argument(flag, type=kind, default=f.default)

    def to_cli_flags(self) -> list[str]:
        """The non-default fields as flags (model excluded), to start a `ferry serve` like this."""
        flags: list[str] = []
        default = EngineArgs()
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "model" or value == getattr(default, f.name):
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                flags.append(flag if value else "--no-" + f.name.replace("_", "-"))
            elif isinstance(value, dict):
                flags += [flag, json.dumps(value)]
            elif isinstance(value, list):
                flags += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
            else:
                flags += [flag, str(value)]
        return flags

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


DEFAULT_CPU_KV_CACHE_BYTES = 2 * _GiB

# method: how draft tokens are proposed (ferry/worker/spec_decode/). ngram: prompt lookup;
# draft_model: a smaller model with the same tokenizer; early_exit: the target's own first layers;
# medusa: trained heads on the target's last hidden state.
SPECULATIVE_METHODS = ("ngram", "draft_model", "early_exit", "medusa")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys): each step, `num_speculative_tokens`
    draft tokens per decoding request are verified by one forward pass of the model; the longest
    prefix it agrees with is kept, plus one token of its own.

    ngram: the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are looked up
    in the prompt and output so far, and what followed their latest earlier occurrence is proposed.
    As in vLLM, both default to 5, and one given alone sets the other.
    `disable_by_batch_size`: no drafts in a step that runs more requests than this (speculation
    pays at low batch, where a step's cost hardly grows with its rows).
    `draft_length` (ferry's own): "adaptive" (the default) verifies, of the up to
    `num_speculative_tokens` drafts a request has, as many as are expected to raise the step's
    tokens per second, from the request's measured acceptance and the engine's measured cost of a
    row (ferry/worker/spec_decode/draft_length.py); "fixed" verifies them all, as vLLM does.

    draft_model: `model` (any checkpoint ferry loads, with the target's tokenizer) drafts
    autoregressively with its own paged KV cache. early_exit (LayerSkip's self-speculation): the
    target's first `draft_layers` layers, its final norm and LM head draft. medusa: `model` is a
    directory of Medusa heads (vLLM's layout, or what `ferry train-draft --method medusa` writes),
    one draft per head, or with `speculative_token_tree` (vLLM's key: a list of paths, each the
    ranks of its candidates among a head's guesses, e.g. [[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    a tree of them, verified in one pass. Without `method`, a `model` means draft_model and no
    model means ngram, as in vLLM."""

    method: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    draft_length: str = "adaptive"
    # draft_model: the draft's checkpoint (a path, or an architecture with dummy weights); medusa: the heads
    model: str | None = None
    draft_layers: int | None = None  # early_exit: how many of the target's layers draft
    # medusa: the candidates as paths of ranks (a JSON list of lists, or vLLM's string of tuples)
    speculative_token_tree: list | str | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method not in SPECULATIVE_METHODS:
            choices = ", ".join(SPECULATIVE_METHODS)
            raise ValueError(f"speculative method must be one of {choices}, got {self.method!r}")
        k = self.num_speculative_tokens
        if type(k) is not int or not 1 <= k <= 64:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 64], got {k!r}")
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = 5
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (type(lo) is int and type(hi) is int and 1 <= lo <= hi <= 64):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got {lo!r} and {hi!r}")
        b = self.disable_by_batch_size
        if b is not None and (type(b) is not int or b < 1):
            raise ValueError(f"disable_by_batch_size must be a positive integer, got {b!r}")
        if self.draft_length not in ("adaptive", "fixed"):
            raise ValueError(f"draft_length must be 'adaptive' or 'fixed', got {self.draft_length!r}")
        if (self.method in ("draft_model", "medusa")) != (self.model is not None):
            raise ValueError(
                "speculative methods draft_model and medusa need a `model` (the draft's checkpoint or the "
                "heads' directory), and only they take one"
            )
        layers = self.draft_layers
        if self.method == "early_exit":
            if type(layers) is not int or layers < 1:
                raise ValueError(f"early_exit needs draft_layers, a positive integer, got {layers!r}")
        elif layers is not None:
            raise ValueError("draft_layers is for the early_exit method")
        if self.speculative_token_tree is not None:
            if self.method != "medusa":
                raise ValueError("speculative_token_tree is for the medusa method")
            self.speculative_token_tree = parse_token_tree(self.speculative_token_tree, k)

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From `--speculative-config` JSON or a dict; None when unset. Unknown keys are errors
        (a misspelt key must not silently turn speculation off)."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        return cls(**value)


# A tree's drafts are masked by bits of one int64 per row (AttentionMetadata.decode_tree).
MAX_TREE_DRAFTS = 64


def parse_token_tree(value: list | str, max_depth: int) -> list[tuple[int, ...]]:
    """`speculative_token_tree` as sorted paths (preorder: a node right before its subtree,
    children by rank): each path's ranks non-negative, every prefix of it present, depth at most
    `max_depth` (num_speculative_tokens), at most MAX_TREE_DRAFTS nodes."""
    if isinstance(value, str):
        import ast

        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"speculative_token_tree is not a list of paths: {value!r}") from None
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError("speculative_token_tree must be a non-empty list of paths")
    paths = set()
    for path in value:
        if not isinstance(path, (list, tuple)) or not path or not all(type(r) is int and r >= 0 for r in path):
            raise ValueError(f"speculative_token_tree: each path is a non-empty list of ranks >= 0, got {path!r}")
        paths.add(tuple(path))
    for path in paths:
        if len(path) > max_depth:
            raise ValueError(f"speculative_token_tree: path {list(path)} is deeper than num_speculative_tokens")
        if len(path) > 1 and path[:-1] not in paths:
            raise ValueError(f"speculative_token_tree: path {list(path)} lacks its parent {list(path[:-1])}")
    if len(paths) > MAX_TREE_DRAFTS:
        raise ValueError(f"speculative_token_tree has {len(paths)} nodes; at most {MAX_TREE_DRAFTS}")
    return sorted(paths)


@dataclass
class KVEventsConfig:
    """Where the EngineCore publishes its prefix cache's changes (ferry/core/kv_events.py)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (the bound one is reported in EngineInfo)
    replay_port: int = 0
    buffer_steps: int = 10_000  # batches kept for replay
    # The deployment's secret: batches, replay requests and replies carry an HMAC with it
    # (utils/deployment_secret.py), and block hashes a salt derived from it (core/block_hash.py).
    secret: bytes | None = field(default=None, repr=False)


# Loopback only: one-host deployments (`ferry up --pd`); multi-host ones list their network.
KV_DEFAULT_ALLOWED_RECEIVERS = ("127.0.0.0/8", "::1", "localhost")


@dataclass
class KVTransferConfig:
    """Prefill/decode disaggregation for one worker (ferry/kv_transfer/)."""

    role: str = "both"  # prefill | decode | both
    transport: str | None = None  # how this worker sends blocks: tcp | shm | redis (None: it sends none)
    host: str = "127.0.0.1"  # where the receiver listens (decode / both)
    port: int = 0  # 0: any free port
    # Pull missing prefix blocks from (and, with transport redis, push to) Redis; may hold a password.
    redis_url: str | None = field(default=None, repr=False)
    redis_ttl: float = 600.0
    redis_max_memory: str | None = None  # if set, configure the server: maxmemory + allkeys-lru
    encoding: str = "raw"  # raw | int8 (in transit)
    timeout: float = 10.0  # seconds, for every wait
    # The deployment's secret: every transfer message carries an HMAC with it (utils/deployment_secret.py).
    secret: bytes | None = field(default=None, repr=False)
    # Receivers this worker may push to when a request names one (kv_transfer/allowed_receivers.py).
    allowed_receivers: tuple[str, ...] = KV_DEFAULT_ALLOWED_RECEIVERS

    def validate(self) -> None:
        if self.role not in KV_ROLES:
            raise ValueError(f"--role must be one of {', '.join(KV_ROLES)}, got {self.role!r}")
        if self.transport is not None and self.transport not in KV_TRANSPORTS:
            raise ValueError(f"--kv-transfer must be one of {', '.join(KV_TRANSPORTS)}, got {self.transport!r}")
        if self.transport == "redis" and not self.redis_url:
            raise ValueError("--kv-transfer redis needs --redis-url")
        if self.role == "prefill" and self.transport is None:
            raise ValueError("--role prefill needs --kv-transfer tcp|shm|redis")
        if self.encoding not in KV_ENCODINGS:
            raise ValueError(f"--kv-transfer-dtype must be auto or int8, got {self.encoding!r}")
        if not self.timeout > 0:
            raise ValueError("--kv-transfer-timeout must be > 0")

    @property
    def receives(self) -> bool:
        return self.role in ("decode", "both")


def parse_lora_modules(modules: list[str | dict] | None) -> list[tuple[str, str]]:
    """vLLM's --lora-modules entries, `name=path` or a JSON object with "name" and "path" (text or a
    dict), as (name, path) pairs; ValueError for a malformed entry or a name given twice."""
    out: list[tuple[str, str]] = []
    for entry in modules or []:
        if isinstance(entry, str) and entry.lstrip().startswith("{"):
            try:
                entry = json.loads(entry)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules entry is not valid JSON: {e}") from None
        if isinstance(entry, dict):
            name, path = entry.get("name"), entry.get("path")
        elif isinstance(entry, str) and "=" in entry:
            name, path = entry.split("=", 1)
        else:
            raise ValueError(f"--lora-modules takes name=path or a JSON object with name and path, got {entry!r}")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules entry needs a non-empty name and path, got {entry!r}")
        if name in (n for n, _ in out):
            raise ValueError(f"--lora-modules names {name!r} twice")
        out.append((name, path))
    return out
