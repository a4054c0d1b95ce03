"""A small etcd v3 client over etcd's HTTP/JSON gateway (/v3/...), on aiohttp.

What the gateway's shared fleet state needs and no more: range, put, transactions,
leases, compaction and watches. Keys and values go base64-encoded, as the gateway's JSON
mapping of the gRPC API wants them; revisions and lease ids are int64 sent as strings.

Every call has a deadline. A call that cannot reach an endpoint tries the next one listed
(a cluster's members all serve the same data) and fails with EtcdUnavailable naming every
endpoint tried; an answer etcd refuses is an EtcdError naming the endpoint and etcd's own
message. Credentials (user/password, the auth token they buy) go in request bodies and an
Authorization header only, never into an error or a log line. https endpoints are verified
against ca_file (or the system's CAs); a client certificate and key (cert_file, key_file)
answer a cluster that asks for one (mutual TLS), and a handshake etcd or the gateway
refuses is named as such in the error, never by what a key file holds.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Final

import aiohttp
import orjson

from gateway.config import EtcdConfig
from gateway.config.tls import client_context
from gateway.fleet.kv import Compacted, EtcdError, EtcdUnavailable, Event, KeyValue, range_end

# A watch event or a range answer holds whole values (etcd's default request limit is
# 1.5 MiB, more once base64-encoded): the stream reader's line limit must fit one.
_READ_BUFSIZE: Final = 4 << 20
# etcd's gRPC codes that the JSON gateway puts in its error bodies.
_UNAUTHENTICATED: Final = 16
_GOING_AWAY: Final = (1, 14)  # CANCELED, UNAVAILABLE
_NO_USER: Final = "user name is empty"
# etcd's JSON gateway under --client-cert-auth with auth enabled answers this (plain text,
# 400) to every request whose client certificate has a Common Name, whatever its token.
_CN_REFUSED: Final = b"CommonName of client sending a request against gateway"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        base64.b64decode(raw.get("key", "")),
        base64.b64decode(raw.get("value", "")),
        int(raw.get("mod_revision", 0)),
        int(raw.get("create_revision", 0)),
        int(raw.get("lease", 0)),
    )


def _revision(answer: dict[str, Any]) -> int:
    return int((answer.get("header") or {}).get("revision", 0))


def _message(data: bytes) -> tuple[str, int | None]:
    """etcd's error text and gRPC code from an error body (quoted by no one else)."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return f"{len(data)} bytes that are not JSON", None
    if not isinstance(body, dict):
        return "an answer that is not an object", None
    code = body.get("code")
    text = body.get("message") or body.get("error") or "no message"
    return str(text)[:300], code if isinstance(code, int) else None


