#!/usr/bin/env bash
# Install everything the tests need on a fresh Debian 12 machine, then run them
# all: lint, type check, and the full pytest suite (Docker tests included).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[test %s] %s\n' "$(date +%T)" "$*" >&2; }

# System packages: chattr (e2fsprogs) for permission tests, procps, bubblewrap, and the
# Docker Engine (scripts/ensure-docker.sh installs and starts it).
need=()
command -v chattr >/dev/null 2>&1 || need+=(e2fsprogs)
command -v ps >/dev/null 2>&1 || need+=(procps)
# bubblewrap: the bubblewrap provider's sandboxes (nsenter is util-linux's).
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
# runsc: the gvisor provider's sandboxes (Debian's gVisor build).
command -v runsc >/dev/null 2>&1 || need+=(runsc)
# iptables: docker's network policy, installed in each sandbox's namespace;
# iproute2 (ip): the host's own addresses it blocks; mkfs.ext4 (e2fsprogs):
# size-capped working directories.
command -v iptables-restore >/dev/null 2>&1 || need+=(iptables)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
# PostgreSQL's server: the PostgreSQL store's tests start a throwaway cluster
# of their own (tests/postgres_fixture.py), on a private socket directory.
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need+=(postgresql)
# chromium: the dashboard's browser test (tests/test_dashboard.py) drives Debian's
# build through Playwright, which never downloads a browser of its own here.
command -v chromium >/dev/null 2>&1 || need+=(chromium)
# strace: the SDK's requests are watched reaching the daemon's socket, a write
# at a time (tests/test_client_writes.py).
command -v strace >/dev/null 2>&1 || need+=(strace)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

bash scripts/ensure-docker.sh
# OpenSSH's server for the ssh provider's tests (they run their own sshd).
bash scripts/ensure-sshd.sh

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PY" -m venv .venv
fi
log "installing hutch and its test dependencies"
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1
# uv installs the same set as pip in about a fifth of its time (~17 s against
# ~95 s into a fresh venv here), bytecode compiled as pip does.
.venv/bin/python -m pip install -q --disable-pip-version-check uv
.venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode -e '.[test]'

# mypy needs nothing the steps below make, and most of their time is spent
# waiting on the network, npm or a build: it checks meanwhile.
log "mypy (strict), in the background"
mypy_log=$(mktemp)
.venv/bin/mypy >"$mypy_log" 2>&1 &
mypy_pid=$!

log "the E2B SDKs the E2B wire's tests drive (Python 2.45, npm; cached under .cache)"
bash scripts/ensure-e2b-sdks.sh .venv/bin/python

log "compiling hutch's modules, the tests' and the old E2B SDK's to bytecode, once"
# A run starts some thousand Python processes (daemons, the CLI, the SDKs'
# programs). Where PYTHONDONTWRITEBYTECODE is set (as on these machines) none
# of them writes the bytecode it compiled, so each compiled every module of
# hutch it imported again: ~0.3 s of CPU a daemon start. A .pyc checked by
# its source's mtime stays right while the source is unchanged.
.venv/bin/python -m compileall -q -j 0 src tests bench .cache/e2b-sdks >/dev/null

log "building hutch's agent (Go, cached by its source's hash)"
bash scripts/build-agent.sh .venv/bin/python

log "TypeScript SDK: build, and its wire types current (scripts/gen_ts_types.py --check)"
bash scripts/build-ts-sdk.sh
.venv/bin/python scripts/gen_ts_types.py --check

log "ruff"
.venv/bin/ruff check src tests bench
log "import contracts (docs/architecture.md)"
.venv/bin/lint-imports
log "mypy (strict): its answer"
mypy_ok=0
wait "$mypy_pid" || mypy_ok=$?
cat "$mypy_log"
rm -f "$mypy_log"
[ "$mypy_ok" -eq 0 ]
log "the generated sync faces are up to date (scripts/gen_sync.py)"
.venv/bin/python scripts/gen_sync.py --check
log "pytest"
# Three workers: most of a test's time is spent waiting on the Engine, a
# daemon or a sandbox, not on this machine's two cores (which stand idle
# about 7 % of a run; four workers take that to 4 %, at more load on the
# timing of every test).
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 -n "${HUTCH_TEST_WORKERS:-3}" "$@"
