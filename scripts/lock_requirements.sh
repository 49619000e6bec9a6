#!/usr/bin/env bash
# Write deploy/docker/requirements.lock: the exact versions of ferry's runtime dependencies, as pip
# resolves them today for the pins of scripts/install.sh (torch 2.13.0, triton 3.6.0), minus ferry,
# torch and triton themselves (each image installs its own torch build: CPU or CUDA). The images
# install with `-c requirements.lock`, so an image built next month gets the same packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
report=$(mktemp)
trap 'rm -f "$report"' EXIT
"$PY" -m pip install -q --disable-pip-version-check --dry-run --ignore-installed --report "$report" \
  torch==2.13.0 triton==3.6.0 . 2>/dev/null
"$PY" - "$report" >deploy/docker/requirements.lock <<'PY'
import json, sys

report = json.load(open(sys.argv[1]))
print("# ferry's runtime dependencies, pinned: written by scripts/lock_requirements.sh (do not edit)")
skip = {"ferry", "torch", "triton"}
for item in sorted(report["install"], key=lambda i: i["metadata"]["name"].lower()):
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if name.lower() not in skip:
        print(f"{name}=={version}")
PY
echo "wrote deploy/docker/requirements.lock ($(grep -vc '^#' deploy/docker/requirements.lock) packages)"
