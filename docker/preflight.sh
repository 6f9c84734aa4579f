#!/usr/bin/env bash
# Can this host run docker-compose.yml? Checks what an older Docker would otherwise report
# with a message that does not say why (docs/deploy.md, "Requirements"):
#   - Docker Engine 25 or later (API 1.44): healthcheck.start_interval. An older engine fails at
#     once with "can't set healthcheck.start_interval as feature require Docker Engine v25 or later".
#   - Docker Compose v2.20 or later: depends_on.restart (2.17) and the other keys of the file;
#     an older Compose fails with "Additional property ... is not allowed".
#   - gpu profile only: the NVIDIA runtime (NVIDIA Container Toolkit) registered with the engine.
# Usage: bash docker/preflight.sh [cpu|gpu]      (default: cpu). Exit status 0 = ready.
set -u

PROFILE=${1:-cpu}
NEED_ENGINE=25.0.0
NEED_API=1.44
NEED_COMPOSE=2.20.0
ok=1

at_least() {  # version, minimum: true when version >= minimum
  [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" = "$2" ]
}

say() { printf '%s\n' "$*"; }

if ! command -v docker >/dev/null 2>&1; then
  say "FAIL  no docker command on PATH: install Docker Engine $NEED_ENGINE or later"
  exit 1
fi

if ! engine=$(docker version --format '{{.Server.Version}}' 2>/dev/null) || [ -z "$engine" ]; then
  say "FAIL  cannot reach the Docker engine (is it running, and may this user use it?)"
  exit 1
fi
api=$(docker version --format '{{.Server.APIVersion}}' 2>/dev/null)
if at_least "${engine#v}" "$NEED_ENGINE" && at_least "$api" "$NEED_API"; then
  say "ok    Docker Engine $engine (API $api)"
else
  say "FAIL  Docker Engine $engine (API $api): the compose file needs Engine $NEED_ENGINE or later (API $NEED_API)"
  say "      for healthcheck.start_interval; upgrade the engine (https://docs.docker.com/engine/install/)"
  ok=0
fi

if ! compose=$(docker compose version --short 2>/dev/null) || [ -z "$compose" ]; then
  say "FAIL  no 'docker compose' (the Compose v2 plugin): install Compose v$NEED_COMPOSE or later"
  ok=0
elif at_least "${compose#v}" "$NEED_COMPOSE"; then
  say "ok    Docker Compose ${compose#v}"
else
  say "FAIL  Docker Compose ${compose#v}: the compose file needs v$NEED_COMPOSE or later (depends_on.restart,"
  say "      healthcheck.start_interval); upgrade the docker-compose-plugin package"
  ok=0
fi

if [ "$PROFILE" = gpu ]; then
  if docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"nvidia"'; then
    say "ok    NVIDIA container runtime"
  else
    say "FAIL  the engine has no 'nvidia' runtime: install the NVIDIA Container Toolkit and restart Docker"
    ok=0
  fi
fi

if [ "$ok" = 1 ]; then
  say "ready for: docker compose --profile $PROFILE up -d --wait"
  exit 0
fi
exit 1
