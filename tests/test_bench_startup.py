"""`ferry bench startup` end to end: a real `ferry serve` started and measured, and the phases it reports.
(Its cold run, with empty compile caches, would rebuild the C++ kernels for minutes: left to the bench.)"""

from __future__ import annotations

import json

from ferry.cli import main


def test_bench_startup_reports_each_phase(tmp_path, capsys):
    out = tmp_path / "startup.json"
    assert main(["bench", "startup", "--no-cold", "--runs", "1", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["kind"] for r in runs] == ["warm"]
    for r in runs:
        assert r["wall"] > 0 and {"api_process_start", "core_process_start", "load_weights", "warm_up"} <= set(r)
        assert r["total"] <= r["wall"] + 0.5  # the server's own clock against the launcher's
    assert "warm: median" in capsys.readouterr().out
