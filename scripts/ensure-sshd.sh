#!/usr/bin/env bash
# OpenSSH's server binary for the ssh provider's tests. The tests start their
# own sshd (tests/ssh_server.py) on a loopback port with keys made in a temp
# directory; this script only installs the package and never touches the
# machine's own sshd configuration or service.
set -euo pipefail
if [ -x /usr/sbin/sshd ] && command -v ssh-keygen >/dev/null 2>&1 && command -v scp >/dev/null 2>&1; then
  exit 0
fi
echo "[ensure-sshd] installing openssh-server and openssh-client" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# policy-rc.d 101: the package must not start (or enable) the machine's sshd.
policy=/usr/sbin/policy-rc.d
made_policy=
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; made_policy=1
fi
apt-get install -y -qq --no-install-recommends openssh-server openssh-client >/dev/null
if [ -n "$made_policy" ]; then rm -f "$policy"; fi
