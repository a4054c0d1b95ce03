#!/usr/bin/env bash
# Build docker/Dockerfile and run what it builds, wherever this machine can run a Docker
# daemon; CI runs it after scripts/check.sh (.ci/run).
#   - the stub and the gateway from the image, read-only root, all capabilities dropped,
#     host network on free loopback ports: both must turn healthy through the image's own
#     HEALTHCHECK, and both must exit 0 on `docker stop` (SIGTERM to PID 1);
#   - a /generate through the gateway: 200 for a top_k mask, 400 for a top_p-only one;
#   - uid/gid 10001, no pip or setuptools anywhere in the image, the OCI labels, and the
#     REVISION build-arg in `sglang-gateway --version` and sglang_gateway_build_info, and
#     both saying the compiled build (mypyc; the build stage fails rather than ship pure);
#   - docker/compose.yaml in Compose v1, which validate-deploy only runs where installed.
# No image registry is needed: unless PYTHON_IMAGE names a base the daemon has or can pull,
# a Debian bookworm base (its Python 3.11) is made here with debootstrap and imported.
# Needs root for what it lacks: apt-get installs docker.io, debootstrap and docker-compose,
# and, when no daemon answers (DOCKER_HOST or the default socket), it starts one of its own
# (private socket, data root $IMAGE_CHECK_STATE, no iptables, no bridge) and stops it at
# the end. What it made is removed at the end, except the base image, kept in that data
# root for the next run. Where no daemon can run it says why and exits 0, unless
# IMAGE_CHECK_REQUIRED=1. The Dockerfile lint (hadolint) is in scripts/validate-deploy.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

STATE=${IMAGE_CHECK_STATE:-/var/lib/sglang-gateway-image-check}
# One run directory per data root, so the lock that guards the data root guards it too; short,
# because containerd's socket path under it must stay under 108 bytes.
RUN_DIR=/run/sglang-gateway-image-check-$(printf '%s' "$STATE" | sha256sum | cut -c1-8)
BASE_LOCAL=sglang-gateway-base:local
IMAGE=sglang-gateway:image-check
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python

t0=$SECONDS
step() { echo "-- $* (+$((SECONDS - t0)) s)"; }
fail() { echo "image-check: FAIL: $*" >&2; exit 1; }
skip() {
  echo "image-check: SKIPPED, the image was not built or run: $*" >&2
  [ "${IMAGE_CHECK_REQUIRED:-0}" = 1 ] && exit 1
  exit 0
}

# --- tools ------------------------------------------------------------------------------

[ "$(uname -s)" = Linux ] || skip "not Linux ($(uname -s))"
daemon_up() { command -v docker >/dev/null && docker info >/dev/null 2>&1; }
needed=()  # without these there is no image check
wanted=()  # without these, only the Compose v1 check is skipped
command -v docker >/dev/null || needed+=(docker.io)
if ! daemon_up; then
  command -v dockerd >/dev/null || needed+=(docker.io)
  command -v flock >/dev/null || needed+=(util-linux)
fi
if [ -z "${PYTHON_IMAGE:-}" ] && ! command -v debootstrap >/dev/null \
  && ! { daemon_up && docker image inspect "$BASE_LOCAL" >/dev/null 2>&1; }; then
  needed+=(debootstrap)
