#!/usr/bin/env bash
# The unmodified E2B SDKs the E2B-wire tests drive (tests/test_e2b_sdk.py):
# the current Python one comes with the test extra (pyproject.toml); an older
# Python one (2.45, which checks the key's format and uses the v1 routes) goes
# to its own target directory, and the npm one under node. Both are cached
# under .cache/e2b-sdks (ignored by git; a clean clone makes it again).
# Usage: scripts/ensure-e2b-sdks.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
CACHE=.cache/e2b-sdks
PY_OLD=2.45.1
NPM_VERSION=2.51.0
log() { printf '[e2b-sdks] %s\n' "$*" >&2; }

if [ ! -f "$CACHE/py-$PY_OLD/.done" ]; then
  log "installing e2b $PY_OLD (Python) into $CACHE/py-$PY_OLD"
  rm -rf "$CACHE/py-$PY_OLD"
  "$PY" -m pip install -q --disable-pip-version-check --no-compile \
    --target "$CACHE/py-$PY_OLD" "e2b==$PY_OLD"
  touch "$CACHE/py-$PY_OLD/.done"
fi

if command -v npm >/dev/null 2>&1; then
  if [ ! -f "$CACHE/node/node_modules/e2b/package.json" ] \
     || ! grep -q "\"version\": \"$NPM_VERSION\"" "$CACHE/node/node_modules/e2b/package.json"; then
    log "installing npm e2b@$NPM_VERSION into $CACHE/node"
    mkdir -p "$CACHE/node"
    [ -f "$CACHE/node/package.json" ] || echo '{"private": true}' > "$CACHE/node/package.json"
    npm install --silent --no-audit --no-fund --prefix "$CACHE/node" "e2b@$NPM_VERSION" >/dev/null
  fi
else
  log "npm not found: the JavaScript SDK's cases will fail (install Node 20 and npm)"
fi
