"""The configuration's schema: frozen pydantic models, one per YAML section.

A typo in a gateway's config is an outage, so unknown keys are errors and every value is
checked at start-up. Defaults are chosen for LLM traffic: long time-to-first-byte (prefill
of a 100k-token prompt takes time), large bodies (RL rollouts send token-id lists), no
total deadline. The comment above a field is its documentation: gateway/config/reference.py
turns these comments into docs/configuration-reference.md.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from gateway.config.tls import client_context
from gateway.contract.lax import TOP_K_ALL
from gateway.contract.profiles import MaskProfile, pinned
from gateway.contract.routes import GENERATION_ROUTES, canonical_path


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def normalize_backend_url(value: str) -> str:
    """scheme://host:port of a backend URL, or ValueError saying what is wrong with it."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        raise ValueError("must be an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError("must name a host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError("must be scheme://host:port only, with no path, query or fragment")
    if parts.username or parts.password:
        raise ValueError("must not carry credentials; configure them separately")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError("has an invalid port") from exc
    host = parts.hostname
    if ":" in host:
        host = f"[{host}]"
    default_port = 443 if parts.scheme == "https" else 80
    return f"{parts.scheme}://{host}:{port or default_port}"


def _route_path(value: str) -> str:
    if not value.startswith("/") or canonical_path(value) != value:
        raise ValueError("must be an absolute, decoded path without a trailing slash")
    return value


def _cidr(value: str) -> str:
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError as exc:
        raise ValueError("must be an IP address or CIDR network") from exc
    return value


BackendUrl = Annotated[str, AfterValidator(normalize_backend_url)]
RoutePath = Annotated[str, AfterValidator(_route_path)]
Cidr = Annotated[str, AfterValidator(_cidr)]
Seconds = Annotated[float, Field(gt=0, le=86400)]
Port = Annotated[int, Field(ge=0, le=65535)]


class ListenConfig(_Model):
    host: str = "0.0.0.0"  # a proxy listens for other hosts by design
    # Where clients connect (--port); a fixed number with --workers, since 0 would give each
    # worker its own port.
    port: Port = 8080
    # Processes sharing the port (SO_REUSEPORT), each with its own event loop.
    workers: Annotated[int, Field(ge=1, le=256)] = 1


class AdminConfig(_Model):
    # Probes and metrics: loopback by default so they are not exposed by accident.
    host: str = "127.0.0.1"
    port: Port = 8081  # /livez, /readyz and /metrics


class HealthConfig(_Model):
    # Active probes of every backend, at most one in flight per backend.
    enabled: bool = True
    # SGLang's /health runs a one-token generation: slow under load, so probe gently.
    path: RoutePath = "/health"
    # Time between one backend's probes; a slow probe delays the next, never overlaps it.
    interval_s: Seconds = 5.0
    # A probe not answered within this has failed.
    timeout_s: Seconds = 10.0
    # Consecutive passing probes that (re)admit a backend.
    healthy_threshold: Annotated[int, Field(ge=1, le=100)] = 1
    # Consecutive failed probes that take it out.
    unhealthy_threshold: Annotated[int, Field(ge=1, le=100)] = 3


class PassiveConfig(_Model):
    """Ejection by live traffic, with exponential back-off between ejections."""

    # Failed connects in a row that eject a backend (the request moves on: nothing was sent).
    consecutive_connect_failures: Annotated[int, Field(ge=1, le=1000)] = 1
    # 5xx answers in a row that eject it; a 4xx never counts: it is a verdict on the request.
    consecutive_5xx: Annotated[int, Field(ge=1, le=1000)] = 5
    # The first ejection's length, doubling with each consecutive ejection; a passing probe
    # ends one early.
    base_eject_s: Seconds = 2.0
    # The longest one ejection lasts, however many came in a row.
    max_eject_s: Seconds = 60.0


class DnsConfig(_Model):
    # Every A/AAAA record of this name is a backend: e.g. a Kubernetes headless Service,
    # sglang.llm.svc.cluster.local.
    name: Annotated[str, Field(min_length=1, max_length=253)]
    port: Annotated[int, Field(ge=1, le=65535)]  # the backends' port: records carry none
    scheme: Literal["http", "https"] = "http"  # how the gateway talks to the backends
    # Re-resolved this often; a failed or empty answer keeps the last good set, so a DNS
    # outage does not empty the fleet.
    interval_s: Seconds = 5.0


# A label's key: an optional DNS-subdomain prefix and a slash, then a name of at most 63
# characters (Kubernetes' own syntax, so a selector built from it cannot say anything else).
_LABEL_NAME: Final = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY: Final = re.compile(
    rf"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_LABEL_NAME}"
)
_LABEL_VALUE: Final = re.compile(f"({_LABEL_NAME})?")


def _label_key(value: str) -> str:
    prefix = value.rpartition("/")[0]
    if len(prefix) > 253 or not _LABEL_KEY.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a Kubernetes label or annotation key (e.g. app, or "
            "sglang.ai/bootstrap-port)"
        )
    return value


def _labels(value: dict[str, str]) -> dict[str, str]:
    for key, label in value.items():
        _label_key(key)
        if not _LABEL_VALUE.fullmatch(label):
            raise ValueError(
                f"{label!r} (of {key}) is not a label value: at most 63 letters, digits, "
                "'-', '_' or '.', starting and ending with a letter or digit"
            )
    return value


