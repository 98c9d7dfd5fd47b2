#!/usr/bin/env bash
# Run every bench in one go (hutch beside the raw floor, as ratios).
# Installs what the benches need: the Docker Engine and test image, and wrk.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure-docker.sh
bash scripts/ensure-sshd.sh
if ! command -v wrk >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wrk >/dev/null
fi
[ -x .venv/bin/python ] || { "${PYTHON:-python3}" -m venv .venv; }
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
bash scripts/build-agent.sh .venv/bin/python >/dev/null
exec .venv/bin/python bench/run.py "$@"
