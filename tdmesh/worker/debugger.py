"""``breakpoint()`` in a remote function: a pdb whose terminal is the client's.

While a client is served, ``sys.breakpointhook`` starts a :class:`RemotePdb` on the calling
(stream) thread.  Its output is collected; each time it wants a line the worker sends what it
printed as a ``DebuggerRead`` and waits for a ``DebuggerInput``, which the message thread
puts in a queue, so a stream stopped in pdb never stops the worker from reading messages (and
heartbeats go on, from their own thread).  A session ends, with a ``DebuggerDone``, when the
user resumes (``c``, or ``q``: the remote function then raises ``bdb.BdbQuit``, reported as any
failure of it is) or when the remote function returns while being stepped through; only then
may another stream of this worker (or, on the client, another rank) have the terminal.
"""

from __future__ import annotations

import os
import pdb
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..protocol import messages as m


class Console:
    """One worker session's end of the terminal: the lines the client sends, and who has them."""

    def __init__(self, rank: int, send: Callable[[Any], None]) -> None:
        self.rank = rank
        self.send = send
        self.lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._terminal = threading.Lock()  # one pdb session at a time on this worker
        self._holder: RemotePdb | None = None
        # per thread: seconds spent in pdb sessions that ended, and when the open one began; the
        # dashboard's sampler leaves that time out of a running op's age (a rank in pdb is not stuck)
        self._pdb_seconds: dict[int, float] = {}
        self._opened: dict[int, float] = {}

    def pdb_seconds(self, thread: int | None, now: float) -> float:
        """Seconds ``thread`` has spent in pdb sessions so far (``time.monotonic`` clock), the open one included."""
        if thread is None:
            return 0.0
        opened = self._opened.get(thread)
        return self._pdb_seconds.get(thread, 0.0) + (now - opened if opened is not None else 0.0)

    def breakpoint(self, *args, **kwargs) -> None:
        """``sys.breakpointhook``: stop the caller in a pdb driven from the client's terminal
        (``PYTHONBREAKPOINT=0`` turns breakpoints off, as it does for Python's own hook)."""
        if os.environ.get("PYTHONBREAKPOINT") == "0":
            return
        frame = sys._getframe(1)
        RemotePdb(self, remote_function_frame(frame)).set_trace(frame)

    def read_line(self, session: RemotePdb) -> str:
        """Send what ``session`` printed and wait for the user's next line (its session opens first)."""
        if self._holder is not session:
            self._opened.setdefault(threading.get_ident(), time.monotonic())  # waiting for the terminal counts
            self._terminal.acquire()
            self._holder = session
        self.send(m.DebuggerRead(self.rank, session.stdout.take()))
        return self.lines.get()

    def end(self, session: RemotePdb, note: str = "") -> None:
        """``session`` gives the terminal back (nothing to do if it does not hold it)."""
        if self._holder is session:
            self._holder = None
            thread = threading.get_ident()
            opened = self._opened.pop(thread, None)
            if opened is not None:
                self._pdb_seconds[thread] = self._pdb_seconds.get(thread, 0.0) + time.monotonic() - opened
            self.send(m.DebuggerDone(self.rank, session.stdout.take() + note))
            self._terminal.release()


def remote_function_frame(frame):
    """The outermost frame of the user's code: the one that tdmesh's worker called (or None)."""
    while frame is not None:
        caller = frame.f_back
        if caller is not None and caller.f_globals.get("__name__", "").startswith("tdmesh.worker."):
            return frame
        frame = caller
    return None


class _Output:
    """pdb's stdout: what it prints is held until it wants a line or the session ends."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def take(self) -> str:
        text = "".join(self.parts)
        self.parts.clear()
        return text


class _Input:
    """pdb's stdin: a line from the client's terminal."""

    def __init__(self, console: Console, session: RemotePdb) -> None:
        self.console = console
        self.session = session

    def readline(self) -> str:
        return self.console.read_line(self.session)


class RemotePdb(pdb.Pdb):
    """A pdb on a worker's stream thread, its prompt naming the rank."""

    stdout: _Output  # type: ignore[assignment]  # pdb only writes to it: the text waits for the client

    def __init__(self, console: Console, function_frame) -> None:
        super().__init__(stdin=_Input(console, self), stdout=_Output(), nosigint=True)  # type: ignore[arg-type]
        self.prompt = f"(Pdb rank {console.rank}) "
        self.console = console
        self.function_frame = function_frame
        self.resumed = False

    def set_continue(self) -> None:
        self.resumed = True
        super().set_continue()

    def set_quit(self) -> None:
        self.resumed = True
        super().set_quit()

    def interaction(self, frame, traceback) -> None:
        self.resumed = False
        super().interaction(frame, traceback)
        if self.resumed:  # continue or quit: the terminal is free; a step keeps it
            self.console.end(self)

    def get_stack(self, f, t):
        """The stack that ``w``, ``u`` and ``d`` walk starts at the remote function, not in tdmesh."""
        stack, index = super().get_stack(f, t)
        first = next((i for i, (frame, _) in enumerate(stack) if frame is self.function_frame), 0)
        return stack[first:], max(0, index - first)

    def dispatch_return(self, frame, arg):
        """When the remote function returns, tracing stops (tdmesh's own frames are not the
        user's to step through) and an open session ends."""
        result = super().dispatch_return(frame, arg)
        if frame is not self.function_frame:
            return result
        sys.settrace(None)
        caller = frame.f_back
        while caller is not None:
            caller.f_trace = None
            caller = caller.f_back
        self.console.end(self, f"[tdmesh] the remote function returned; rank {self.console.rank} runs on\n")
        return None