LabelKey = Annotated[str, AfterValidator(_label_key)]
Labels = Annotated[dict[str, str], AfterValidator(_labels)]


class KubernetesConfig(_Model):
    namespace: Annotated[str, Field(min_length=1)] = "default"  # of the EndpointSlices or Pods
    # Exactly one: a Service name (its EndpointSlices: kubernetes.io/service-name=) or a
    # label selector on the slices; neither with prefill_selector and decode_selector.
    service: str | None = None
    label_selector: str | None = None  # any selector on the slices, instead of service
    # Exactly one: the port number, or the name of the slice's port (with the role
    # selectors: of the pod's container port).
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    port_name: str | None = None  # the slice port's name, instead of port
    # backends.mode pd: the labels of the prefill pods (all must match), as sglang-router's
    # --prefill-selector app=sglang component=prefill. With decode_selector, discovery lists
    # and watches the namespace's Pods instead of EndpointSlices (RBAC: pods list, watch).
    prefill_selector: Labels = Field(default_factory=dict)
    decode_selector: Labels = Field(default_factory=dict)  # the decode pods' labels, as above
    # The prefill pod's annotation that holds its --disaggregation-bootstrap-port
    # (sglang-router's --bootstrap-port-annotation); absent: the engine's default (null).
    bootstrap_port_annotation: LabelKey = "sglang.ai/bootstrap-port"
    scheme: Literal["http", "https"] = "http"  # how the gateway talks to the backends
    # A full relist this often, besides the watch, so a missed event cannot linger.
    resync_s: Seconds = 60.0
    # After a failed API call the next waits retry_base_s, doubling with each failure in a
    # row up to retry_max_s; each wait is between half and all of its step, at random, so
    # gateway replicas that failed together (an API-server restart) do not retry in step.
    retry_base_s: Seconds = 1.0
    # The cap of that doubling; at least retry_base_s. An expired watch (410) is no failure:
    # it is relisted at once.
    retry_max_s: Seconds = 30.0
    # The API server; the in-cluster address by default.
    api_server: str = "https://kubernetes.default.svc"
    # The service account's token, re-read on every call, since a projected token rotates.
    token_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    # The CA of the API server's certificate (the service account's by default).
    ca_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"

    @model_validator(mode="after")
    def _one_of_each(self) -> KubernetesConfig:
        if self.roles:
            self._roles_usable()
        elif (self.service is None) == (self.label_selector is None):
            raise ValueError("set exactly one of service or label_selector")
        if (self.port is None) == (self.port_name is None):
            raise ValueError("set exactly one of port or port_name")
        if self.retry_max_s < self.retry_base_s:
            raise ValueError(
                f"retry_max_s ({self.retry_max_s}) must be at least retry_base_s "
                f"({self.retry_base_s})"
            )
        return self

    @property
    def roles(self) -> bool:
        """Prefill and decode pods by their labels (Pods), not EndpointSlices."""
        return bool(self.prefill_selector or self.decode_selector)

    def _roles_usable(self) -> None:
        prefill, decode = self.prefill_selector, self.decode_selector
        if not (prefill and decode):
            raise ValueError(
                "set both prefill_selector and decode_selector (the labels of each role's "
                "pods), or neither"
            )
        if self.service is not None or self.label_selector is not None:
            raise ValueError(
                "service and label_selector select EndpointSlices, which carry no pod labels; "
                "with prefill_selector and decode_selector the pods are selected by those alone"
            )
        for small, large in ((prefill, decode), (decode, prefill)):
            if small.items() <= large.items():
                # Every pod the larger selects matches both: none could ever be given a role.
                raise ValueError(
                    f"every pod that matches {_selector_text(large)} also matches "
                    f"{_selector_text(small)}: prefill_selector and decode_selector must "
                    "differ in a label both name, or each name one the other does not"
                )

    @property
    def selector(self) -> str:
        if self.roles:
            return pods_selector(self.prefill_selector, self.decode_selector)
        if self.service is not None:
            return f"kubernetes.io/service-name={self.service}"
        assert self.label_selector is not None
        return self.label_selector


