#!/usr/bin/env bash
# Debian packages the test suite runs for real: redis-server (shared QoS state between proxy
# processes) and chromium (the dashboard's browser test). Installed with apt-get when missing;
# each test starts its own server or browser on a free loopback port. Idempotent.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "tests need the Debian packages: ${need[*]} (run as root, or: sudo apt-get install -y ${need[*]})" >&2
  exit 1
fi
echo "installing ${need[*]} (apt-get)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
