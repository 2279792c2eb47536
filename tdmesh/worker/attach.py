"""Attach mode on the worker: ``torchrun ... -m tdmesh.worker`` with no script.

The fleet waits for clients: session ``g`` is announced by a client under
``tdmesh/attach/r<restart>/<g>/controller`` with a fresh salt and an HMAC proving it knows
the job token; the session's token is derived from the job token and that salt, so nothing
secret is in the announcement.  The job token is rank 0's random one, written into the store
(rank 0 prints how to attach), or, with TDMESH_SECRET, derived from the secret on every
process and written nowhere.  Workers serve a client until it detaches, then wait for
session ``g + 1``; a client that exits the mesh ends the job.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket

from ..protocol.rendezvous import ATTACH, attach_scope, new_token, proof, session_token
from ..protocol.security import derive, secret_token, warn_if_exposed

log = logging.getLogger("tdmesh.worker")


def publish_job(store, rank: int, world_size: int, local_world_size: int) -> str:
    """Every rank returns the job token; rank 0 publishes the job (and, without a secret, the
    token) and prints how to attach."""
    scope = attach_scope()
    run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    derived = secret_token(f"{scope}|{run}")
    if rank == 0:
        token = derived or new_token()
        store.set(scope + "/world", f"{world_size},{local_world_size}")
        store.set(scope + "/run", run)
        if derived is None:
            store.set(scope + "/token", token)
        salt = new_token()  # lets a client tell a wrong token at once (attach's PermissionError)
        store.set(scope + "/check", f"{salt}|{derive(token, 'tdmesh-check', salt)}")
        store.set(ATTACH + "/current", scope)
        warn_if_exposed(world_size, local_world_size)
        host = os.environ.get("MASTER_ADDR", socket.gethostname())
        port = os.environ.get("MASTER_PORT", "?")
        how = (f"tdmesh.attach('{host}:{port}') with the same TDMESH_SECRET" if derived else
               f"tdmesh.attach('{host}:{port}', token='{token}')")
        print(f"tdmesh: {world_size} workers are serving; attach with {how}", flush=True)
    return derived or store.get(scope + "/token").decode()


def wait_for_client(store, job_token: str, session: int):
    """Block until session ``session`` is announced; returns (host, port, session token).

    Announcements without a valid proof are logged and ignored (the fleet keeps waiting)."""
    key = f"{attach_scope()}/{session}/controller"
    text = store.get(key).decode()
    if text == "exit":
        return None
    host, port, salt, signature = text.split("|")
    if not hmac.compare_digest(signature, proof(job_token, session, host, port, salt)):
        log.error("ignored an attach announcement for session %d without the job token's proof", session)
        return "bad"
    return host, int(port), session_token(job_token, session, salt)
