"""What the user catches: a remote op failed, or the fleet itself did."""

from __future__ import annotations

import traceback
from typing import Sequence


class RemoteException(Exception):
    """A remote op failed (a deterministic problem in the user's program).

    Raised where a value that depends on the failure is observed: a fetch, or the mesh's
    exit when nobody observed it.  ``str()`` holds the rank, the user's call site, the
    worker traceback and the original exception.
    """

    def __init__(self, seq: int, rank: int, exc_type: str, message: str, worker_traceback: str,
                 call_site: Sequence[traceback.FrameSummary] | None) -> None:
        self.seq = seq
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.worker_traceback = worker_traceback
        self.call_site = list(call_site or [])
        super().__init__(self._render())

    def _render(self) -> str:
        where = "".join(traceback.format_list(self.call_site)) if self.call_site else "  <not tied to a user call>\n"
        return (f"A remote function failed on rank {self.rank}: {self.exc_type}: {self.message}\n"
                f"Issued by the client at (most recent call last):\n{where}"
                f"Traceback on worker rank {self.rank}:\n{self.worker_traceback.rstrip()}")

    def __reduce__(self):
        return (RemoteException, (self.seq, self.rank, self.exc_type, self.message, self.worker_traceback,
                                  self.call_site))


class DeviceException(Exception):
    """The fleet failed: a worker died, stopped answering, broke its device or the protocol.

    Reported once: ``observed`` turns true when the user is handed it (a fetch, an op on the
    failed mesh), and the mesh's exit raises it only if nobody was.
    """

    observed = False


def user_call_site(skip_prefixes: Sequence[str]) -> list[traceback.FrameSummary]:
    """The user's frames of the current stack: drop the innermost tdmesh/torch frames."""
    stack = traceback.extract_stack()[:-1]
    end = len(stack)
    while end > 0 and any(stack[end - 1].filename.startswith(p) for p in skip_prefixes):
        end -= 1
    return stack[max(0, end - 8):end]
