"""The call sites the client records for the ops it issues, read back by the suites that check
which user line an op is charged to (tests/fleet/test_engine.py, tests/gpu/test_gpu.py)."""

from __future__ import annotations

import contextlib

from tdmesh.errors import site_text


@contextlib.contextmanager
def recorded_sites(client):
    """Within the block, the site of every op ``client`` records in its history, as a traceback line
    (``site_text``) appended to the list this yields; the history itself records as always."""
    sites: list = []
    add = client.history.add

    def record(seq, uses, defs, site, future=None):
        sites.append(site_text(site))
        return add(seq, uses, defs, site, future)

    client.history.add = record
    try:
        yield sites
    finally:
        del client.history.add
