"""The package's layering (pyproject.toml's import-linter contracts) holds, covers every package,
and the API server's process really loads no model code."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import ferry

ROOT = Path(__file__).resolve().parents[1]


def _contracts() -> list[dict]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]["contracts"]


def test_import_contracts_are_kept():
    code = "from importlinter.cli import lint_imports; raise SystemExit(lint_imports(config_filename='pyproject.toml'))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BROKEN" not in r.stdout and "Contracts: 3 kept, 0 broken." in r.stdout, r.stdout


def test_every_package_has_a_layer():
    """A new package or top-level module must be placed in the layers, or nothing checks it."""
    layers = next(c for c in _contracts() if c["type"] == "layers")["layers"]
    placed = {name.strip().strip("()") for layer in layers for name in layer.split("|")}
    found = {f"ferry.{m.name}" for m in pkgutil.iter_modules(ferry.__path__)}
    assert found == placed, f"not in a layer: {sorted(found - placed)}; no such module: {sorted(placed - found)}"


def test_api_process_imports_no_model_code():
    """What `ferry serve`'s API process imports (the core process imports the rest itself)."""
    forbidden = next(c for c in _contracts() if c["type"] == "forbidden")["forbidden_modules"]
    code = (
        "import sys, ferry.cli, ferry.entrypoints.openai.api_server, ferry.engine.async_llm\n"
        f"bad = [m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in {forbidden!r})]\n"
        "print(sorted(bad))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
