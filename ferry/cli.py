"""The `ferry` command: `ferry generate`, `ferry serve`, `ferry bench ...`."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys
from collections.abc import Iterator

from ferry.config import EngineArgs

# `ferry generate`'s sampling flags: (flag, SamplingParams field, type, default, help).
# --sampling-seed, not --seed: EngineArgs has a --seed of its own.
SAMPLING_FLAGS = (
    ("--max-tokens", "max_tokens", int, 128, None),
    ("--temperature", "temperature", float, 0.0, None),
    ("--top-p", "top_p", float, 1.0, None),
    ("--top-k", "top_k", int, 0, None),
    ("--min-p", "min_p", float, 0.0, None),
    ("--repetition-penalty", "repetition_penalty", float, 1.0, None),
    ("--sampling-seed", "seed", int, None, "per-request seed"),
)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    for flag, _, kind, default, help in SAMPLING_FLAGS:
        g.add_argument(flag, type=kind, default=default, help=help)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _parse_token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--prompt-token-ids must be integers separated by commas or spaces, got {text!r}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from ferry.engine.llm_engine import LLMEngine
    from ferry.sampling_params import RequestOutputKind, SamplingParams

    engine_args = EngineArgs.from_cli_args(args)  # validate everything before loading the model
    sampling = {field: getattr(args, _dest(flag)) for flag, field, *_ in SAMPLING_FLAGS}
    params = SamplingParams(**sampling, stop=args.stop, output_kind=RequestOutputKind.DELTA)
    token_ids = _parse_token_ids(args.prompt_token_ids) if args.prompt_token_ids is not None else None
    if (args.prompt is None) == (token_ids is None):
        raise ValueError("give either a PROMPT or --prompt-token-ids")
    if args.chat and token_ids is not None:
        raise ValueError("--chat needs a text PROMPT, not --prompt-token-ids")
    engine = LLMEngine(engine_args)
    if args.chat:
        tok = engine.tokenizer
        if tok is None:
            raise ValueError("--chat needs a tokenizer; this model has none (send --prompt-token-ids)")
        ids = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompt = {"prompt_token_ids": list(ids)}
    elif token_ids is not None:
        prompt = {"prompt_token_ids": token_ids}
    else:
        prompt = args.prompt
    engine.add_request("cli", prompt, params)
    finish = None
    # Without a tokenizer (--load-format dummy) there is no text: print the token ids.
    as_ids = engine.tokenizer is None
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                sys.stdout.write("".join(f"{t} " for t in c.token_ids) if as_ids else c.text)
                sys.stdout.flush()
                finish = c.finish_reason or finish
    sys.stdout.write("\n")
    logging.getLogger("ferry").info("finish_reason=%s", finish)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.node_rank > 0:  # a worker node of a multi-node engine: its ranks only, no HTTP
        from ferry.worker.tp_worker import run_worker_node

        return run_worker_node(EngineArgs.from_cli_args(args))
    from ferry.entrypoints.openai.serve_command import serve

    return serve(args)


# `ferry bench NAME`: (name, module with add_args(parser) and main(args) -> exit code,
# whether it also takes the engine's flags, help).
BENCHMARKS = (
    ("throughput", "ferry.bench.throughput", True, "offline throughput vs HF transformers static batching"),
    ("latency", "ferry.bench.latency", True,
     "decode time per output token (TPOT) at fixed batch sizes, and the memory bandwidth it reaches"),
    ("serve", "ferry.bench.serve", False, "load-test an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)"),
    ("serve-compare", "ferry.bench.serve_compare", True,
     "offline LLM.generate vs ferry serve vs llama-server on one workload, in one run"),
    ("route", "ferry.bench.route", False, "gateway routing policies on a multi-tenant workload, in one run"),
    ("pd", "ferry.bench.pd", False,
     "colocated vs prefill/decode-disaggregated serving under long-prompt arrivals"),
    ("quality", "ferry.bench.quality", True, "a quantized model's next-token distributions against fp32"),
    ("spec", "ferry.bench.spec", True,
     "single-stream decode with and without speculative decoding, on editing and chat prompts"),
    ("structured", "ferry.bench.structured", True,
     "JSON-schema requests against the same unconstrained, and grammar compile times"),
    ("embeddings", "ferry.bench.embeddings", True,
     "/v1/embeddings requests/s and p99 at a concurrency, dynamic batching off and on"),
    ("moe", "ferry.bench.moe", False,
     "mixture-of-experts decode time per token against a dense model with the same active parameters"),
    ("mla", "ferry.bench.mla", False,
     "multi-head latent attention's KV bytes per token and batch decode tok/s at long context against GQA"),
    ("pipeline", "ferry.bench.pipeline", True,
     "pipeline-parallel tok/s, stages overlapped by micro-batches or taking turns, beside one process"),
    ("lora", "ferry.bench.lora", True,
     "serving LoRA adapters against the base model: one adapter for all requests, and a mix of them"),
    ("window", "ferry.bench.window", False,
     "a request far longer than its sliding window, in a KV cache sized for a little more than the window"),
    ("startup", "ferry.bench.startup", False,
     "seconds from `ferry serve`'s launch to /ready, phase by phase, cold caches then warm"),
    ("abuse", "ferry.bench.abuse", False,
     "/health and a client's latency while other clients send hostile bodies, server and gateway"),
)  # fmt: skip

# The packages of the `bench` extra (pyproject.toml), which a core install lacks.
BENCH_EXTRA = ("aiohttp", "matplotlib")


class MissingExtraError(Exception):
    """A command needs an optional dependency that is not installed."""


@contextlib.contextmanager
def _needs_bench_extra(command: str) -> Iterator[None]:
    """A package of the `bench` extra missing in the block becomes a one-line error."""
    try:
        yield
    except ImportError as e:
        if e.name not in BENCH_EXTRA:  # only the package itself missing, not an error inside it
            raise
        raise MissingExtraError(
            f"`{command}` needs {e.name}, which is not installed: pip install 'ferry[bench]'"
        ) from None


class _LazyParser(argparse.ArgumentParser):
    """The parser of a command whose module is heavy (`ferry bench NAME`, `train-draft`, `gateway`,
    `up`): imports the module, adds its flags (its `add_args`) and sets its `main` only when that
    subcommand is parsed, so no other command imports it: ferry.bench needs the `bench` extra,
    train-draft imports torch, the gateway FastAPI, and `ferry serve` spawns its engine core
    before importing anything of the kind (serve_command.py). Without a module, a plain parser."""

    def __init__(self, *args, module: str | None = None, takes_engine_args: bool = False,
                 add_args: str = "add_args", main: str = "main", **kwargs) -> None:  # fmt: skip
        kwargs.setdefault("allow_abbrev", False)  # `--max-model 1024` is a typo, not --max-model-len
        super().__init__(*args, **kwargs)
        self._module, self._takes_engine_args, self._loaded = module, takes_engine_args, module is None
        self._add_args, self._main = add_args, main

    def parse_known_args(self, args=None, namespace=None):
        if not self._loaded:
            self._load()
        return super().parse_known_args(args, namespace)

    def _load(self) -> None:
        with _needs_bench_extra(self.prog):
            bench = importlib.import_module(self._module)
        getattr(bench, self._add_args)(self)
        if self._takes_engine_args:
            EngineArgs.add_cli_args(self)

        def run(args: argparse.Namespace) -> int:
            with _needs_bench_extra(self.prog):  # matplotlib is imported only to plot
                return getattr(bench, self._main)(args)

        self.set_defaults(func=run)
        self._loaded = True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry", description="ferry: LLM inference engine", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_LazyParser)

    gen = sub.add_parser("generate", help="stream a completion of PROMPT to the terminal")
    gen.add_argument("prompt", nargs="?", default=None)
    gen.add_argument(
        "--prompt-token-ids", default=None, metavar="IDS", help="the prompt as token ids instead, e.g. '1,2,3'"
    )
    gen.add_argument(
        "--model",
        default=None,
        help="a .gguf file or HF model directory (default: bundled SmolLM2); with --load-format dummy, "
        "also a config-only directory or a shipped config name (qwen3-0.6b, llama-3.1-8b, qwen2.5-7b)",
    )
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_sampling_args(gen)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)

    from ferry.entrypoints.openai.serve_command import add_serve_args

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(srv)
    EngineArgs.add_cli_args(srv)
    srv.set_defaults(func=cmd_serve)

    sub.add_parser("gateway", help="KV-aware router over ferry serve replicas (OpenAI API)",
                   module="ferry.gateway.main", add_args="add_gateway_args", main="run_gateway")  # fmt: skip
    sub.add_parser("up", help="N ferry serve replicas and a gateway over them, on this machine",
                   module="ferry.gateway.up", add_args="add_up_args", main="run_up")  # fmt: skip

    sub.add_parser("train-draft", help="train Medusa heads for speculative decoding on the model's own answers",
                   module="ferry.tools.train_draft", takes_engine_args=True)  # fmt: skip

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, parser_class=_LazyParser)
    for name, module, takes_engine_args, help in BENCHMARKS:
        bench_sub.add_parser(name, help=help, module=module, takes_engine_args=takes_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # `ferry bench NAME` imports its module here
        return args.func(args)
    except (ValueError, FileNotFoundError, MissingExtraError) as e:  # a user mistake: say what to change
        print(f"ferry: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
