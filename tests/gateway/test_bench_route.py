"""`ferry bench route` end to end on a tiny workload (its figures are in BENCHMARKS.md)."""

import json
import subprocess
import sys


def test_bench_route_runs_every_policy_and_the_skewed_mix(tmp_path):
    out = tmp_path / "route.json"
    cmd = [sys.executable, "-m", "ferry.cli", "bench", "route", "--replicas", "2", "--tenants", "2",
           "--prefix-len", "48", "--num-requests", "8", "--concurrency", "2", "--max-tokens", "2",
           "--replica-kv-blocks", "32", "--policies", "round-robin", "kv-aware", "--skew", "0.75",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kv-aware vs round-robin" in proc.stdout and "busiest replica served" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == ["round-robin", "kv-aware", "round-robin, skewed 75%", "kv-aware, skewed 75%"]
    for r in runs:
        assert r["ok"] == 8 and r["failed"] == 0
        assert 0.0 <= r["hit_rate"] <= 1.0 and abs(sum(r["share"].values()) - 1.0) < 1e-9
    # Two tenants, each with a 3-block prefix: kv-aware keeps each on one replica and hits its cache.
    assert runs[1]["hit_rate"] > 0.5
