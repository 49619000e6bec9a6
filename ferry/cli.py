"""The `ferry` command: `ferry generate`, `ferry serve`, `ferry bench ...`."""

from __future__ import annotations

import argparse
import logging
import sys

from ferry.config import EngineArgs


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
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
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        output_kind=RequestOutputKind.DELTA,
    )
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
    from ferry.entrypoints.openai.api_server import serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry", description="ferry: LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

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

    from ferry.entrypoints.openai.api_server import add_serve_args

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(srv)
    EngineArgs.add_cli_args(srv)
    srv.set_defaults(func=cmd_serve)

    from ferry.gateway.main import add_gateway_args, run_gateway

    gw = sub.add_parser("gateway", help="KV-aware router over ferry serve replicas (OpenAI API)")
    add_gateway_args(gw)
    gw.set_defaults(func=run_gateway)

    from ferry.gateway.up import add_up_args, run_up

    up = sub.add_parser("up", help="N ferry serve replicas and a gateway over them, on this machine")
    add_up_args(up)
    up.set_defaults(func=run_up)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from ferry.bench.throughput import add_args as add_throughput_args
    from ferry.bench.throughput import main as throughput_main

    tp = bench_sub.add_parser("throughput", help="offline throughput vs HF transformers static batching")
    add_throughput_args(tp)
    EngineArgs.add_cli_args(tp)
    tp.set_defaults(func=throughput_main)

    from ferry.bench.latency import add_args as add_latency_args
    from ferry.bench.latency import main as latency_main

    lt = bench_sub.add_parser(
        "latency", help="decode time per output token (TPOT) at fixed batch sizes, and the memory bandwidth it reaches"
    )
    add_latency_args(lt)
    EngineArgs.add_cli_args(lt)
    lt.set_defaults(func=latency_main)

    from ferry.bench.serve import add_args as add_serve_bench_args
    from ferry.bench.serve import main as serve_bench_main

    sb = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)")
    add_serve_bench_args(sb)
    sb.set_defaults(func=serve_bench_main)

    from ferry.bench.serve_compare import add_args as add_compare_args
    from ferry.bench.serve_compare import main as compare_main

    sc = bench_sub.add_parser(
        "serve-compare", help="offline LLM.generate vs ferry serve vs llama-server on one workload, in one run"
    )
    add_compare_args(sc)
    EngineArgs.add_cli_args(sc)
    sc.set_defaults(func=compare_main)

    from ferry.bench.route import add_args as add_route_args
    from ferry.bench.route import main as route_main

    rb = bench_sub.add_parser("route", help="gateway routing policies on a multi-tenant workload, in one run")
    add_route_args(rb)
    rb.set_defaults(func=route_main)

    from ferry.bench.pd import add_args as add_pd_args
    from ferry.bench.pd import main as pd_main

    pb = bench_sub.add_parser("pd", help="colocated vs prefill/decode-disaggregated serving under long-prompt arrivals")
    add_pd_args(pb)
    pb.set_defaults(func=pd_main)

    from ferry.bench.quality import add_args as add_quality_args
    from ferry.bench.quality import main as quality_main

    qb = bench_sub.add_parser("quality", help="a quantized model's next-token distributions against fp32")
    add_quality_args(qb)
    EngineArgs.add_cli_args(qb)
    qb.set_defaults(func=quality_main)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # a user mistake: say what to change, no traceback
        print(f"ferry: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
