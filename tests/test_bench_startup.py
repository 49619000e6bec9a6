"""`ferry bench startup` end to end: a real `ferry serve` started and measured, and the phases it reports.
(Its cold run, with empty compile caches, would rebuild the C++ kernels for minutes: left to the bench.)"""

from __future__ import annotations

import json

from ferry.cli import main


def test_bench_startup_reports_each_phase(tmp_path, capsys):
    out = tmp_path / "startup.json"
    # Behind a key, which the timed requests after /ready carry (a 401 would leave them out)
    assert main(["bench", "startup", "--no-cold", "--runs", "1", "--json", str(out), "--serve-args",
                 "--api-key sekret"]) == 0  # fmt: skip
    runs = json.loads(out.read_text())["runs"]
    assert [r["kind"] for r in runs] == ["warm"]
    for r in runs:
        assert r["wall"] > 0 and {"api_process_start", "core_process_start", "load_weights", "warm_up"} <= set(r)
        assert r["total"] <= r["wall"] + 0.5  # the server's own clock against the launcher's
        assert r["first_request"] > 0 and r["second_request"] > 0  # two 512-token prompts, served
    out = capsys.readouterr().out
    assert "warm: median" in out and "512-token prompts after: first" in out


def test_the_engine_core_imports_no_compiler():
    """torch._dynamo (and sympy, triton beneath it) cost ~3 s of every core's start, and no engine
    path uses them: one import of torch.nn.attention.bias by the MLA layer had pulled them all in."""
    import subprocess
    import sys

    code = ("import sys, ferry.engine.core_proc; "
            "print(sorted(m for m in ('torch._dynamo', 'sympy', 'torch._inductor') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
