"""The TLS context of a connection the gateway opens to a store it depends on (etcd), built
from the files the config names: the CA that signed the server's certificate, and the
client certificate with its key for a server that asks for one (mutual TLS).

The config's validation builds it too, so a key that does not match its certificate, or a
file that holds no certificate, is a config error (--check-config says so) rather than a
failure at the first connection. Every error names the file, never what it holds: a key
file's contents are a secret.
"""

from __future__ import annotations

import ssl


class _Encrypted(Exception):
    """Raised from the passphrase callback: the key is encrypted."""


def _no_passphrase() -> str:
    # Without a callback OpenSSL would prompt on the terminal for an encrypted key's
    # passphrase, and a gateway started by a supervisor would hang there.
    raise _Encrypted


def client_context(
    ca_file: str | None,
    cert_file: str | None = None,
    key_file: str | None = None,
    *,
    where: str = "",
) -> ssl.SSLContext:
    """The system's CAs (or `ca_file`'s alone), with the client certificate and key when
    both are given. ValueError, one line naming the file (`where` prefixes the field
    names, e.g. "state.etcd."), when a file cannot be read or used."""
    if (cert_file is None) != (key_file is None):
        raise ValueError(f"{where}cert_file and {where}key_file go together")
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except OSError as exc:  # ssl.SSLError is one, too
        raise ValueError(f"{where}ca_file {ca_file!r} {_unusable(exc, 'certificate')}") from None
    if cert_file is None or key_file is None:
        return context
    # The certificate alone first, so a failure of the pair below is the key's.
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert_file)
    except OSError as exc:
        raise ValueError(
            f"{where}cert_file {cert_file!r} {_unusable(exc, 'certificate')}"
        ) from None
    try:
        context.load_cert_chain(cert_file, key_file, password=_no_passphrase)
    except _Encrypted:
        raise ValueError(
            f"{where}key_file {key_file!r} is encrypted: give the key without a passphrase"
        ) from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(
                f"{where}key_file {key_file!r} is not the key of {where}cert_file {cert_file!r}"
            ) from None
        raise ValueError(f"{where}key_file {key_file!r} {_unusable(exc, 'private key')}") from None
    except OSError as exc:
        raise ValueError(f"{where}key_file {key_file!r} {_unusable(exc, 'private key')}") from None
    return context


def _unusable(exc: OSError, what: str) -> str:
    """Why a file cannot be used, in words that quote nothing it holds."""
    if isinstance(exc, ssl.SSLError):
        return f"holds no PEM {what}" + (f" ({exc.reason})" if exc.reason else "")
    return f"cannot be read ({exc.strerror or type(exc).__name__})"