def make_ssl(
    ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext | None:
    """The TLS context for https endpoints: the system's CAs, or `ca_file`'s alone, with
    the client certificate when given. ValueError naming the file that cannot be used."""
    if ca_file is None and cert_file is None and key_file is None:
        return None
    return client_context(ca_file, cert_file, key_file, where="state.etcd.")


class EtcdClient:
    """etcd's KV, lease and watch API through its JSON gateway."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        username: str | None = None,
        password: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self.endpoints = tuple(endpoints)
        self._credentials = (username, password or "") if username is not None else None
        self._ssl = make_ssl(ca_file, cert_file, key_file)
        self.timeout_s = timeout_s
        self._current = 0  # the endpoint that answered last: tried first
        self._token: str | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._current]

    def describe(self) -> str:
        """The store, as errors and /readyz name it (never a credential)."""
        return "etcd at " + ", ".join(self.endpoints)

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl if self._ssl is not None else True),
                read_bufsize=_READ_BUFSIZE,
                # Never the environment's proxies: the store is reached directly.
                trust_env=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- requests ------------------------------------------------------------------------

    async def _post_once(self, endpoint: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self._token is not None:
            headers["Authorization"] = self._token
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with self._open().post(
            endpoint + path, data=orjson.dumps(body), headers=headers, timeout=timeout
        ) as resp:
            data = await resp.read()
            if resp.status == 400 and data.startswith(_CN_REFUSED):
                raise _CommonNameRefused(endpoint)
            if resp.status != 200:
                message, code = _message(data)
                # An anonymous call to a store with auth on: "user name is empty" (400).
                if code == _UNAUTHENTICATED or resp.status == 401 or _NO_USER in message:
                    raise _AuthExpired(message)
                raise EtcdError(f"etcd at {endpoint} refused {path} ({resp.status}): {message}")
        try:
            answer = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise EtcdError(f"etcd at {endpoint} answered {path} with no JSON") from None
        if not isinstance(answer, dict):
            raise EtcdError(f"etcd at {endpoint} answered {path} with no object")
        return answer

    async def _authenticate(self, endpoint: str) -> None:
        assert self._credentials is not None
        name, password = self._credentials
        self._token = None
        try:
            answer = await self._post_once(
                endpoint, "/v3/auth/authenticate", {"name": name, "password": password}
            )
        except _CommonNameRefused:
            raise  # the certificate's fault, not the credentials'
        except (_AuthExpired, EtcdError) as exc:
            reason = str(exc).rpartition(": ")[2]  # etcd's own words only
            raise EtcdError(
                f"etcd at {endpoint} refused the credentials (state.etcd.username, "
                f"state.etcd.password): {reason}"
            ) from None
        token = answer.get("token")
        if not isinstance(token, str):
            raise EtcdError(f"etcd at {endpoint} gave no auth token")
        self._token = token

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call, on the first endpoint that answers."""
        failures = []
        for step in range(len(self.endpoints)):
            index = (self._current + step) % len(self.endpoints)
            endpoint = self.endpoints[index]
            try:
                if self._credentials is not None and self._token is None:
                    await self._authenticate(endpoint)
                try:
                    answer = await self._post_once(endpoint, path, body)
                except _AuthExpired:
                    if self._credentials is None:
                        raise EtcdError(
                            f"etcd at {endpoint} needs credentials (state.etcd.username, "
                            "state.etcd.password)"
                        ) from None
                    await self._authenticate(endpoint)  # the token expired: a new one
                    answer = await self._post_once(endpoint, path, body)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                failures.append(f"{endpoint}: {_why(exc)}")
                continue
            self._current = index
            return answer
        raise EtcdUnavailable(f"etcd unreachable ({'; '.join(failures)})")

    # -- KV ------------------------------------------------------------------------------

    async def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """The key (None: absent) and the store's revision when it was read."""
        answer = await self.post("/v3/kv/range", {"key": b64(key)})
        kvs = answer.get("kvs") or []
        return (_kv(kvs[0]) if kvs else None), _revision(answer)

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        answer = await self.post(
            "/v3/kv/range", {"key": b64(prefix), "range_end": b64(range_end(prefix))}
        )
        return [_kv(kv) for kv in answer.get("kvs") or []], _revision(answer)

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        return _revision(await self.post("/v3/kv/put", _put(key, value, lease)))

    async def delete(self, key: bytes) -> int:
        return _revision(await self.post("/v3/kv/deleterange", {"key": b64(key)}))

    async def replace(
        self, key: bytes, value: bytes, *, mod_revision: int, lease: int = 0
    ) -> int | None:
        """Put `value` only if `key` is still at `mod_revision` (0: does not exist yet);
        the new revision, or None when another writer came first."""
        target = "MOD" if mod_revision else "CREATE"
        field = "mod_revision" if mod_revision else "create_revision"
        answer = await self.post(
            "/v3/kv/txn",
            {
                "compare": [
                    {"key": b64(key), "target": target, "result": "EQUAL", field: str(mod_revision)}
                ],
                "success": [{"request_put": _put(key, value, lease)}],
            },
        )
        return _revision(answer) if answer.get("succeeded") else None

    async def delete_if(self, key: bytes, *, mod_revision: int) -> bool:
        """Delete `key` only if it is still at `mod_revision` (a lock this process holds)."""
        answer = await self.post(
            "/v3/kv/txn",
            {
                "compare": [
                    {
                        "key": b64(key),
                        "target": "MOD",
                        "result": "EQUAL",
                        "mod_revision": str(mod_revision),
                    }
                ],
                "success": [{"request_delete_range": {"key": b64(key)}}],
            },
        )
        return bool(answer.get("succeeded"))

    async def write_many(
        self, puts: list[tuple[bytes, bytes]], deletes: list[bytes], *, lease: int = 0
    ) -> int:
        """Put and delete keys in one transaction (no compare: it always applies)."""
        ops = [{"request_put": _put(key, value, lease)} for key, value in puts]
        ops.extend({"request_delete_range": {"key": b64(key)}} for key in deletes)
        return _revision(await self.post("/v3/kv/txn", {"compare": [], "success": ops}))

    async def compact(self, revision: int) -> None:
        await self.post("/v3/kv/compaction", {"revision": str(revision)})

    # -- leases --------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        answer = await self.post("/v3/lease/grant", {"TTL": str(ttl_s)})
        if answer.get("error"):
            raise EtcdError(f"etcd at {self.endpoint} granted no lease: {answer['error']}")
        return int(answer["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew `lease`; its TTL, 0 when it has expired (then it is gone, with its keys)."""
        answer = await self.post("/v3/lease/keepalive", {"ID": str(lease)})
        return int((answer.get("result") or {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self.post("/v3/lease/revoke", {"ID": str(lease)})

    # -- watch ---------------------------------------------------------------------------

    async def watch(
        self, key: bytes, *, start_revision: int, prefix: bool = False
    ) -> AsyncIterator[list[Event]]:
        """The changes to `key` (or every key under it: `prefix`) from `start_revision` on,
        one list per etcd answer, for as long as the stream lasts. Raises Compacted when
        that history is gone; EtcdUnavailable when the stream cannot start or breaks."""
        create: dict[str, Any] = {"key": b64(key), "start_revision": str(start_revision)}
        if prefix:
            create["range_end"] = b64(range_end(key))
        endpoint = self.endpoint
        headers = {"Content-Type": "application/json"}
        if self._credentials is not None and self._token is None:
            await self.post("/v3/kv/range", {"key": b64(key), "count_only": True})
        if self._token is not None:
            headers["Authorization"] = self._token
        # The connection only: a watch is quiet for as long as nothing changes.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s)
        try:
            async with self._open().post(
                endpoint + "/v3/watch",
                data=orjson.dumps({"create_request": create}),
                headers=headers,
                timeout=timeout,
            ) as resp:
                if resp.status != 200:
                    data = await resp.read()
                    if resp.status == 400 and data.startswith(_CN_REFUSED):
                        raise _CommonNameRefused(endpoint)
                    message, _ = _message(data)
                    raise EtcdError(
                        f"etcd at {endpoint} refused a watch ({resp.status}): {message}"
                    )
                while line := await resp.content.readline():
                    if not line.strip():
                        continue
                    try:
                        answer = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        raise EtcdError(
                            f"etcd at {endpoint} sent a watch line that is not JSON"
                        ) from None
                    if "error" in answer:
                        # A stream's error: {"error": {"grpc_code", "message", ...}}.
                        error = answer["error"]
                        error = error if isinstance(error, dict) else {"message": error}
                        text = str(error.get("message") or "no message")[:300]
                        # The member is stopping: its gateway's connection to it closes
                        # (UNAVAILABLE, or CANCELED "the client connection is closing").
                        if error.get("grpc_code") in _GOING_AWAY:
                            raise EtcdUnavailable(f"etcd at {endpoint} ended a watch: {text}")
                        raise EtcdError(f"etcd at {endpoint} ended a watch: {text}")
                    result = answer.get("result") or {}
                    if result.get("compact_revision") and result.get("canceled"):
                        raise Compacted(endpoint, int(result["compact_revision"]))
                    if result.get("canceled"):
                        reason = str(result.get("cancel_reason") or "no reason")[:300]
                        raise EtcdError(f"etcd at {endpoint} cancelled a watch: {reason}")
                    events = result.get("events")
                    if events:
                        yield [
                            Event(_kv(e.get("kv") or {}), e.get("type") == "DELETE") for e in events
                        ]
                    elif result.get("created"):
                        yield []  # the watch is in place: nothing missed from here on
        except (aiohttp.ClientError, OSError) as exc:
            raise EtcdUnavailable(f"etcd at {endpoint}: watch broken ({_why(exc)})") from None
        raise EtcdUnavailable(f"etcd at {endpoint}: watch ended")


class _AuthExpired(Exception):
    """The token was refused (expired, or revoked): authenticate again."""


class _CommonNameRefused(EtcdError):
    """etcd refused the client certificate for carrying a Common Name (auth enabled)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(
            f"etcd at {endpoint} refuses a client certificate with a Common Name while its"
            " auth is enabled (no certificate identity crosses its JSON gateway): give"
            " state.etcd.cert_file one without a CN and name the etcd user in"
            " state.etcd.username"
        )


def _why(exc: BaseException) -> str:
    """A connection failure in a few words, without a URL's query or a header."""
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return "no answer in time"
    tls = _tls_failure(exc)
    if tls is not None:
        return tls
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or type(exc.os_error).__name__})"
    return type(exc).__name__


def _tls_failure(exc: BaseException) -> str | None:
    """A refused TLS handshake in words an operator can act on; None for any other failure.

    Either side can refuse: the gateway, a certificate its CA did not sign (aiohttp's
    certificate error); etcd, a client certificate missing or not signed by its CA, which
    reaches the client as an alert on its first read (an OSError caused by an SSLError)."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        cert = exc.certificate_error
        detail = getattr(cert, "verify_message", None) or type(cert).__name__
        return f"certificate verify failed: {detail} (is state.etcd.ca_file etcd's CA?)"
    cause = exc.os_error if isinstance(exc, aiohttp.ClientConnectorError) else exc.__cause__
    if not isinstance(cause, ssl.SSLError):
        return None
    reason = cause.reason or type(cause).__name__
    if "ALERT" in reason and ("CERTIFICATE" in reason or "UNKNOWN_CA" in reason):
        return (
            f"etcd refused the TLS handshake ({reason}): it wants a client certificate its "
            "CA signed (state.etcd.cert_file, state.etcd.key_file)"
        )
    return f"TLS failed ({reason})"


def client_for(cfg: EtcdConfig) -> EtcdClient:
    """The client state.etcd describes; reads its password file (OSError if it cannot)
    and its TLS files (ValueError naming the one that cannot be used)."""
    password = cfg.password.get_secret_value() if cfg.password is not None else None
    if cfg.password_file is not None:
        password = Path(cfg.password_file).read_text(encoding="utf-8").strip()
    return EtcdClient(
        cfg.endpoints,
        username=cfg.username,
        password=password,
        ca_file=cfg.ca_file,
        cert_file=cfg.cert_file,
        key_file=cfg.key_file,
        timeout_s=cfg.timeout_s,
    )


def _put(key: bytes, value: bytes, lease: int) -> dict[str, Any]:
    """A put request's fields, as /v3/kv/put and a transaction's request_put take them."""
    put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        put["lease"] = str(lease)
    return put
