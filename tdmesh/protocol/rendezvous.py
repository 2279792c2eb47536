"""Finding each other through the c10d store that torchrun (or ``local_mesh``) runs.

The client publishes its address (and, without a shared secret, a random token) under keys
scoped by the elastic run id and restart count, so a restarted job never reads a stale
client.  Workers read them, connect, and client and worker prove to each other that they
know the token (tdmesh.protocol.handshake); with TDMESH_SECRET both derive the token instead.
"""

from __future__ import annotations

import os
import secrets
from datetime import timedelta

from torch.distributed import TCPStore

from ..config import env_str
from ..errors import UsageError
from .security import derive, secret_token

SHUTDOWN = "shutdown"
NEXT_JOB = "/next"  # under a parked fleet's scope (tdmesh.fleet.pool): the scope of its next job, or SHUTDOWN


def job_scope() -> str:
    """Key prefix of this job attempt: explicit under local_mesh, else torchrun's run id and restart."""
    return env_str("TDMESH_SCOPE") or (
        f"tdmesh/{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/{restart_count()}")


def restart_count() -> int:
    """How many times torchelastic has restarted this job (0 on the first run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def store_address() -> tuple[str, int]:
    """Where this process finds the job's c10d store."""
    spec = env_str("TDMESH_STORE")
    if spec:
        host, port = spec.rsplit(":", 1)
        return host, int(port)
    try:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError:
        raise UsageError("no c10d store to rendezvous with: run under torchrun (torchrun --nproc_per_node N "
                         "-m tdmesh.worker script.py) or use tdmesh.local_mesh()") from None


def connect_store(timeout: float = 1800.0) -> TCPStore:
    host, port = store_address()
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def reachable_host(variable: str = "TDMESH_RELAY_HOST") -> str:
    """This host's address for peers on other hosts (a relay's, or the client's): the variable's
    value, else the host name when it resolves, else loopback."""
    import socket
    host = env_str(variable)
    if host:
        return host
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        return "127.0.0.1"


def new_token() -> str:
    return secrets.token_hex(16)


def publish_controller(store: TCPStore, host: str, port: int, token: str | None, scope: str | None = None) -> None:
    """Announce the client; ``token`` goes into the store only without a shared secret (None)."""
    scope = scope or job_scope()
    if token is not None:
        store.set(scope + "/token", token)
    store.set(scope + "/controller", f"{host}:{port}")


def publish_shutdown(store: TCPStore, scope: str | None = None) -> None:
    """Tell workers waiting for a client that none is coming."""
    store.set((scope or job_scope()) + "/controller", SHUTDOWN)


def read_controller(store: TCPStore) -> tuple[str, int, str] | None:
    """Block until the client is published; ``None`` if the job ended without one."""
    address = store.get(job_scope() + "/controller").decode()
    if address == SHUTDOWN:
        return None
    token = secret_token(job_scope()) or store.get(job_scope() + "/token").decode()
    host, port = address.rsplit(":", 1)
    return host, int(port), token


# -------------------------------------------------------------------------- attach mode
ATTACH = "tdmesh/attach"


def attach_scope() -> str:
    """Where an attachable fleet (torchrun without a script) announces itself in its store."""
    return f"{ATTACH}/r{restart_count()}"


def proof(job_token: str, *parts) -> str:
    """HMAC of an announcement: only a client that knows the job token can direct the fleet."""
    return derive(job_token, *parts)


def session_token(job_token: str, session: int, salt: str) -> str:
    """The token of attach session ``session``: derived, so its announcement holds no secret."""
    return proof(job_token, "tdmesh-session", session, salt)