fi
compose_v1() {
  local c
  for c in $(type -ap docker-compose); do
    case "$("$c" version --short 2>/dev/null)" in 1.*) echo "$c"; return ;; esac
  done
}
[ -n "$(compose_v1)" ] || wanted+=(docker-compose)
if [ "$((${#needed[@]} + ${#wanted[@]}))" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    mapfile -t pkgs < <(printf '%s\n' "${needed[@]}" "${wanted[@]}" | sort -u)
    step "apt-get install ${pkgs[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${pkgs[@]}" >/dev/null
  elif [ "${#needed[@]}" -gt 0 ]; then
    skip "missing $(printf '%s\n' "${needed[@]}" | sort -u | tr '\n' ' ')and no root apt-get to install them"
  fi
fi

v1=$(compose_v1)
if [ -n "$v1" ]; then
  step "docker-compose config (Compose v1 $("$v1" version --short))"
  "$v1" -f docker/compose.yaml config --quiet
else
  step "docker-compose config (Compose v1): skipped, not installed and no root apt-get"
fi

# --- daemon -----------------------------------------------------------------------------

dockerd_pid=""
own_run_dir=""
containers=()
tmp=$(mktemp -d)
cleanup() {
  local rc=$?
  set +e
  for c in "${containers[@]}"; do docker rm -f "$c" >/dev/null 2>&1; done
  docker image rm -f "$IMAGE" >/dev/null 2>&1
  if [ -n "$dockerd_pid" ]; then
    # Its own daemon: the build stage's dangling images go too, the base image stays.
    docker image prune -f >/dev/null 2>&1
    kill "$dockerd_pid" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$dockerd_pid" 2>/dev/null
    wait "$dockerd_pid" 2>/dev/null
  fi
  if [ -n "$own_run_dir" ]; then
    # dockerd leaves its namespace bind mounts behind.
    awk -v d="$RUN_DIR/" 'index($2, d) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r umount
    rm -rf --one-file-system "$RUN_DIR"
  fi
  rm -rf "$tmp"
  exit "$rc"
}
trap cleanup EXIT

if docker info >/dev/null 2>&1; then
  step "using the running Docker daemon ($(docker info -f '{{.ServerVersion}}'))"
else
  [ "$(id -u)" = 0 ] || skip "no Docker daemon answers and only root can start one"
  mkdir -p "$STATE"
  # One run at a time per data root: a second dockerd cannot share it. The run directory
  # is made only once the lock is held, because the run before removes it on its way out.
  exec 9>"$STATE/lock"
  flock -w 1800 9 || fail "$STATE/lock still held after 30 min"
  mkdir -p "$RUN_DIR"
  own_run_dir=1
  export DOCKER_HOST="unix://$RUN_DIR/docker.sock"
  why=""
  # overlay2 where the kernel and the backing filesystem allow it, else vfs (slow, but
  # works anywhere). No iptables, no bridge, no forwarding: builds and runs use the host
  # network, so the daemon changes nothing in the host's network set-up.
  for driver in overlay2 vfs; do
    step "starting dockerd (storage driver $driver)"
    dockerd --data-root "$STATE/$driver" --exec-root "$RUN_DIR/exec" \
      --pidfile "$RUN_DIR/dockerd.pid" -H "$DOCKER_HOST" --storage-driver "$driver" \
      --iptables=false --ip-forward=false --bridge=none \
      >"$RUN_DIR/dockerd-$driver.log" 2>&1 &
    dockerd_pid=$!
    for _ in $(seq 120); do
      docker info >/dev/null 2>&1 && break
      kill -0 "$dockerd_pid" 2>/dev/null || break
      sleep 0.5
    done
    docker info >/dev/null 2>&1 && break
    log="$RUN_DIR/dockerd-$driver.log"
    why+="[$driver] $({ grep -E 'level=(fatal|error)' "$log" || tail -n 1 "$log"; } | tail -n 2 | tr '\n' ' ')"
    kill "$dockerd_pid" 2>/dev/null || true
    wait "$dockerd_pid" 2>/dev/null || true
    dockerd_pid=""
  done
  [ -n "$dockerd_pid" ] || skip "dockerd cannot run here: ${why:-no error logged}"
fi

# --- base image -------------------------------------------------------------------------

base=${PYTHON_IMAGE:-$BASE_LOCAL}
if [ -z "${PYTHON_IMAGE:-}" ] && ! docker image inspect "$base" >/dev/null 2>&1; then
  # minbase: only Essential packages and apt, no recommends; passwd (useradd) is among
  # them. Docs, man pages, locales and apt's lists and archives are dropped: nothing in
  # the image reads them.
  step "debootstrap bookworm from $MIRROR"
  root=$(mktemp -d /var/tmp/image-check-base.XXXXXX)
  if ! debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$root" "$MIRROR" >"$tmp/debootstrap.log" 2>&1; then
    tail -n 20 "$tmp/debootstrap.log" >&2
    rm -rf --one-file-system "$root"
    fail "debootstrap failed"
  fi
  rm -rf --one-file-system "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
    "$root"/usr/share/doc "$root"/usr/share/man "$root"/usr/share/info "$root"/usr/share/locale
  # The base trusts what this machine trusts, as a base made for a network with its own CA
  # would: the build stage's pip reaches PyPI through whatever inspects TLS here.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null 2>&1 || fail "update-ca-certificates failed in the base"
  fi
  step "docker import $base"
  tar -C "$root" --numeric-owner -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' - "$base" >/dev/null
  rm -rf --one-file-system "$root"
else
  step "base image $base"
fi

# --- build ------------------------------------------------------------------------------

revision=$(git rev-parse HEAD)
version=$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
source=local/image-check
step "docker build (base $base, revision $revision)"
build_start=$SECONDS
# The classic builder: it works with any daemon and CLI, BuildKit needs buildx beside the
# CLI. The host network, because the daemon may have no bridge; pip reaches PyPI through it.
DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0} docker build -q --force-rm --network host \
  --build-arg PYTHON_IMAGE="$base" --build-arg REVISION="$revision" \
  --build-arg VERSION="$version" --build-arg SOURCE="$source" \
  -f docker/Dockerfile -t "$IMAGE" . >/dev/null
