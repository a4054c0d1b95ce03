"""Reading a configuration: YAML file, then environment, then CLI overrides, validated into
the models of gateway/config/models.py; a failure names the field path, the value (never a
credential's) and the reason.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import yaml
from pydantic import SecretStr, ValidationError

from gateway.config.models import RESTART_ONLY, GatewayConfig


class ConfigError(Exception):
    """A config that cannot be used; `str()` lists every problem, one per line."""


def get_dotted(cfg: GatewayConfig, dotted: str) -> object:
    node: object = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _reveal(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, dict):
        return {k: _reveal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_reveal(v) for v in value]
    return value


def to_data(cfg: GatewayConfig) -> dict[str, Any]:
    """The config as plain data that `build` turns back into the same config, secrets
    included (for the --workers snapshot, never for printing)."""
    data: dict[str, Any] = _reveal(cfg.model_dump())
    return data


def restart_only_changes(new: GatewayConfig, running: GatewayConfig) -> list[str]:
    return [key for key in RESTART_ONLY if get_dotted(new, key) != get_dotted(running, key)]


def as_reloaded(new: GatewayConfig, running: GatewayConfig) -> GatewayConfig:
    """What a reload to `new` really runs: `new`, with the restart-only settings still at
    their running values. Anything started later from it (a restarted --workers process)
    then runs the same rules as the ones that reloaded."""
    changed = restart_only_changes(new, running)
    if not changed:
        return new
    data = to_data(new)
    old = to_data(running)
    for key in changed:
        *parents, leaf = key.split(".")
        dst, src = data, old
        for part in parents:
            dst, src = dst[part], src[part]
        dst[leaf] = src[leaf]
    return build(data)


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


# Where a value is a credential: an error there names the key, never the value.
_SECRET_PATHS: Final = (
    ("auth", "keys"),
    ("auth", "upstream_authorization"),
    ("control", "keys"),
    ("tracing", "headers"),
    ("tracing", "endpoint"),  # refused when it carries credentials: then they are in it
    ("state", "etcd"),  # its password
)


_USERINFO: Final = re.compile(r"//[^/@]*@")


def format_errors(exc: ValidationError) -> str:
    """One line per error: the key's path, the value (a scalar outside the credentials;
    a section's whole content, which can hold them, never) and the reason."""
    lines = []
    for err in exc.errors(include_url=False):
        reason = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        loc = err["loc"]
        if err["type"] == "missing":
            shown = "value missing: "
        elif tuple(loc[:2]) in _SECRET_PATHS or isinstance(value, (dict, list)):
            shown = ""
        else:
            # A URL refused for carrying credentials must not print them.
            text = _USERINFO.sub("//***@", repr(value))
            shown = f"value {text[:77] + '...' if len(text) > 80 else text}: "
        lines.append(f"{_loc(loc)}: {shown}{reason}")
    return "\n".join(lines)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """Where a YAML text is broken, without quoting it (it may hold a credential)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or "unreadable"
    hidden = re.sub(r"'[^']*'", "'...'", problem)
    return f"{where} ({hidden})"


def build(data: Mapping[str, Any]) -> GatewayConfig:
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc)) from None


# SGLANG_GATEWAY_LISTEN__PORT=9000 sets listen.port: the prefix, then the key's path with
# "__" between its levels. Only names with "__" after the prefix are read, so the process's
# own variables (SGLANG_GATEWAY_REVISION, the --workers plumbing) and the ones Kubernetes
# sets for a Service named sglang-gateway (SGLANG_GATEWAY_SERVICE_HOST, _PORT...) are never
# taken for config keys.
ENV_PREFIX: Final = "SGLANG_GATEWAY_"

_INT: Final = re.compile(r"[-+]?[0-9]+")
_FLOAT: Final = re.compile(r"[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][-+]?[0-9]+)?")


class _EnvLoader(yaml.SafeLoader):
    """YAML for list and mapping values from the environment, with plain scalars read as
    YAML 1.2 reads them: decimal integers (010 is ten, not eight), no base-60 numbers
    (1:30 stays text), true/false only (not yes/no/on/off), null spelled out (not ~)."""


_EnvLoader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag == "tag:yaml.org,2002:merge"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_EnvLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_EnvLoader.add_implicit_resolver(
    "tag:yaml.org,2002:null", re.compile(r"^(?:null|Null|NULL|)$"), ["n", "N", ""]
)
_EnvLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(rf"^{_INT.pattern}$"), list("-+0123456789")
)
_EnvLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(rf"^{_FLOAT.pattern}$"), list("-+0123456789.")
)
_EnvLoader.add_constructor(
    "tag:yaml.org,2002:int",
    lambda loader, node: int(loader.construct_scalar(node), 10),  # type: ignore[arg-type]
)


def _env_value(raw: str) -> Any:
    """A plain value is taken as it is (a credential with a '#' or ': ' in it stays whole),
    but for true/false, null and decimal numbers; one that starts like a YAML list,
    mapping or quoted string is read as YAML."""
    text = raw.strip()
    if text[:1] in ("[", "{", '"', "'"):
        return yaml.load(text, Loader=_EnvLoader)
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "null":
        return None
    if _INT.fullmatch(text):
        return int(text, 10)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Dotted keys and their values from the environment."""
    out: dict[str, Any] = {}
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :]
        if "__" not in rest or rest.startswith("_"):
            continue
        parts = rest.lower().split("__")
        if not all(parts):
            raise ConfigError(f"{name}: an empty key between '__' separators")
        try:
            value = _env_value(environ[name])
        except yaml.YAMLError as exc:
            raise ConfigError(f"{name}: not a valid YAML value{_yaml_problem(exc)}") from None
        out[".".join(parts)] = value
    return out


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for key in parents:
        child = node.get(key)
        if not isinstance(child, dict):
            child = {}
            node[key] = child
        node = child
    node[leaf] = value


def load(
    path: str | Path | None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> GatewayConfig:
    """Read a YAML file (or nothing), then the environment's keys over it, then the CLI's
    (dotted keys) over both; validate, freeze. `environ` defaults to the process's."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML{_yaml_problem(exc)}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded
    from_env = env_overrides(os.environ if environ is None else environ)
    for dotted, value in from_env.items():
        _set(data, dotted, value)
    for dotted, value in (overrides or {}).items():
        _set(data, dotted, value)
    try:
        return build(data)
    except ConfigError as exc:
        if not from_env:
            raise
        names = ", ".join(ENV_PREFIX + k.upper().replace(".", "__") for k in from_env)
        raise ConfigError(f"{exc}\n(set from the environment: {names})") from None