def _selector_text(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def pods_selector(prefill: Mapping[str, str], decode: Mapping[str, str]) -> str:
    """The API's labelSelector for the pods of either role: one selector selects both only
    where they name the same key (a selector's terms are ANDed), so the others are left to
    the gateway's own match of each pod's labels. app=sglang,component=prefill and
    app=sglang,component=decode give app=sglang,component in (decode,prefill)."""
    terms = []
    for key in sorted(prefill.keys() & decode.keys()):
        a, b = prefill[key], decode[key]
        if a == b:
            terms.append(f"{key}={a}")
        elif a and b:  # a set-based term names no empty value
            terms.append(f"{key} in ({','.join(sorted((a, b)))})")
    return ",".join(terms)


# The balancers gateway/fleet/balancers.py implements (BALANCERS there).
BALANCER_NAMES: Final = (
    "least_inflight",
    "round_robin",
    "power_of_two",
    "consistent_hash",
    "random",
    "cache_aware",
)

# The header SMG's consistent_hashing and manual policies read a session's key from.
SMG_ROUTING_KEY: Final = "X-SMG-Routing-Key"

# sglang-router / SMG `--policy` names (SMG bindings/python/src/smg/router_args.py,
# COMMON_POLICY_CHOICES) taken as backends.balancer, each as the closest balancer here and
# the hash header it reads (None: backends.hash_header as configured).
SMG_POLICIES: Final[Mapping[str, tuple[str, str | None]]] = {
    "round_robin": ("round_robin", None),
    "random": ("random", None),
    "power_of_two": ("power_of_two", None),
    # A ring over the members keyed by X-SMG-Routing-Key, as SMG's; without the header,
    # least-inflight here where SMG picks at random.
    "consistent_hashing": ("consistent_hash", SMG_ROUTING_KEY),
    # SMG's manual policy pins each X-SMG-Routing-Key to the worker it first went to, in one
    # router's memory. The ring pins it as firmly while that worker is routable, and every
    # --workers process and every gateway replica agrees on it; adding a member moves a
    # share of the keys, where manual moves none.
    "manual": ("consistent_hash", SMG_ROUTING_KEY),
    # Fewest requests in flight through the gateway, where SMG's reads each engine's load.
    "least_load": ("least_inflight", None),
    # The longest prompt prefix each backend served, unless its load is too uneven; the
    # prefix is of the request's bytes where SMG's tree is of its text
    # (docs/deployment.md, cache_aware).
    "cache_aware": ("cache_aware", None),
}

# SMG policies with nothing close enough here: refused at start, saying what to use instead.
SMG_UNSUPPORTED: Final[Mapping[str, str]] = {
    "prefix_hash": (
        "SMG's prefix_hash hashes each prompt's first tokens; the gateway has no such "
        "balancer. Use consistent_hashing with an X-SMG-Routing-Key per session"
    ),
    "passthrough": "SMG's passthrough is for OpenAI-style upstreams, not SGLang engines",
    "bucket": (
        "SMG's bucket policy sorts prefill workers into load buckets; the gateway has no "
        "such balancer. Use cache_aware or least_load for the prefill workers"
    ),
}

BalancerName = Literal[
    "least_inflight", "round_robin", "power_of_two", "consistent_hash", "random", "cache_aware"
]


def _smg_balancer(field: str, name: object) -> object:
    """An sglang-router policy name as the balancer here closest to it (SMG_POLICIES)."""
    if not isinstance(name, str):
        return name
    if name in SMG_UNSUPPORTED:
        raise ValueError(
            f"{field} {name!r} (sglang-router's --policy {name}) has no equivalent in "
            f"the gateway: {SMG_UNSUPPORTED[name]}"
        )
    if name in SMG_POLICIES and name not in BALANCER_NAMES:
        return SMG_POLICIES[name][0]
    return name


class PrefillWorker(_Model):
    """A prefill engine of backends.prefill: sglang-router's `--prefill URL [PORT]`."""

    url: BackendUrl  # the prefill engine, scheme://host:port
    # The engine's --disaggregation-bootstrap-port, which its decode partner connects to;
    # null: the engine's default (sglang-router sends null too).
    bootstrap_port: Annotated[int, Field(ge=1, le=65535)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _plain_url(cls, data: Any) -> Any:
        return {"url": data} if isinstance(data, str) else data


_MIN_ENGINE_CACHE_BYTES: Final = 4096


class CacheAwareConfig(_Model):
    """backends.balancer: cache_aware (gateway/fleet/cache_aware.py)."""

    # A match shorter than this share of the prompt goes to the least loaded backend
    # (sglang-router's default is 0.3; why half: gateway/fleet/cache_aware.py).
    cache_threshold: Annotated[float, Field(ge=0, le=1)] = 0.5
    # Prompt-prefix blocks remembered per backend (~100 bytes each), least recently used
    # evicted first.
    max_blocks_per_backend: Annotated[int, Field(ge=16, le=1 << 24)] = 32768
    # Bytes of each prompt matched: bounds the per-request cost (~1 us per KB).
    max_prompt_bytes: Annotated[int, Field(ge=1024, le=16 << 20)] = 256 << 10
    # Tokens one engine's prefix cache holds: "reported", each engine's own figure from its
    # /server_info (SGLang's max_total_num_tokens, times dp_size; none with a hierarchical
    # cache, whose host tier holds more); a number, the same for all; "off", unbounded.
    # What the gateway remembers of a backend is bounded to that many tokens of request
    # bytes, so a prefix the engine has evicted stops drawing requests. An engine that
    # reports nothing is bounded by blocks only. A figure well under the engine's real size
    # costs hits (docs/bench.md).
    engine_cache_tokens: Annotated[int, Field(ge=512)] | Literal["reported", "off"] = "reported"
    # Request bytes one prompt token takes in this traffic (English text in JSON: about 4;
    # input_ids: about 6); unset: learnt from the prompts (their words, or ids, per byte).
    bytes_per_token: Annotated[float, Field(gt=0, le=64)] | None = None
    # A request no backend holds goes to the least pressed cache near the least loaded
    # backend when every cache there has turned over lately (gateway/fleet/cache_aware.py).
    place_by_pressure: bool = True

    @field_validator("engine_cache_tokens", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false (and `on` as true: no size at all).
        if isinstance(value, bool):
            if value:
                raise ValueError('a token count, "reported" or "off"')
            return "off"
        return value

    @field_validator("bytes_per_token", mode="before")
    @classmethod
    def _not_a_flag(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("a number of bytes, or null to learn it")
        return value

    @model_validator(mode="after")
    def _holds_a_prompt(self) -> CacheAwareConfig:
        # Below a few KB every prompt evicts itself and cache_aware silently becomes
        # least_inflight: a mistyped size, never a real engine (they hold 10^5+ tokens).
        tokens, per_token = self.engine_cache_tokens, self.bytes_per_token
        if isinstance(tokens, int) and per_token is not None:
            size = int(tokens * per_token)
            if size < _MIN_ENGINE_CACHE_BYTES:
                raise ValueError(
                    f"engine_cache_tokens x bytes_per_token is {size} bytes; at least "
                    f"{_MIN_ENGINE_CACHE_BYTES} are needed to remember one prompt"
                )
        return self


class BackendsConfig(_Model):
    # registry: membership changed over HTTP (POST /workers, as sglang-router and SMG take
    # it), seeded with backends.static.
    discovery: Literal["static", "dns", "kubernetes", "registry"] = "static"
    # Regular workers, http(s)://host:port (what --backend sets).
    static: list[BackendUrl] = Field(default_factory=list)
    dns: DnsConfig | None = None  # discovery: dns, the name whose records are the backends
    # discovery: kubernetes, the EndpointSlices (with mode pd: the Pods) that list the backends.
    kubernetes: KubernetesConfig | None = None
    # sglang-router's --policy names are taken too (SMG_POLICIES): see _smg_policy.
    balancer: BalancerName = "least_inflight"
    # pd: every generation goes to one prefill and one decode worker together, which the
    # KV cache passes between (docs/fleet-control.md, "Prefill/decode disaggregation");
    # regular workers then serve none. regular: prefill and decode workers serve nothing.
    mode: Literal["regular", "pd"] = "regular"
    # Workers by role, besides backends.static (regular ones): sglang-router's --prefill
    # URL [BOOTSTRAP_PORT] and --decode URL. A registered worker says its own worker_type;
    # a discovered pod's comes from backends.kubernetes.prefill_selector and
    # decode_selector. Only with mode: pd and static or registry discovery. A prefill worker
    # is a URL or {url, bootstrap_port}.
    prefill: list[PrefillWorker] = Field(default_factory=list)
    decode: list[BackendUrl] = Field(default_factory=list)  # decode workers' URLs, as prefill
    # Each role's balancer (sglang-router's --prefill-policy, --decode-policy); null:
    # backends.balancer. cache_aware suits prefill: the prompt's cache lives there.
    prefill_balancer: BalancerName | None = None
    decode_balancer: BalancerName | None = None  # as prefill_balancer, for decode workers
    # When a request's own backend (its cached prefix with cache_aware, its session with
    # consistent_hash) is too loaded for it: more in flight than the least loaded candidate
    # by over balance_abs_threshold and by a factor over balance_rel_threshold. It then goes
    # to the least loaded one (sglang-router's --balance-abs/rel-threshold).
    balance_abs_threshold: Annotated[int, Field(ge=0, le=1_000_000)] = 8
    # The factor of that test; both must be exceeded (see balance_abs_threshold).
    balance_rel_threshold: Annotated[float, Field(ge=1, le=1000)] = 1.5
    cache_aware: CacheAwareConfig = CacheAwareConfig()  # the cache_aware balancer's tuning
    # consistent_hash: the request header whose value picks the worker (RL session id);
    # a request without it falls back to least_inflight.
    hash_header: Annotated[str, Field(min_length=1)] = "X-Session-Id"
    seed: int | None = None  # for reproducible power_of_two choices
    # Attempts per request when a connection cannot be opened (nothing was sent yet); a sent
    # request is never re-sent.
    connect_attempts: Annotated[int, Field(ge=1, le=10)] = 3
    # Requests in flight per backend; more wait up to queue_timeout_s for a slot, then 503.
    max_inflight_per_backend: Annotated[int, Field(ge=1, le=1_000_000)] = 1024
    # How long a request waits for a slot when every backend is at max_inflight_per_backend
    # (and an inspection for limits.max_inspecting_bytes), then 503.
    queue_timeout_s: Annotated[float, Field(ge=0, le=3600)] = 5.0
    # A generation that only paused or asleep engines could serve waits this long for a
    # continue or resume, as a paused SGLang engine queues it (then 503 naming this key);
    # 0: never held.
    # None: control.timeout_s, the time one weight update through the gateway may take.
    pause_hold_s: Annotated[float, Field(ge=0, le=86400)] | None = None
    health: HealthConfig = HealthConfig()  # active probes
    passive: PassiveConfig = PassiveConfig()  # ejection by live traffic

    @model_validator(mode="before")
    @classmethod
    def _smg_policy(cls, data: Any) -> Any:
        """An sglang-router policy name becomes the balancer closest to it (consistent_hashing
        and manual with hash_header X-SMG-Routing-Key unless hash_header is set), so the
        effective config names what runs; one with no equivalent is refused, saying why."""
        if not isinstance(data, dict):
            return data
        for field in ("prefill_balancer", "decode_balancer"):
            if field in data:
                data = {**data, field: _smg_balancer(field, data[field])}
        name = data.get("balancer")
        if not isinstance(name, str):
            return data
        data = {**data, "balancer": _smg_balancer("balancer", name)}
        header = SMG_POLICIES[name][1] if name in SMG_POLICIES else None
        if name not in BALANCER_NAMES and header is not None and "hash_header" not in data:
            data["hash_header"] = header
        return data

    @model_validator(mode="after")
    def _discovery_configured(self) -> BackendsConfig:
        if self.discovery == "static" and not (self.static or self.prefill or self.decode):
            raise ValueError("static discovery needs at least one URL in backends.static")
        self._roles_configured()
        if self.discovery == "dns" and self.dns is None:
            raise ValueError("dns discovery needs a backends.dns section (name, port)")
        if self.discovery == "kubernetes" and self.kubernetes is None:
            raise ValueError("kubernetes discovery needs a backends.kubernetes section")
        if self.kubernetes is not None and self.kubernetes.roles and self.mode != "pd":
            raise ValueError(
                "backends.kubernetes.prefill_selector and decode_selector need backends.mode: "
                "pd (a prefill or decode worker serves no request alone)"
            )
        if self.mode == "pd" and self.discovery == "kubernetes":
            assert self.kubernetes is not None
            if not self.kubernetes.roles:
                raise ValueError(
                    "backends.mode pd with kubernetes discovery needs "
                    "backends.kubernetes.prefill_selector and decode_selector: the labels "
                    "that tell a prefill pod from a decode pod (sglang-router's "
                    "--prefill-selector and --decode-selector)"
                )
        return self

    def _roles_configured(self) -> None:
        if (self.prefill or self.decode) and self.discovery not in ("static", "registry"):
            raise ValueError(
                "backends.prefill and backends.decode list workers for static or registry "
                f"discovery; with {self.discovery} discovery the role comes from the workers "
                "themselves (with kubernetes: backends.kubernetes.prefill_selector and "
                "decode_selector; docs/fleet-control.md, prefill/decode disaggregation)"
            )
        if (self.prefill or self.decode) and self.mode != "pd":
            raise ValueError(
                "backends.prefill and backends.decode need backends.mode: pd (a prefill or "
                "decode worker serves no request alone)"
            )
        if self.mode == "pd" and self.discovery == "static" and not (self.prefill and self.decode):
            raise ValueError(
                "backends.mode pd with static discovery needs at least one URL in "
                "backends.prefill and one in backends.decode"
            )
        seen: dict[str, str] = {}
        for role, urls in (
            ("static", self.static),
            ("prefill", [w.url for w in self.prefill]),
            ("decode", self.decode),
        ):
            for url in urls:
                if url in seen:
                    raise ValueError(f"{url} is listed in backends.{seen[url]} and {role}")
                seen[url] = role

    def worker_roles(self) -> dict[str, dict[str, Any]]:
        """What backends.prefill and backends.decode say of each of their URLs, as a worker
        registers it (worker_type, bootstrap_port)."""
        roles: dict[str, dict[str, Any]] = {
            w.url: {"worker_type": "prefill", "bootstrap_port": w.bootstrap_port}
            for w in self.prefill
        }
        roles.update({url: {"worker_type": "decode"} for url in self.decode})
        return roles

    @property
    def members(self) -> list[str]:
        """Every configured URL: backends.static, then prefill, then decode workers."""
        return [*self.static, *(w.url for w in self.prefill), *self.decode]


class TimeoutsConfig(_Model):
    connect_s: Seconds = 5.0  # TCP connect to a backend (and the wait for a pooled one)
    # Time to the response headers, counted from the request's write: a deadline, not a
    # silence. Long, since prefill of a 100k-token prompt takes time.
    ttfb_s: Seconds = 900.0
    # The longest silence between chunks of a response once it started.
    idle_s: Seconds = 300.0
    # A deadline for the whole exchange; off by default (generations run for minutes).
    total_s: Seconds | None = None
    # Deadline for the client to deliver a whole request body (slow-body defence; 408).
    body_read_s: Seconds = 60.0
    # Idle keep-alive toward clients; also the only bound on slow request headers.
    client_keepalive_s: Seconds = 75.0
    # The longest a client may leave a reply unread (the connection's send buffer over its
    # high-water mark) before the connection is reset: a client that sends and never reads
    # holds its memory and its generation upstream. None: no limit.
    client_send_s: Seconds | None = 60.0
    # Idle pooled upstream connections are closed before SGLang's uvicorn (5 s) closes them.
    upstream_keepalive_s: Seconds = 4.0
    # Grace period for in-flight requests on shutdown.
    shutdown_grace_s: Seconds = 30.0


class LimitsConfig(_Model):
    # The request body cap (413 beyond): 100k-token input_ids lists are ~0.6 MB; multimodal
    # payloads are larger.
    max_body_bytes: Annotated[int, Field(ge=1024, le=1 << 34)] = 64 << 20
    # The request line and each header field at most (431 beyond), so a client cannot make
    # the parser hold an unbounded head.
    max_header_bytes: Annotated[int, Field(ge=1024, le=1 << 20)] = 16 << 10
    # Memory that inspecting bodies may take at once, counted as each parse's worst case
    # (gateway/edge/budget.py); more inspections wait up to backends.queue_timeout_s, then 503.
    # A body whose inspection alone would exceed it is refused with 413.
    max_inspecting_bytes: Annotated[int, Field(ge=16 << 20, le=1 << 40)] = 256 << 20
    # Client connections held at once; more are answered 503 and closed at once, so the
    # process keeps descriptors for its backends and its own probes. None: half of the
    # descriptor limit (RLIMIT_NOFILE) left after a reserve of 64 (gateway/runtime.py).
    max_client_connections: Annotated[int, Field(ge=1)] | None = None


class RoutingConfig(_Model):
    # any: every routable backend serves; latest: only those at the weight version most
    # recently installed through the gateway, or first seen on an engine (an RL fleet
    # mid-update never serves stale weights). A request's X-Weight-Version header asks for
    # exactly that version instead.
    weight_version: Literal["any", "latest"] = "any"


class EngineMetricsConfig(_Model):
    """GET /engine_metrics and /metrics on the main port: every engine's /metrics, merged."""

    # Each engine's whole answer is due within this, else it is left out (SMG waits 5 s).
    timeout_s: Annotated[float, Field(gt=0, le=300)] = 5.0
    # An engine that sends more is left out of the answer (a comment says so). SGLang's
    # text is tens of KB, a few MB with many LoRA adapters or histogram labels.
    max_bytes_per_engine: Annotated[int, Field(ge=1024, le=1 << 30)] = 8 << 20
    # All engines together: the answer is held whole, so this bounds its memory; engines
    # whose text would pass it are left out.
    max_total_bytes: Annotated[int, Field(ge=1024, le=1 << 32)] = 64 << 20


class ReloadConfig(_Model):
    # Poll the config file's modification time this often and reload on change (SIGHUP
    # always reloads). None: no polling.
    watch_interval_s: Seconds | None = None


class SamplingMaskConfig(_Model):
    # enforce: refuse what SGLang would mishandle; log_only: count and log what would be
    # refused and forward it (to see what enforcing would refuse before turning it on).
    mode: Literal["enforce", "log_only"] = "enforce"
    # A top_k the operator knows the backend fills in when a request omits it. None: an
    # omitted top_k counts as unbounded (fail closed).
    default_top_k: Annotated[int, Field(ge=1, lt=TOP_K_ALL)] | None = None
    # Whose admission applies: auto (each backend's own, from its /server_info; the
    # strictest until it answers), or a release every backend is taken to run ("0.5.19",
    # "0.5.20", ...) for fleets whose /server_info the gateway cannot read.
    profile: str = "auto"
    # --sampling-mask-max-tokens of a pinned release from 0.5.20 on.
    max_tokens: Annotated[int, Field(ge=1, lt=TOP_K_ALL)] = 4096

    @model_validator(mode="after")
    def _known_profile(self) -> SamplingMaskConfig:
        if self.profile != "auto":
            pinned(self.profile, self.max_tokens)  # raises for a release it does not know
        return self

    @property
    def pinned_profile(self) -> MaskProfile | None:
        return None if self.profile == "auto" else pinned(self.profile, self.max_tokens)


class PolicyConfig(_Model):
    # The checks of return_sampling_mask requests the backends would mishandle.
    sampling_mask: SamplingMaskConfig = SamplingMaskConfig()
    # Refuse a request whose parallel sampling `n` exceeds this: SGLang allocates per-sample
    # state up front, so one huge n can exhaust a server's memory. null: no cap.
    max_parallel_samples: Annotated[int, Field(ge=1)] | None = 1024
    # Forward a body that provably cannot hold the mask key (an exact byte scan) without
    # parsing it. Faster for large token-id bodies; malformed or mistyped bodies are then
    # refused by SGLang itself rather than by the gateway, and the n cap and top_k range
    # checks are skipped for them. The scan finds no literal key and no \u escape; the rid is
    # still read by a walk of the body's strings for owner routing (a body whose rid the
    # walk cannot vouch for is parsed after all). Off: every body is parsed.
    skip_parse_without_mask_key: bool = False


class RoutesConfig(_Model):
    # SGLang reads AIP_PREDICT_ROUTE for this path; set it to match if you changed it.
    vertex_path: RoutePath = "/vertex_generate"
    # Extra paths forwarded uninspected (e.g. /v1/embeddings). Generation routes refused.
    passthrough: list[RoutePath] = Field(default_factory=list)

    @model_validator(mode="after")
    def _no_uninspected_generation(self) -> RoutesConfig:
        generation = {*GENERATION_ROUTES, self.vertex_path}
        holes = sorted(generation.intersection(self.passthrough))
        if holes:
            # A generation route forwarded uninspected would be a hole in the filter.
            raise ValueError(f"generation routes cannot be passthrough: {', '.join(holes)}")
        return self


class ForwardingConfig(_Model):
    # Peers whose X-Forwarded-For/-Proto are extended rather than replaced.
    trusted_proxies: list[Cidr] = Field(default_factory=list)


_MASK: Final = str(SecretStr("x"))  # how --check-config prints a secret: "**********"


def _not_masked(value: SecretStr) -> SecretStr:
    if value.get_secret_value() == _MASK:
        raise ValueError(
            "this is the mask --check-config prints in place of a secret, not a secret: "
            "put the real value back"
        )
    return value


# A credential: never printed (--check-config shows the mask), and the mask itself is
# refused, so a saved --check-config output cannot run with "**********" as a key.
Secret = Annotated[SecretStr, AfterValidator(_not_masked)]


class AuthConfig(_Model):
    """Optional bearer API keys for clients (an ingress), and credentials for backends."""

    # Every request outside exempt_paths needs a key of keys or keys_file (401 otherwise).
    enabled: bool = False
    # Keys inline (prefer keys_file: it can be rotated by editing it and sending SIGHUP).
    keys: list[Secret] = Field(default_factory=list)
    keys_file: str | None = None  # one key per line, # comments allowed
    # Paths served without a key, e.g. [/health] for a load balancer's probes.
    exempt_paths: list[RoutePath] = Field(default_factory=list)
    # Sent upstream as the Authorization header (SGLang's --api-key), replacing whatever
    # the client sent. Without it, a client's Authorization passes through unless client
    # authentication is on, in which case the client's key is never forwarded.
    upstream_authorization: Secret | None = None
    # The same credential read from a file (not with upstream_authorization), so the secret
    # stays out of the config.
    upstream_authorization_file: str | None = None

    @model_validator(mode="after")
    def _usable(self) -> AuthConfig:
        if self.enabled and not self.keys and self.keys_file is None:
            raise ValueError("auth.enabled needs keys or keys_file")
        for name in ("keys_file", "upstream_authorization_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name} {path!r} is not a readable file")
        if self.upstream_authorization and self.upstream_authorization_file:
            raise ValueError("set upstream_authorization or upstream_authorization_file, not both")
        if self.upstream_authorization and not header_safe(
            self.upstream_authorization.get_secret_value()
        ):
            raise ValueError("upstream_authorization must be one line without control characters")
        return self


class MembershipConfig(_Model):
    """Who may register, list and remove workers (the registry routes) without a key: the
    cluster's engines, which register themselves from their own nodes and send no header."""

    # Callers that need no key for them, unless their request carries forwarding headers.
    # Empty by default: only operators change the membership.
    trusted_cidrs: list[Cidr] = Field(default_factory=list)


class ControlConfig(_Model):
    """Who may call the fleet control routes (pause, weight updates, abort...) and how long a
    fanned-out call may take. A client key (auth.keys) grants one of them only: the abort of
    a request by its rid (client_abort)."""

    # Operator bearer keys (prefer keys_file: rotated by editing it and sending SIGHUP).
    keys: list[Secret] = Field(default_factory=list)
    keys_file: str | None = None  # one operator key per line, # comments allowed
    # Callers from these networks need no key, unless their request carries forwarding
    # headers. Loopback by default: the RL driver on the gateway's own host. Behind a proxy
    # on that host every client is a loopback caller: set keys then.
    trusted_cidrs: list[Cidr] = Field(default_factory=lambda: ["127.0.0.0/8", "::1/128"])
    # The deadline of one fanned-out call, per backend (a weight update from disk takes time).
    timeout_s: Seconds = 120.0
    # Registration from the engines' network, with no key.
    membership: MembershipConfig = MembershipConfig()
    # Any client that may send generation requests may abort one by its rid (an agent
    # cancelling its own rollout). Harmless to others only while rids are unguessable.
    client_abort: bool = True

    @model_validator(mode="after")
    def _readable(self) -> ControlConfig:
        if self.keys_file is not None and not Path(self.keys_file).is_file():
            raise ValueError(f"keys_file {self.keys_file!r} is not a readable file")
        return self


def header_safe(value: str) -> bool:
    """A value the gateway may put in an HTTP header line: no CR, LF or other controls."""
    return value.isprintable()


class LoggingConfig(_Model):
    level: Literal["debug", "info", "warning", "error"] = "info"  # the least severe logged
    access_log: bool = True  # one line per request on stdout
    # json: one object per line, for a log pipeline; text: for a person at a terminal.
    format: Literal["json", "text"] = "json"


# What tracing.enabled needs (the otel extra); looked up without importing them, so a base
# install never loads opentelemetry.
TRACING_MODULES: Final = (
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)
TRACING_INSTALL: Final = "pip install 'sglang-gateway[otel]'"


def missing_tracing_module() -> str | None:
    """The first module of TRACING_MODULES that cannot be imported, or None."""
    for name in TRACING_MODULES:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except ImportError:  # a parent package is missing
            return name
    return None


def _otlp_endpoint(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL (OTLP/HTTP, e.g. .../v1/traces)")
    if parts.username is not None or parts.password is not None or parts.query:
        # The URL is printed by --check-config and in errors: credentials go in headers.
        raise ValueError("must carry no credentials or query string (use tracing.headers)")
    try:
        parts.port  # noqa: B018 - raises for an invalid port
    except ValueError as exc:
        raise ValueError("has an invalid port") from exc
    return value


class TracingConfig(_Model):
    """OpenTelemetry spans for each request, exported over OTLP/HTTP (the otel extra)."""

    # Needs pip install 'sglang-gateway[otel]'; true without it is a config error saying so.
    enabled: bool = False
    # The collector's OTLP/HTTP traces URL, signal path included.
    endpoint: Annotated[str, AfterValidator(_otlp_endpoint)] = "http://127.0.0.1:4318/v1/traces"
    # The spans' service.name.
    service_name: Annotated[str, Field(min_length=1, max_length=255)] = "sglang-gateway"
    # Share of new traces recorded; a request that arrives with a traceparent follows its
    # sampled flag instead (parent-based), so a trace is never recorded in part.
    sample_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    # Sent with every export (a collector's or vendor's credentials): secrets, never printed.
    headers: dict[str, Secret] = Field(default_factory=dict)
    # One export request's deadline; also bounds the final flush when the gateway stops.
    timeout_s: Annotated[float, Field(gt=0, le=300)] = 10.0

    @model_validator(mode="after")
    def _usable(self) -> TracingConfig:
        for name, value in self.headers.items():
            if not name or not header_safe(name) or not header_safe(value.get_secret_value()):
                raise ValueError("headers must be one-line names and values")
        if self.enabled:
            missing = missing_tracing_module()
            if missing is not None:
                raise ValueError(
                    f"tracing.enabled needs the otel extra ({missing} is not installed): "
                    f"{TRACING_INSTALL}"
                )
        return self


def _etcd_prefix(value: str) -> str:
    if not value.startswith("/") or not value.endswith("/") or not value.isprintable():
        raise ValueError("must start and end with '/' (e.g. /sglang-gateway/rl-job/)")
    return value


class EtcdConfig(_Model):
    """Where the replicas of one fleet keep their shared state (state.backend: etcd)."""

    # The cluster's client URLs; each call tries them in turn until one answers.
    endpoints: Annotated[list[BackendUrl], Field(min_length=1)]
    # Every key of this fleet lives under it: two fleets on one etcd need two prefixes.
    prefix: Annotated[str, AfterValidator(_etcd_prefix)] = "/sglang-gateway/"
    # etcd's user/password auth (a token is fetched with them); secrets, never printed.
    username: str | None = None
    password: Secret | None = None  # with username; or password_file, not both
    # The password read from a file, so the secret stays out of the config.
    password_file: str | None = None
    # https endpoints: the CA that signed etcd's certificate (the system's CAs otherwise).
    ca_file: str | None = None
    # The client certificate (PEM) the gateway shows etcd, for a cluster that asks for one
    # (etcd's --client-cert-auth, as kubeadm sets it up); with key_file.
    cert_file: str | None = None
    # cert_file's private key (PEM, no passphrase); its path is printed, never what it holds.
    key_file: str | None = None
    # One call's deadline.
    timeout_s: Annotated[float, Field(gt=0, le=60)] = 2.0
    # What a replica holds (its acknowledgement, the control lock) outlives it by this much.
    lease_ttl_s: Annotated[int, Field(ge=2, le=300)] = 10
    # How long a fleet-changing call waits for another one's lock before it is refused (409).
    lock_wait_s: Seconds = 10.0

    @model_validator(mode="after")
    def _usable(self) -> EtcdConfig:
        if self.password is not None and self.password_file is not None:
            raise ValueError("set password or password_file, not both")
        if (self.password is not None or self.password_file is not None) != (
            self.username is not None
        ):
            raise ValueError("username and a password (or password_file) go together")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (the client certificate, its key)")
        for name in ("password_file", "ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name} {path!r} is not a readable file")
        if self.ca_file is not None or self.cert_file is not None:
            # What the client will load, loaded once now: a key that is not the
            # certificate's is a config error, not a failure at the first connection.
            client_context(self.ca_file, self.cert_file, self.key_file)
        return self


class StateConfig(_Model):
    """Where the fleet's state (registry, engine states, versions) is shared: `local`, one
    process or the --workers of one host (a file); `etcd`, several replicas."""

    # etcd: registry members, paused and asleep engines, weight versions, LoRA adapters and
    # the latest version live in etcd, shared by every replica and --workers process.
    backend: Literal["local", "etcd"] = "local"
    etcd: EtcdConfig | None = None  # the cluster, needed with backend: etcd

    @model_validator(mode="after")
    def _consistent(self) -> StateConfig:
        if self.backend == "etcd" and self.etcd is None:
            raise ValueError("state.backend: etcd needs state.etcd.endpoints")
        if self.backend == "local" and self.etcd is not None:
            raise ValueError("state.etcd is set but state.backend is local: set backend: etcd")
        return self


class GatewayConfig(_Model):
    listen: ListenConfig = ListenConfig()  # the client listener
    admin: AdminConfig = AdminConfig()  # the admin listener: probes and metrics
    backends: BackendsConfig  # required: a gateway with no backend is a config mistake
    timeouts: TimeoutsConfig = TimeoutsConfig()  # deadlines toward clients and backends
    limits: LimitsConfig = LimitsConfig()  # caps on what clients may make the gateway hold
    policy: PolicyConfig = PolicyConfig()  # what the gateway refuses before a backend sees it
    routes: RoutesConfig = RoutesConfig()  # which paths are inspected, which forwarded as is
    forwarding: ForwardingConfig = ForwardingConfig()  # X-Forwarded-* from trusted proxies
    auth: AuthConfig = AuthConfig()  # client API keys and the credential sent to backends
    control: ControlConfig = ControlConfig()  # who may call the fleet control routes
    routing: RoutingConfig = RoutingConfig()  # which backends a generation may go to
    # Every engine's /metrics, merged on the main port.
    engine_metrics: EngineMetricsConfig = EngineMetricsConfig()
    logging: LoggingConfig = LoggingConfig()  # the log and the access log
    reload: ReloadConfig = ReloadConfig()  # reloading when the file changes
    tracing: TracingConfig = TracingConfig()  # OpenTelemetry spans (the otel extra)
    state: StateConfig = StateConfig()  # where the fleet state is shared: one host or etcd


# Settings that need new sockets, a new connection pool or a new exporter: a reload cannot
# change them.
RESTART_ONLY: Final = (
    "listen",
    "admin",
    "limits.max_header_bytes",
    "timeouts.upstream_keepalive_s",
    "tracing",
    # The log handlers and the access log's observer are made once, at start.
    "logging",
    # The shared fleet state is joined once, at start.
    "state",
)