build_s=$((SECONDS - build_start))
size_mib=$(($(docker image inspect -f '{{.Size}}' "$IMAGE") / 1024 / 1024))
echo "   built in $build_s s, $size_mib MiB"

# --- what the image is ------------------------------------------------------------------

step "labels, --version, user, no installers"
label() { docker image inspect -f "{{index .Config.Labels \"org.opencontainers.image.$1\"}}" "$IMAGE"; }
[ "$(label revision)" = "$revision" ] || fail "label revision is '$(label revision)', not $revision"
[ "$(label version)" = "$version" ] || fail "label version is '$(label version)', not $version"
[ "$(label source)" = "$source" ] || fail "label source is '$(label source)', not $source"
said=$(docker run --rm --network none "$IMAGE" --version)
[[ $said == "sglang-gateway $version (revision $revision;"* ]] || fail "--version says: $said"
[[ $said == *"; compiled build)" ]] || fail "the image is no compiled build: $said"
[ "$(docker run --rm --network none --entrypoint id "$IMAGE" -u):$(docker run --rm --network none --entrypoint id "$IMAGE" -g)" = 10001:10001 ] \
  || fail "the image does not run as 10001:10001"
# Anything that could install code: installed pip or setuptools for any interpreter, or a
# pip command. (ensurepip's bundled wheels are stdlib data, and ensurepip cannot write to
# a read-only root as uid 10001.) As root, to see into every directory.
installers=$(docker run --rm --network none --user 0:0 --entrypoint sh "$IMAGE" -c '
  find / -xdev \( -path "*-packages/pip" -o -path "*-packages/pip-*" \
    -o -path "*-packages/setuptools" -o -path "*-packages/setuptools-*" \
    -o -path "*/bin/pip" -o -path "*/bin/pip[0-9]*" -o -path "*/bin/easy_install*" \) -print -prune
  for py in /opt/venv/bin/python "$(readlink -f /opt/venv/bin/python)"; do
    for m in pip setuptools; do "$py" -c "import $m" 2>/dev/null && echo "$py: import $m"; done
  done; true')
[ -z "$installers" ] || fail "installers in the image:"$'\n'"$installers"

# --- running it -------------------------------------------------------------------------

read -r stub_port stub_admin gw_port gw_admin < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
cat >"$tmp/gateway.yaml" <<EOF
listen: {host: 127.0.0.1, port: $gw_port}
admin: {host: 127.0.0.1, port: $gw_admin}
backends:
  static: [http://127.0.0.1:$stub_port]
  health: {interval_s: 1}
logging: {level: info, access_log: true, format: json}
EOF
chmod 755 "$tmp"
chmod 644 "$tmp/gateway.yaml"
run=(docker run -d --network host --read-only --cap-drop ALL
  --security-opt no-new-privileges:true)
stub=image-check-stub-$$
gateway=image-check-gateway-$$
containers=("$stub" "$gateway")
step "docker run: stub on 127.0.0.1:$stub_port, gateway on 127.0.0.1:$gw_port"
# As documented, but on free ports: the host network is shared, so the stub gets its own
# GATEWAY_ADMIN_PORT rather than the image's 8081.
"${run[@]}" --name "$stub" -e GATEWAY_ADMIN_PORT="$stub_admin" --entrypoint sglang-gateway \
  "$IMAGE" stub --host 127.0.0.1 --port "$stub_port" >/dev/null
"${run[@]}" --name "$gateway" -e GATEWAY_ADMIN_PORT="$gw_admin" \
  -v "$tmp/gateway.yaml:/etc/sglang-gateway/gateway.yaml:ro" "$IMAGE" >/dev/null

show() {
  echo "--- $1: docker logs" >&2
  docker logs --tail 30 "$1" >&2 2>&1
  echo "--- $1: health" >&2
  docker inspect -f '{{json .State.Health}}' "$1" >&2
}
healthy() {
  local status
  for _ in $(seq 90); do
    status=$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}} {{.State.Status}}' "$1")
    case "$status" in
      "healthy running") return 0 ;;
      unhealthy* | *exited | *dead | none*) break ;;
    esac
    sleep 1
  done
  show "$1"
  fail "$1 is not healthy ($status)"
}
healthy "$stub"
healthy "$gateway"
step "both healthy"

