"""docs/configuration-reference.md is generated from the config models; these tests fail
when the checked-in file is not what `python -m gateway.config.reference` writes now, and
when the generator loses what it exists to show (every key, its comment, reload/restart)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gateway import config as config_mod
from gateway.config import reference

# The repository root: docs/ sits beside tests/ (also in the compiled build's run directory).
ROOT = Path(__file__).resolve().parents[1]


def test_the_checked_in_reference_is_the_generated_one() -> None:
    checked_in = (ROOT / reference.OUTPUT).read_text(encoding="utf-8")
    assert checked_in == reference.render(), (
        "docs/configuration-reference.md is stale: run python -m gateway.config.reference"
    )


def test_the_check_mode_exits_non_zero_on_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "reference.md"
    assert reference.main(["--check"], stale) == 1  # missing
    stale.write_text("# Configuration reference\n", encoding="utf-8")
    assert reference.main(["--check"], stale) == 1
    assert reference.main([], stale) == 0
    assert reference.main(["--check"], stale) == 0


def _row(text: str, key: str) -> list[str]:
    rows = [line for line in text.splitlines() if line.startswith(f"| `{key}` |")]
    assert len(rows) == 1, key
    return [cell.strip() for cell in rows[0].strip("|").split(" | ")]


def _keys(model: type, prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        out.append(key)
        out += [k for m in reference._models_in(field.annotation) for k in _keys(m, f"{key}.")]
    return out


def test_every_key_has_one_row_with_its_type_default_and_comment() -> None:
    text = reference.render()
    keys = _keys(config_mod.GatewayConfig)
    assert len(keys) > 100
    for key in keys:
        _row(text, key)
    # The comment above the field in models.py is its description.
    assert "SO_REUSEPORT" in _row(text, "listen.workers")[4]
    assert _row(text, "listen.port")[2] == "`8080`"
    assert _row(text, "backends")[2] == "required"


def test_restart_only_settings_say_restart_and_the_others_reload() -> None:
    text = reference.render()
    for key in config_mod.RESTART_ONLY:
        assert _row(text, key)[3] == "restart", key
    assert _row(text, "listen.host")[3] == "restart"  # under a restart-only section
    assert _row(text, "backends.balancer")[3] == "reload"


def test_the_module_runs_as_a_script() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.config.reference", "--check"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
