#!/usr/bin/env bash
# Build hutch's in-sandbox agent (src/hutch/providers/agent/go) with Debian's
# Go toolchain, into its cache (keyed by a hash of its source: a changed
# source builds again, an unchanged one is not rebuilt). Installs golang-go
# when it is missing. Usage: scripts/build-agent.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
if ! command -v go >/dev/null 2>&1 && [ ! -x /usr/lib/go/bin/go ]; then
  printf '[agent] installing golang-go\n' >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends golang-go >/dev/null
fi
"$PY" -m hutch.providers.agent
