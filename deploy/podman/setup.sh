#!/usr/bin/env bash
# Podman as the engine behind docker-compose, as root, on a host where it needs help.
# Idempotent (run it any number of times):
#   1. /etc/containers/containers.conf.d/50-rlmesh.conf: no default rlimits (a sandbox that
#      forbids raising RLIMIT_NOFILE makes runc fail with "error setting rlimit type 7"),
#      cgroupfs and file events (no systemd needed).
#   2. Podman's Docker-compatible API on $SOCKET (`podman system service`), unless it answers.
#   3. Without systemd, Podman runs no health checks by itself (it schedules them as systemd
#      timers); a loop then runs `podman healthcheck run` on every running container each
#      $HEALTH_INTERVAL seconds, so that compose's health checks and `depends_on:
#      service_healthy` work.
# Then: DOCKER_HOST=unix://$SOCKET docker-compose ...   (make compose-up does it)
set -euo pipefail
SOCKET=${PODMAN_SOCKET:-/run/podman/podman.sock}
STATE=${RLMESH_PODMAN_STATE:-/run/rlmesh-podman}
HEALTH_INTERVAL=${HEALTH_INTERVAL:-5}

command -v podman >/dev/null || { echo "podman is not installed (apt-get install podman)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "deploy/podman/setup.sh configures rootful Podman: run it as root" >&2; exit 1; }
mkdir -p /etc/containers/containers.conf.d "$STATE" "$(dirname "$SOCKET")"
conf=/etc/containers/containers.conf.d/50-rlmesh.conf
cat >"$conf.new" <<'CONF'
# Written by rlmesh's deploy/podman/setup.sh.
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
mv "$conf.new" "$conf"

# The API answers /_ping (python3: curl may be missing).
ping() {
  python3 - "$SOCKET" <<'PY' >/dev/null 2>&1
import socket, sys
s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect(sys.argv[1])
s.sendall(b"GET /_ping HTTP/1.0\r\nHost: d\r\n\r\n")
assert s.recv(64).split()[1] == b"200"
PY
}
alive() { [ -f "$STATE/$1.pid" ] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null; }

if ! ping; then
  alive api && kill "$(cat "$STATE/api.pid")" || true
  rm -f "$SOCKET"
  # (from /: a service left running in a directory that is later deleted, say a CI checkout,
  # fails every container start with "write child: broken pipe")
  (cd / && exec setsid podman system service --time=0 "unix://$SOCKET" >"$STATE/api.log" 2>&1 </dev/null) &
  echo $! >"$STATE/api.pid"
  for _ in $(seq 100); do
    ping && break
    sleep 0.1
  done
  ping || { cat "$STATE/api.log" >&2; exit 1; }
  echo "podman API on unix://$SOCKET (log: $STATE/api.log)"
fi

if [ ! -d /run/systemd/system ] && ! alive health; then
  cd /
  setsid bash -c "while sleep $HEALTH_INTERVAL; do
      for c in \$(podman ps -q --filter health=starting --filter health=healthy --filter health=unhealthy); do
        podman healthcheck run \"\$c\" >/dev/null 2>&1 || true
      done
    done" >"$STATE/health.log" 2>&1 </dev/null &
  echo $! >"$STATE/health.pid"
  echo "no systemd: health checks run every ${HEALTH_INTERVAL} s by a loop (pid $(cat "$STATE/health.pid"))"
fi
