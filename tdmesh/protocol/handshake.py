"""Mutual authentication of every new control-plane connection (docs/SECURITY.md).

Both ends know the job token; neither ever sends it.  The listening side (the client's gate,
a host's relay) speaks first, with a fresh nonce (``Challenge``).  The connecting side (a
worker, or a relay going up) answers with its hello, which carries a fresh nonce of its own
and an HMAC, under the token, of both nonces and of who it says it is.  The listener checks
that and answers ``Welcome``: an HMAC of both nonces under the token, with another label.
The connecting side reads nothing else until that proof checks, so a process that announces
a fake controller in the store (anything that can write to the store can) learns nothing
and directs no one, and a recorded handshake replays into nothing: each side's proof covers
the other side's fresh nonce.  Handshake frames are decoded by restricted unpicklers: until
the proof checks, a pickle may build nothing but these records.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

from ..errors import ProtocolError
from . import messages as m
from .security import derive
from .transport import Connection, decode_hello, decode_restricted

__all__ = ["AuthenticationError", "NONCE_BYTES", "challenge", "hear", "check_hello", "welcome", "join", "identity"]

NONCE_BYTES = 16
HANDSHAKE_TIMEOUT = 30.0  # seconds a connecting side waits for each step of the listener's


class AuthenticationError(ProtocolError, PermissionError):
    """The other end of a connection did not prove that it knows the job token."""


def identity(hello) -> str:
    """Who a hello says it is, as its proof covers it."""
    if type(hello) is m.RelayHello:
        return f"relay|{hello.host}|{hello.first}|{hello.end}"
    return f"rank|{hello.rank}|{hello.pid}"


def _hello_proof(token: str, challenge_nonce: bytes, nonce: bytes, who: str) -> str:
    return derive(token, "tdmesh-hello", challenge_nonce.hex(), nonce.hex(), who)


def _welcome_proof(token: str, challenge_nonce: bytes, nonce: bytes) -> str:
    return derive(token, "tdmesh-welcome", challenge_nonce.hex(), nonce.hex())


# -- the listening side ---------------------------------------------------------------------
def challenge(conn: Connection) -> bytes:
    """Send a fresh nonce: the first frame of every connection a listener accepts."""
    nonce = os.urandom(NONCE_BYTES)
    conn.send_messages([m.Challenge(nonce)])
    return nonce


def hear(sock, tls, max_frame: int) -> tuple[Connection, bytes, object]:
    """The listener's half up to the hello, on an accepted socket: TLS (``tls``, a server
    context, or None), the challenge, and the hello that answers it, decoded safely but not yet
    checked (``check_hello``).  Raises for whatever a stranger sends instead."""
    if tls is not None:
        sock = tls.wrap_socket(sock, server_side=True)
    conn = Connection(sock, max_frame=max_frame)
    nonce = challenge(conn)
    payload = conn.recv_payload()
    if payload is None:
        raise ProtocolError("closed before saying hello")
    return conn, nonce, decode_hello(payload)


def check_hello(token: str, challenge_nonce: bytes, hello) -> bool:
    """Whether ``hello`` proves knowledge of ``token`` for this connection's challenge."""
    if type(hello) not in (m.Hello, m.RelayHello):
        return False
    nonce, proof = hello.nonce, hello.proof
    if not (isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES and isinstance(proof, str)):
        return False
    return hmac.compare_digest(proof.encode("utf-8", "replace"),
                               _hello_proof(token, challenge_nonce, nonce, identity(hello)).encode())


def welcome(conn: Connection, token: str, challenge_nonce: bytes, hello) -> None:
    """Prove to an authenticated peer that this listener knows the token too."""
    conn.send_messages([m.Welcome(_welcome_proof(token, challenge_nonce, hello.nonce))])


# -- the connecting side --------------------------------------------------------------------
def join(conn: Connection, token: str, hello, where: str) -> None:
    """Authenticate both ways as ``hello`` (its nonce and proof are filled in here); raises
    AuthenticationError unless the listener at ``where`` proves it knows ``token``."""
    sock = conn.sock
    sock.settimeout(HANDSHAKE_TIMEOUT)
    try:
        asked = _read(conn, "Challenge", where)
        nonce = os.urandom(NONCE_BYTES)
        hello = hello._replace(nonce=nonce, proof=_hello_proof(token, asked.nonce, nonce, identity(hello)))
        conn.send_messages([hello])
        answer = _read(conn, "Welcome", where)
    except TimeoutError:
        raise AuthenticationError(f"{where} did not complete tdmesh's handshake within {HANDSHAKE_TIMEOUT:.0f} s"
                                  ) from None
    if not (isinstance(answer.proof, str) and hmac.compare_digest(
            answer.proof.encode("utf-8", "replace"), _welcome_proof(token, asked.nonce, nonce).encode())):
        raise AuthenticationError(f"{where} did not prove that it knows this job's token: it is not the job's "
                                  f"genuine client (or relay); refusing to take orders from it")
    sock.settimeout(None)


def _read(conn: Connection, name: str, where: str) -> Any:
    payload = conn.recv_payload()
    if payload is None:
        raise AuthenticationError(f"{where} closed the connection during tdmesh's handshake (it refused this "
                                  f"process's proof of the job token, or it is not a tdmesh peer)")
    try:
        msg: Any = decode_restricted(payload, (name,))
    except Exception as e:  # noqa: BLE001 - whatever a not-yet-authenticated peer sends
        raise AuthenticationError(f"{where} sent a bad handshake frame ({type(e).__name__}: {e})") from None
    if name == "Challenge" and not (isinstance(msg.nonce, bytes) and len(msg.nonce) == NONCE_BYTES):
        raise AuthenticationError(f"{where} sent a malformed challenge")
    return msg
