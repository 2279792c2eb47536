"""Secrets, job tokens and TLS: what lets a process into a tdmesh job (docs/SECURITY.md).

Without a secret the client makes a random job token and writes it into the job's c10d
store, where every worker (and anything else that reaches the store's port) reads it.  With
``TDMESH_SECRET`` (or ``TDMESH_SECRET_FILE``) set on every rank and on attaching clients, the
token is derived from the secret (an HMAC over the job's scope: run id and restart count), so
nothing secret is written anywhere: each process computes the same token on its own.
``TDMESH_TLS_CERT``, ``TDMESH_TLS_KEY`` and ``TDMESH_TLS_CA`` wrap every control-plane socket in TLS, with
certificates checked on both sides.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import ssl
import stat

from ..config import env_str
from ..errors import UsageError

__all__ = ["load_secret", "secret_token", "job_token", "derive", "server_tls", "client_tls", "warn_if_exposed"]

log = logging.getLogger("tdmesh")


def load_secret() -> bytes | None:
    """The shared secret of this job, or None.  A secret file readable by group or others
    is refused: a secret any local user can read protects nothing."""
    value, path = env_str("TDMESH_SECRET"), env_str("TDMESH_SECRET_FILE")
    if value and path:
        raise UsageError("set TDMESH_SECRET or TDMESH_SECRET_FILE, not both")
    if path:
        try:
            info = os.stat(path)
        except OSError as e:
            raise UsageError(f"TDMESH_SECRET_FILE={path!r} cannot be read: {e}") from None
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PermissionError(f"TDMESH_SECRET_FILE={path!r} is readable by group or others (mode "
                                  f"{stat.filemode(info.st_mode)}); chmod 600 it")
        with open(path, "rb") as f:
            data = f.read().strip()
        if not data:
            raise UsageError(f"TDMESH_SECRET_FILE={path!r} is empty")
        return data
    return value.encode() if value else None


def derive(key: bytes | str, *parts) -> str:
    """HMAC-SHA256 of ``parts`` under ``key``, hex: tokens derived from a secret, and proofs."""
    key = key.encode() if isinstance(key, str) else key
    return hmac.new(key, "|".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def secret_token(scope: str) -> str | None:
    """The token of job attempt ``scope`` (it names the run id and restart count) derived from
    the shared secret, or None without one."""
    secret = load_secret()
    return None if secret is None else derive(secret, "tdmesh-job", scope)


def job_token(scope: str) -> tuple[str, bool]:
    """The token of job attempt ``scope``, and whether it must be published in the store for
    the workers: derived from the shared secret (nothing to publish), else random."""
    token = secret_token(scope)
    return (token, False) if token is not None else (secrets.token_hex(16), True)


def _tls_files() -> tuple[str, str, str] | None:
    files = env_str("TDMESH_TLS_CERT"), env_str("TDMESH_TLS_KEY"), env_str("TDMESH_TLS_CA")
    if not any(files):
        return None
    if not all(files):
        raise UsageError("TLS needs all of TDMESH_TLS_CERT, TDMESH_TLS_KEY and TDMESH_TLS_CA; got "
                         + ", ".join(f"{n}={v!r}" for n, v in zip(("CERT", "KEY", "CA"), files)))
    return files


def _context(server: bool) -> ssl.SSLContext | None:
    files = _tls_files()
    if files is None:
        return None
    cert, key, ca = files
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.verify_mode = ssl.CERT_REQUIRED  # both sides show a certificate signed by the job's CA
    ctx.check_hostname = False  # peers are reached by whatever address the store names; the CA vouches
    return ctx


def server_tls() -> ssl.SSLContext | None:
    """The context a listening socket (the client's gate, a host's relay) wraps accepted sockets in."""
    return _context(server=True)


def client_tls() -> ssl.SSLContext | None:
    """The context a connecting socket (a worker, a relay going up) is wrapped in."""
    return _context(server=False)


_warned = False


def warn_if_exposed(world_size: int, local_world_size: int) -> None:
    """One warning for a multi-node job run without a secret: say what the network can do."""
    global _warned
    if _warned or world_size <= local_world_size or load_secret() is not None:
        return
    _warned = True
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    log.warning("tdmesh: this multi-node job runs without TDMESH_SECRET: its job token is in the c10d store at %s "
                "in plain text, so anyone who can reach that port can read it, connect as this job's client and "
                "run any code on every worker%s. Set TDMESH_SECRET (or TDMESH_SECRET_FILE) on every rank; see "
                "docs/SECURITY.md", where, "" if _tls_files() else
                ", and read all of its traffic (set TDMESH_TLS_CERT, TDMESH_TLS_KEY and TDMESH_TLS_CA to encrypt it)")

