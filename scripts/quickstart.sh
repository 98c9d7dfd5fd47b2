#!/usr/bin/env bash
# Install hutch into .venv and run its main job on the embedded defaults:
# the daemon (`hutch serve`) on 127.0.0.1:8787 with SQLite, and a token it makes
# for itself in ~/.local/share/hutch/api-token (0600: this user's CLI finds it,
# no other user can). Its operator (whoever runs this) lets its clients use the
# local provider, which runs commands on this host as this user: the quick
# start's sandboxes. Extra arguments go to `hutch serve` (e.g. --port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
exec .venv/bin/hutch serve --allow-provider local "$@"