http() {
  "$PY" - "$@" <<'EOF'
import sys, urllib.error, urllib.request
url, body = sys.argv[1], (sys.argv[2].encode() if len(sys.argv) > 2 else None)
req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        status, text = r.status, r.read().decode()
except urllib.error.HTTPError as e:
    status, text = e.code, e.read().decode()
print(status)
print(text)
EOF
}
expect() {
  local want=$1 out
  shift
  out=$(http "$@")
  [ "${out%%$'\n'*}" = "$want" ] || { show "$gateway"; fail "$1: wanted $want, got: $out"; }
  printf '%s' "${out#*$'\n'}"
}
gw=http://127.0.0.1:$gw_port
for _ in $(seq 30); do
  # Captured whole: a pipe into head would close under the reply and break the writer.
  ready=$(http "http://127.0.0.1:$gw_admin/readyz" || true)
  [ "${ready%%$'\n'*}" = 200 ] && break
  sleep 0.5
done
expect 200 "http://127.0.0.1:$gw_admin/readyz" >/dev/null
expect 200 "$gw/generate" '{"text":"hi","sampling_params":{"top_k":5},"return_sampling_mask":true}' >/dev/null
expect 400 "$gw/generate" '{"text":"hi","sampling_params":{"top_p":0.9},"return_sampling_mask":true}' >/dev/null
metrics=$(expect 200 "http://127.0.0.1:$gw_admin/metrics")
grep -q "^sglang_gateway_build_info{.*revision=\"$revision\"" <<<"$metrics" \
  || fail "sglang_gateway_build_info does not carry revision $revision"
grep -q '^sglang_gateway_build_info{.*build="compiled"' <<<"$metrics" \
  || fail "sglang_gateway_build_info does not say build=\"compiled\""
for c in "$stub" "$gateway"; do
  [ "$(docker exec "$c" id -u):$(docker exec "$c" id -g)" = 10001:10001 ] || fail "$c runs as $(docker exec "$c" id)"
  [ "$(docker inspect -f '{{.HostConfig.ReadonlyRootfs}}' "$c")" = true ] || fail "$c root is writable"
  ! docker exec "$c" sh -c ': >/opt/venv/probe' 2>/dev/null || fail "$c could write to /opt/venv"
done
step "/generate 200 and 400, build_info, 10001:10001, read-only"

step "docker stop (SIGTERM, drain)"
docker stop -t 40 "$gateway" "$stub" >/dev/null
for c in "$gateway" "$stub"; do
  code=$(docker inspect -f '{{.State.ExitCode}}' "$c")
  [ "$code" = 0 ] || { show "$c"; fail "$c exited $code on SIGTERM"; }
done

echo "image-check: ok in $((SECONDS - t0)) s (build $build_s s, image $size_mib MiB)"
