#!/usr/bin/env bash
# Debian packages the test suite runs for real: redis-server (shared QoS state between proxy
# processes), chromium (the dashboard's browser test), prometheus (promtool checks the
# alert rules; a Prometheus server runs the dashboard's and the rules' queries), and lua5.1
# with lua-check (luac5.1 -p and luacheck lint the Redis scripts, proxy/shared/lua/). Installed
# with apt-get when missing; each test starts its own server or browser on a free loopback
# port. Idempotent.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
{ command -v promtool && command -v prometheus; } >/dev/null 2>&1 || need+=(prometheus)
command -v luac5.1 >/dev/null 2>&1 || need+=(lua5.1)
command -v luacheck >/dev/null 2>&1 || need+=(lua-check)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "tests need the Debian packages: ${need[*]} (run as root, or: sudo apt-get install -y ${need[*]})" >&2
  exit 1
fi
# Debian's redis-server and prometheus packages start (and enable) their servers, on 6379
# and 9090: forbid service starts during the install (policy-rc.d, which invoke-rc.d and
# deb-systemd-invoke obey) and disable the units of what was installed here. The tests
# start their own.
guard=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
  guard=1
fi
trap '[ -z "$guard" ] || rm -f /usr/sbin/policy-rc.d' EXIT
echo "installing ${need[*]} (apt-get)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
if [ -d /run/systemd/system ]; then
  for pkg in "${need[@]}"; do  # only the servers this run installed
    case "$pkg" in redis-server|prometheus) systemctl disable --now "$pkg" >/dev/null 2>&1 || true ;; esac
  done
fi
