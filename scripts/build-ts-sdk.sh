#!/usr/bin/env bash
# Build the TypeScript SDK (clients/typescript): Node.js and npm (Debian's, when
# the machine has none), its devDependencies as its package-lock.json pins them
# (`npm ci`, run again only when the lock changed: node_modules keeps the
# lock's hash), then its sources (dist/) and tests (build/) with tsc,
# incrementally. Several processes may run it at once (pytest's workers): one
# builds while the others wait. Usage: scripts/build-ts-sdk.sh
set -euo pipefail
cd "$(dirname "$0")/../clients/typescript"
log() { printf '[ts-sdk] %s\n' "$*" >&2; }

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  log "installing nodejs and npm"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi

exec 9>.build.lock
flock 9
lock_hash=$(sha256sum package-lock.json | cut -d' ' -f1)
if [ "$(cat node_modules/.hutch-lock-sha256 2>/dev/null || true)" != "$lock_hash" ]; then
  log "npm ci (package-lock.json changed or node_modules missing)"
  npm ci --no-audit --no-fund --loglevel=error >&2
  echo "$lock_hash" > node_modules/.hutch-lock-sha256
fi
node_modules/.bin/tsc -p tsconfig.json
node_modules/.bin/tsc -p tsconfig.test.json
