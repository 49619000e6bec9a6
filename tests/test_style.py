"""The code keeps pyproject.toml's ruff rules and format (ruff is pinned in the test extra, so a new ruff
release cannot fail a clean checkout)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["ferry", "tests", "scripts"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args, *PATHS], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_ruff_check_passes():
    r = _ruff("check", "--output-format", "concise")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_is_kept():
    r = _ruff("format", "--check")
    assert r.returncode == 0, r.stdout + r.stderr
