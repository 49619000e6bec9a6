#!/usr/bin/env bash
# Download, here, the wheels of ferry's dependencies that the GPU machines' image lacks
# (it has torch 2.11, triton 3.6, transformers, numpy, pytest, httpx ... but not msgspec, pyzmq, gguf, nor
# fastapi / uvicorn and their pydantic, which the CLI imports to build its parser, nor llguidance),
# for their Python 3.12 on x86-64, into .whl/ (git-ignored; the device tool carries it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
for pkg in msgspec pyzmq gguf fastapi starlette pydantic pydantic-core annotated-types typing-inspection \
  opentelemetry-api uvicorn redis llguidance; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$pkg"
done
ls -la .whl
