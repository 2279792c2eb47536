"""Attach mode on the worker: ``torchrun ... -m tdmesh.worker`` with no script.

The fleet waits for clients: session ``g`` is announced by a client under
``tdmesh/attach/r<restart>/<g>/controller`` together with an HMAC proving it knows the job
token (rank 0 makes the token and prints how to attach).  Workers serve that client until
it detaches, then wait for session ``g + 1``; a client that exits the mesh ends the job.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket

from ..rendezvous import ATTACH, attach_scope, new_token, proof

log = logging.getLogger("tdmesh.worker")


def publish_job(store, rank: int, world_size: int, local_world_size: int) -> str:
    """Rank 0 makes the job token; every rank returns it.  Rank 0 prints how to attach."""
    scope = attach_scope()
    if rank == 0:
        token = new_token()
        store.set(scope + "/world", f"{world_size},{local_world_size}")
        store.set(scope + "/token", token)
        store.set(ATTACH + "/current", scope)
        host = os.environ.get("MASTER_ADDR", socket.gethostname())
        port = os.environ.get("MASTER_PORT", "?")
        print(f"tdmesh: {world_size} workers are serving; attach with "
              f"tdmesh.attach('{host}:{port}', token='{token}')", flush=True)
    return store.get(scope + "/token").decode()


def wait_for_client(store, job_token: str, session: int):
    """Block until session ``session`` is announced; returns (host, port, session token).

    Announcements without a valid proof are logged and ignored (the fleet keeps waiting)."""
    key = f"{attach_scope()}/{session}/controller"
    text = store.get(key).decode()
    if text == "exit":
        return None
    host, port, token, signature = text.split("|")
    if not hmac.compare_digest(signature, proof(job_token, session, host, port, token)):
        log.error("ignored an attach announcement for session %d without the job token's proof", session)
        return "bad"
    return host, int(port), token
