"""The records a logger emits while a block runs, kept as a handler of the user's (pytest's log
capture) would keep them: read by the suites that check tdmesh's propagation logs nothing
(tests/fleet/test_device_metadata.py, tests/fleet/test_hf_models.py)."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def kept_records(name: str = "torch._subclasses.fake_tensor"):
    """Yields the list the records of logger ``name`` are appended to while the block runs."""
    records: list = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
