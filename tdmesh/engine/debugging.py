"""The client's end of remote debugging: a worker's pdb session in this terminal.

A rank stopped at ``breakpoint()`` in a remote function sends what its pdb printed and asks
for a line (``DebuggerRead``; see :mod:`tdmesh.worker.debugger`).  The user's thread applies
that message like any reply, while it waits on a value or drains the fleet at exit: it prints
the output, reads a line from this process's stdin and sends it to that rank alone.  One rank
has the terminal at a time; requests from other ranks wait, in arrival order, until its session
ends (``DebuggerDone``).  The reader thread notes which ranks are stopped, so the supervisor
does not take a rank sitting in pdb for a stuck op.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..protocol import messages as m

__all__ = ["Debugger"]


class Debugger:
    def __init__(self, client) -> None:
        self.client = client
        self.stopped: set[int] = set()  # ranks in a pdb session or waiting for the terminal
        self.current: int | None = None  # the rank whose session has the terminal
        self.waiting: dict[int, m.DebuggerRead] = {}
        self.handlers: dict[type, Callable[[int, Any], None]] = {
            m.DebuggerRead: self.DebuggerRead, m.DebuggerDone: self.DebuggerDone}

    def seen(self, msg: m.DebuggerRead | m.DebuggerDone) -> None:
        """From the reader thread, as the message arrives (before the user's thread applies it)."""
        if type(msg) is m.DebuggerRead:
            self.stopped.add(msg.rank)
        else:
            self.stopped.discard(msg.rank)

    # handlers, on the user's thread
    def DebuggerRead(self, child: int, msg: m.DebuggerRead) -> None:
        if self.current is not None and self.current != msg.rank:
            self.waiting[msg.rank] = msg
            return
        self._prompt(msg)

    def DebuggerDone(self, child: int, msg: m.DebuggerDone) -> None:
        _show(msg.output)
        if self.current == msg.rank:
            self.current = None
        if self.current is None and self.waiting:
            self._prompt(self.waiting.pop(next(iter(self.waiting))))

    def _prompt(self, msg: m.DebuggerRead) -> None:
        if self.current is None:
            self.current = msg.rank
            _show(f"[tdmesh] pdb on worker rank {msg.rank} {self.client.info.describe(msg.rank)}: "
                  f"'c' resumes it, 'q' makes its remote function raise BdbQuit\n")
        _show(msg.output)
        line = sys.stdin.readline() if sys.stdin is not None else ""  # "": end of input, pdb quits
        self.client.send_setup(m.DebuggerInput(line), ranks=(msg.rank,))
        self.client.flush()


def _show(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
