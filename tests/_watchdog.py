"""A time limit on every test, so that a hung test fails with the stacks of its threads
instead of holding CI until its 90 minutes run out (one did: every other result was lost).

The limit is ``TDMESH_TEST_TIMEOUT`` seconds (default 600; the slowest test takes about four
minutes on two cores); a test may raise its own with ``@pytest.mark.time_limit(seconds)``.
At the limit SIGALRM fails the test where it waits -- its fixtures' teardowns still run, so
its fleet is shut down -- and the failure's text carries every thread's stack, and those of
the test's worker processes (each writes them on SIGUSR1 into ``TDMESH_STACKS_DIR``, which
this module sets for the whole run).  If that
cannot happen (the main thread stuck in C code that never returns to Python), faulthandler
dumps the stacks two minutes later and ends the xdist process, which pytest-xdist reports as
a crashed test and replaces."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from tdmesh.config import env_float, env_str
from tdmesh.errors import thread_stacks

HARD_EXIT_GRACE_S = 120.0


def _stacks_dir() -> str:
    """The run's directory for the workers' stacks: made by the run's first process (xdist's workers inherit
    it through the environment; each made one of its own before, and none was ever removed) and removed by it
    at exit."""
    existing = env_str("TDMESH_STACKS_DIR")
    if existing:
        return existing
    made = os.environ["TDMESH_STACKS_DIR"] = tempfile.mkdtemp(prefix="tdmesh-stacks-")
    atexit.register(shutil.rmtree, made, True)
    return made


STACKS_DIR = _stacks_dir()


def _descendants(root: int) -> list[int]:
    """The pids below ``root`` (Linux /proc; none elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    except OSError:
        return []
    out, pending = [], [root]
    while pending:
        for pid in children.get(pending.pop(), []):
            out.append(pid)
            pending.append(pid)
    return out


def stacks_of_workers() -> str:
    """Every worker process below this one, asked for its stacks (SIGUSR1; tdmesh.worker)."""
    asked = []
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"tdmesh.worker" not in f.read():
                    continue
            os.kill(pid, signal.SIGUSR1)
            asked.append(pid)
        except OSError:
            continue
    time.sleep(1.0 if asked else 0)
    parts = []
    for pid in asked:
        try:
            with open(os.path.join(STACKS_DIR, f"stacks-{pid}.txt")) as f:
                parts.append(f"--- worker process {pid} ---\n{f.read()[-8000:]}")
        except OSError:
            parts.append(f"--- worker process {pid}: no stacks written ---")
    return "\n".join(parts)


def stacks_of_a_hung_client(proc) -> str:
    """What a client subprocess that did not end in time was doing: its workers' stacks
    (SIGUSR1, as above), then its own -- it was started with ``PYTHONFAULTHANDLER=1`` (see
    ``CLIENT_ENV``), so SIGABRT makes faulthandler write every thread's stack to its stderr
    before it dies.  Its stderr is read without waiting for EOF: its workers hold the pipe."""
    workers = stacks_of_workers()
    proc.send_signal(signal.SIGABRT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # still there: kill it, the stacks may still be in the pipe
        proc.kill()
    time.sleep(0.5)
    err = b""
    with contextlib.suppress(OSError, ValueError):
        fd = proc.stderr.fileno()
        os.set_blocking(fd, False)
        while chunk := os.read(fd, 1 << 16):
            err += chunk
    return f"--- the client (pid {proc.pid}) ---\n{err.decode(errors='replace')[-12000:]}\n{workers}"


# A client subprocess's environment additions for stacks_of_a_hung_client.
CLIENT_ENV = {"PYTHONFAULTHANDLER": "1"}


def limit_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("time_limit")
    if marker is not None:
        return float(marker.args[0])
    return env_float("TDMESH_TEST_TIMEOUT")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    limit = limit_of(item)
    if limit <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        stacks = thread_stacks(limit=30) + "\n" + stacks_of_workers()
        sys.stderr.write(f"\n{item.nodeid} ran past its {limit:g} s limit; the stacks:\n{stacks}\n")
        pytest.fail(f"{item.nodeid} ran past its {limit:g} s time limit (TDMESH_TEST_TIMEOUT or "
                    f"@pytest.mark.time_limit); every thread's stack when it was stopped:\n{stacks}",
                    pytrace=False)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    faulthandler.dump_traceback_later(limit + HARD_EXIT_GRACE_S, exit=True)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()


def pytest_unconfigure(config) -> None:
    """The way out after the last test (the non-daemon threads, atexit handlers, the warm pool's shutdown): a
    process still there two minutes after its interpreter began to shut down dumps its stacks and exits with
    status 1.  The clock starts when the interpreter shuts down, not here: an xdist worker that ends its last file
    early waits, idle, until the controller ends the whole session -- armed here, it was killed at two minutes
    of that wait, and xdist, replacing the "crashed" worker, failed with an INTERNALERROR (loadfile's
    scheduler knows no collection of the new one)."""
    def arm() -> None:
        faulthandler.dump_traceback_later(HARD_EXIT_GRACE_S, exit=True)

    register = getattr(threading, "_register_atexit", None)  # run before the non-daemon threads are joined
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(arm)
    except RuntimeError:  # already shutting down, or no such hook: atexit runs after those joins
        atexit.register(arm)
