#!/usr/bin/env bash
# Install hutch into .venv and run its main job on the embedded defaults:
# the daemon (`hutch serve`) on 127.0.0.1:8787 with SQLite and the local provider.
# Extra arguments go to `hutch serve` (e.g. --port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
exec .venv/bin/hutch serve "$@"
