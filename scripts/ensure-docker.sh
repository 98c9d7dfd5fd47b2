#!/usr/bin/env bash
# Make a Docker Engine and hutch's test image available on this machine.
#
# Idempotent: installs docker.io if missing, starts dockerd if it is not
# answering, and imports the test image (a Debian bookworm minbase rootfs made
# with debootstrap, since image registries are unreachable here) unless the
# engine already has it. The rootfs tarball is cached so that a fresh engine
# re-imports it in seconds instead of re-running debootstrap.
set -euo pipefail

IMAGE="${HUTCH_TEST_IMAGE:-hutch-test:bookworm}"
CACHE_DIR="${HUTCH_CACHE_DIR:-/var/cache/hutch}"
ROOTFS_TAR="$CACHE_DIR/bookworm-minbase.tar"

log() { printf '[ensure-docker] %s\n' "$*" >&2; }

apt_install() {
  if [ -z "${_apt_updated:-}" ]; then
    apt-get update -qq
    _apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

if ! command -v dockerd >/dev/null 2>&1; then
  log "installing docker.io"
  apt_install docker.io
fi

if ! docker info >/dev/null 2>&1; then
  log "starting dockerd"
  mkdir -p /var/log
  nohup dockerd >/var/log/hutch-dockerd.log 2>&1 &
  for _ in $(seq 1 120); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  docker info >/dev/null 2>&1 || { log "dockerd did not start; see /var/log/hutch-dockerd.log"; tail -20 /var/log/hutch-dockerd.log >&2; exit 1; }
fi

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  log "image $IMAGE present"
  exit 0
fi

if [ ! -s "$ROOTFS_TAR" ]; then
  command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap
  mkdir -p "$CACHE_DIR"
  work=$(mktemp -d /var/tmp/hutch-rootfs.XXXXXX)
  trap 'rm -rf "$work"' EXIT
  log "building a bookworm minbase rootfs with debootstrap (about 30 s)"
  # procps gives ps/pkill for users; python3 is for hutch's in-sandbox agent.
  debootstrap --variant=minbase --include=procps,python3-minimal bookworm "$work/rootfs" >/dev/null
  # TLS inside the container needs the host's CA bundle.
  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    mkdir -p "$work/rootfs/etc/ssl/certs"
    cp /etc/ssl/certs/ca-certificates.crt "$work/rootfs/etc/ssl/certs/"
  fi
  rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb
  tar -C "$work/rootfs" -cf "$ROOTFS_TAR.tmp" .
  mv "$ROOTFS_TAR.tmp" "$ROOTFS_TAR"
fi

log "importing $IMAGE"
docker import --change 'CMD ["/bin/bash"]' "$ROOTFS_TAR" "$IMAGE" >/dev/null
log "image $IMAGE ready"
