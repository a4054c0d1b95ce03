#!/usr/bin/env bash
# The compiled build, for the suite's run on it (scripts/check.sh):
#   .build/wheel/       this checkout's wheel, compiled with mypyc (SGLANG_GATEWAY_COMPILE=1:
#                       no pure fallback here), rebuilt when gateway/, setup.py, pyproject.toml
#                       or README.md changed;
#   .venv-compiled/     that wheel installed; every other package comes from .venv through a
#                       .pth (only gateway differs; installing the dev tools twice costs a
#                       minute). .venv's editable gateway stays out: its finder is hooked in by
#                       a .pth of its own, which a path added this way does not run;
#   .build/compiled-run/  a copy of tests/ and pyproject.toml, links to the directories the
#                       tests read, and no gateway/: pytest started there imports gateway from
#                       .venv-compiled only, whatever a test's subprocess does with cwd or env.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev scripts/bootstrap.sh
t0=$SECONDS

# The test tree first: scripts/check.sh starts the pure build's tests (which write byte-code
# into tests/) while the wheel builds.
run=.build/compiled-run
rm -rf "$run"
mkdir -p "$run" .cache
tar --exclude=__pycache__ -cf - tests pyproject.toml | tar -C "$run" -xf -
for d in bench config deploy docker docs scripts README.md .cache; do ln -s "../../$d" "$run/$d"; done

wheels=.build/wheel
stamp=$( { find gateway -name '*.py' -o -name py.typed | LC_ALL=C sort
           echo setup.py pyproject.toml README.md; } | xargs sha256sum | sha256sum | cut -c1-16)
if [ "$(cat "$wheels/.stamp" 2>/dev/null)" != "$stamp" ] || ! ls "$wheels"/*.whl >/dev/null 2>&1; then
  rm -rf "$wheels"
  SGLANG_GATEWAY_COMPILE=1 .venv/bin/python -m pip wheel -q --no-deps -w "$wheels" .
  echo "$stamp" >"$wheels/.stamp"
  echo "build-compiled: wheel built in $((SECONDS - t0)) s"
fi
wheel=$(ls "$wheels"/*.whl)

venv=.venv-compiled
[ -x "$venv/bin/python" ] || .venv/bin/python -m venv --without-pip "$venv"  # the same Python as .venv
site() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
site .venv/bin/python >"$(site "$venv/bin/python")/_gateway_deps.pth"
.venv/bin/python -m pip --python "$venv/bin/python" install -q --no-deps --force-reinstall "$wheel"

(cd "$run" && "../../$venv/bin/python" -c 'from gateway import build; print("build-compiled:", build.describe_build())')
echo "build-compiled: ready in $((SECONDS - t0)) s"
