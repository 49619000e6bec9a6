"""`ferry generate` as a user runs it: a real process printing a streamed completion."""

import json
import os
import subprocess
import sys


def _ferry(*args, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "ferry.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_generate_streams_greedy_completion(smollm, make_engine):
    from ferry.sampling_params import SamplingParams

    proc = _ferry(
        "generate", "The capital of France is", "--max-tokens", "12", "--num-kv-blocks", "64", "--max-model-len", "256",
        "--quantization", "none",  # the fp32 engine below; the default runs the GGUF's blocks as stored
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    engine = make_engine(max_model_len=256)
    engine.add_request("x", "The capital of France is", SamplingParams(temperature=0, max_tokens=12))
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
    assert proc.stdout == text + "\n"


def test_bad_flag_value_is_a_clear_error():
    proc = _ferry("generate", "hi", "--temperature", "-1", "--num-kv-blocks", "8", "--max-model-len", "64")
    assert proc.returncode == 2
    assert "temperature" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_rejects_bad_flags_before_loading():
    for args, word in (
        (["--max-queue-len", "0"], "max_queue_len"),
        (["--block-size", "0"], "block_size"),
        (["/nonexistent/model.gguf"], "does not exist"),
        (["--quantization", "int4"], "quantization must be one of auto, none, gguf, int8"),
        (["--kv-cache-dtype", "fp4"], "kv_cache_dtype must be"),
        (["--port", "99999"], "not a port number"),  # argparse's error: the --port 1 before is overridden
        (["--uvicorn-log-level", "foo"], "invalid choice"),
        (["--max-model", "64"], "unrecognized arguments: --max-model"),  # no abbreviations
        (["--chat-template", "{% if %}"], "--chat-template: line 1"),
        (["--chat-template", "templates/chatml.jinja"], "looks like a file path, but it cannot be opened"),
        (["--enable-log-requests", "--disable-log-requests"], "contradict each other"),
        (["--max-log-len", "-1"], "max_log_len must be >= 0"),
        (["--max-logprobs", "-2"], "max_logprobs must be >= -1"),
    ):
        proc = _ferry("serve", "--port", "1", *args, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert word in proc.stderr and "Traceback" not in proc.stderr


def test_bench_quality_needs_a_quantization():
    proc = _ferry("bench", "quality", timeout=60)
    assert proc.returncode == 2
    assert "--quantization int8" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_without_the_bench_extra_is_a_one_line_error():
    # aiohttp as if not installed (None in sys.modules makes its import fail): `ferry bench serve`
    # names the extra, and other commands (here `ferry serve`) do not import the benchmarks.
    code = (
        "import sys; sys.modules['aiohttp'] = None; from ferry.cli import main; "
        "print(main(['serve', '--port', '1', '--max-queue-len', '0'])); sys.exit(main(['bench', 'serve']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout.strip() == "2", proc.stderr
    assert "max_queue_len" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "ferry: error: `ferry bench serve` needs aiohttp, which is not installed: pip install 'ferry[bench]'"
    )


def test_bench_spec_runs_and_checks_outputs_match(tmp_path):
    """`ferry bench spec` end to end on the bundled model (two short editing prompts' worth of
    tokens each way): the outputs with and without speculation are compared (it exits non-zero
    if they differ) and the JSON has the figures BENCHMARKS.md quotes."""
    out = tmp_path / "spec.json"
    proc = _ferry(
        "bench", "spec", "--workloads", "edit", "--max-tokens", "12", "--rounds", "1", "--json", str(out),
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["workloads"]["edit"]["prompts"]
    assert len(rows) == 5 and all(r["output_tokens"] >= 2 for r in rows)
    assert all(0.0 <= r["copied_share"] <= 1.0 for r in rows)
    assert max(r["copied_share"] for r in rows) > 0.5  # the editing answers copy their prompts
    assert all(r["acceptance_length"] >= 1.0 and r["on_tok_per_s"] > 0 for r in rows)


def test_bench_spec_verify_cost_times_both_step_kinds(tmp_path):
    out = tmp_path / "verify.json"
    proc = _ferry(
        "bench", "spec", "--verify-cost", "--batch-sizes", "1", "2", "--drafts", "3", "--input-len", "16",
        "--output-len", "6", "--rounds", "1", "--json", str(out), timeout=300,  # cache sized by the bench
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    batches = json.loads(out.read_text())["batches"]
    assert [b["batch_size"] for b in batches] == [1, 2]
    assert all(b["steps"]["plain"] > 0 and b["steps"]["verify"] > 0 and b["ratio"] > 0 for b in batches)


def test_bench_abuse_sees_every_hostile_body_refused_and_health_answer(tmp_path):
    """`ferry bench abuse` end to end (server target, short phases): every hostile request got the
    status the hardening promises, and no /health probe or well-behaved completion failed."""
    out = tmp_path / "abuse.json"
    proc = _ferry("bench", "abuse", "--targets", "server", "--duration", "3", "--abusers", "1", "--json", str(out),
                  timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(out.read_text())["results"]["server"]
    for phase in ("quiet", "abused"):
        r = runs[phase]
        assert r["health_ms"]["n"] > 0 and not r["health_errors"], r
        assert r["completion_ms"]["n"] > 0 and not r["completion_errors"], r
    # The server answers 413 as the chunked body passes the cap and closes; the client, still
    # sending, may see the connection reset before it reads the answer.
    want = {"token-ids-30MB": {"400"}, "many-prompts": {"400"}, "text-2M-words": {"400"}, "nested-json": {"400"},
            "chunked-33MB": {"413", "ConnectionResetError"}, "slow-body": {"200"}}  # fmt: skip
    hostile = runs["abused"]["hostile"]
    assert hostile and not runs["quiet"]["hostile"]
    for kind, k in hostile.items():
        assert set(k["statuses"]) <= want[kind], (kind, k["statuses"])
