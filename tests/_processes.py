"""Whether a worker process is gone: what the tests that kill or stop fleets check (no process left behind)."""

from __future__ import annotations

import os
import time


def gone(pid: int, within: float = 30.0) -> bool:
    """True once ``pid`` has exited (reaped here where it is this process's child), within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a child of this process that exited: reap it, else it lingers as a zombie
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.1)
    return False
