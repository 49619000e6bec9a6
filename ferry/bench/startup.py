"""`ferry bench startup`: seconds from `ferry serve`'s launch to /ready, phase by phase, cold and warm.

Each run starts a real `ferry serve` process, polls /ready, then reads the phases the server measured
itself from /ferry/info (`startup_seconds`): the API process's start (interpreter, imports, arguments,
until it spawns the engine core), the core process's start (interpreter and imports), weight loading,
KV-cache sizing and allocation (CUDA graphs included), the warm-up pass, and the tokenizer (loaded in
the API process meanwhile). The first run is cold: the compile caches ($TORCH_EXTENSIONS_DIR: ferry's
C++ CPU kernels, $TRITON_CACHE_DIR) and ferry's cache ($FERRY_CACHE_DIR: converted GGUF tokenizers)
start empty, in a temporary directory; the next runs reuse what it left (warm). The OS page cache is
warm for the weights after the first run either way (dropping it needs root).

Then the first two requests after /ready: each a prompt of `--prompt-tokens` token ids (different from
the first id: no prefix shared) and one output token, timed by the client. Ready is meant as ready to
serve at speed, so what the warm-up leaves to the first request shows as the first's excess over the
second's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from ferry.utils.network import handed_over, reserve_port

PHASES = ("api_process_start", "core_process_start", "load_weights", "kv_cache", "warm_up", "tokenizer")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="what `ferry serve` serves (default: the bundled SmolLM2 GGUF)")
    p.add_argument("--runs", type=int, default=3, help="warm runs after the cold one")
    p.add_argument("--no-cold", action="store_true", help="skip the cold run (reuse this machine's caches)")
    p.add_argument("--serve-args", default="", help="more `ferry serve` flags, as one string")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one start may take")
    p.add_argument("--json", default=None, help="write every run's figures here")
    p.add_argument("--prompt-tokens", type=int, default=512,
                   help="the two requests timed after /ready: prompt length in tokens (0: none)")  # fmt: skip


def start_once(model: str | None, serve_args: list[str], env: dict[str, str], timeout: float,
               prompt_tokens: int = 0) -> dict:  # fmt: skip
    """One `ferry serve` from launch to /ready: the wall time and the server's own phases; then, with
    `prompt_tokens`, the seconds of the first and second requests (`first_request`, `second_request`)."""
    sock, port = reserve_port()  # held until the server has it (--fd): no other process can take the port
    cmd = [sys.executable, "-m", "ferry.cli", "serve", *([model] if model else []), "--host", "127.0.0.1",
           "--port", str(port), *serve_args]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    t0 = time.perf_counter()
    with handed_over(cmd, sock) as (cmd, fds):
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=fds)
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"ferry serve exited with {proc.returncode}:\n{log.read().decode()[-3000:]}")
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"ferry serve was not ready after {timeout:.0f}s")
            try:
                with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        with urllib.request.urlopen(url + "/ferry/info", timeout=10) as r:
            info = json.load(r)
        result = {"wall": wall, **info["startup_seconds"]}
        if prompt_tokens > 0:
            n = min(prompt_tokens, info["max_model_len"] - 1)
            key = _flag_value(serve_args, "--api-key")
            try:
                for name, first_id in (("first_request", 100), ("second_request", 101)):
                    prompt = [first_id + (i * 7919) % 899 for i in range(n)]
                    result[name] = _time_request(url, info["models"][0], prompt, key, timeout)
            except OSError as e:  # (urllib's HTTPError too) the start's figures stand; the requests' do not
                result["request_error"] = str(e)
        return result
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of `flag` among `ferry serve`'s arguments (`--flag V` or `--flag=V`; the last wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _time_request(url: str, model: str, prompt: list[int], api_key: str | None, timeout: float) -> float:
    """Seconds for one completion of `prompt` (token ids, all below 1,000: in any vocabulary), one token out."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(url + "/v1/completions", body, headers)
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout) as r:
        r.read()
    return time.perf_counter() - t0


def main(args: argparse.Namespace) -> int:
    serve_args = args.serve_args.split()
    root = tempfile.mkdtemp(prefix="ferry-bench-startup-")
    env = dict(os.environ)
    if not args.no_cold:  # empty caches for the first run, kept for the next
        env.update(FERRY_CACHE_DIR=os.path.join(root, "ferry"), TORCH_EXTENSIONS_DIR=os.path.join(root, "torch_ext"),
                   TRITON_CACHE_DIR=os.path.join(root, "triton"))  # fmt: skip
    runs = []
    try:
        kinds = ([] if args.no_cold else ["cold"]) + ["warm"] * args.runs
        for kind in kinds:
            r = start_once(args.model, serve_args, env, args.timeout, args.prompt_tokens)
            r["kind"] = kind
            runs.append(r)
            parts = "  ".join(f"{p} {r[p]:6.2f}" for p in PHASES if p in r)
            after = ""
            if "second_request" in r:
                after = (f"; {args.prompt_tokens}-token prompts after: first {r['first_request']:.3f} s, "
                         f"second {r['second_request']:.3f} s")  # fmt: skip
            elif "request_error" in r:
                after = f"; the requests after failed: {r['request_error']}"
            print(f"{kind}: ready after {r['wall']:6.2f} s  ({parts}){after}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    warm = [r for r in runs if r["kind"] == "warm"]
    if warm:
        print(f"warm: median {statistics.median(r['wall'] for r in warm):.2f} s to /ready over {len(warm)} runs; "
              "median per phase: " + ", ".join(f"{p} {statistics.median(r[p] for r in warm):.2f}"
                                               for p in (*PHASES, "first_request", "second_request")
                                               if all(p in r for r in warm)))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model or "bundled SmolLM2 GGUF", "serve_args": serve_args, "runs": runs}, f,
                      indent=1)  # fmt: skip
    return 0
