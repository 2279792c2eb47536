"""The local fleet's worker processes, as torch.distributed.elastic started them (``tdmesh.local_mesh``)."""

from __future__ import annotations

import shutil
import threading
import time


class SerialProcesses:
    """torch.distributed.elastic's process context, with its polls made one at a time.

    Its ``wait`` iterates the set of running ranks that the same call shrinks, without a
    lock; the client's reader thread (describing dead workers) and the thread that exits the
    fleet both poll it, and two polls at once fail with "Set changed size during iteration".
    """

    def __init__(self, pcontext, owned_dir: str | None = None) -> None:
        self._pcontext = pcontext
        self._lock = threading.Lock()
        self.owned_dir = owned_dir  # torch elastic's run directory where tdmesh made it: removed at close
        # healing (tdmesh.FaultTolerance): a dead worker must not stop the others, as elastic's poll does
        self.tolerant = False
        self.forgiven: set[int] = set()  # processes whose death was healed: no failure of the fleet's
        self._added: list = []  # the process contexts of workers started in a dead one's place (one each)

    def add(self, pcontext) -> int:
        """A worker started in a dead one's place (its own context of one process): its index here."""
        with self._lock:
            self._added.append(pcontext)
            return len(self._pcontext.subprocess_handlers) + len(self._added) - 1

    def _handlers(self) -> dict:
        handlers = dict(self._pcontext.subprocess_handlers)
        base = len(handlers)
        for i, added in enumerate(self._added):
            handlers[base + i] = added.subprocess_handlers[0]
        return handlers

    def _error_file(self, index: int) -> str:
        base = len(self._pcontext.subprocess_handlers)
        return self._pcontext.error_files[index] if index < base else self._added[index - base].error_files[0]

    def wait(self, timeout: float = -1, period: float = 1):
        with self._lock:
            if self.tolerant:
                return self._tolerant_wait(timeout, period)
            return self._pcontext.wait(timeout=timeout, period=period)

    def _tolerant_wait(self, timeout: float, period: float):
        """Elastic's ``wait`` without its ``close`` of every process once one failed: the failures of the
        processes not forgiven, or a result once all of them exited, or None."""
        from torch.distributed.elastic.multiprocessing.api import ProcessFailure, RunProcsResult
        handlers = self._handlers()
        deadline = time.monotonic() + (timeout if timeout >= 0 else float("inf"))
        while True:
            codes = {r: h.proc.poll() for r, h in handlers.items() if r not in self.forgiven}
            failures = {r: ProcessFailure(local_rank=r, pid=handlers[r].proc.pid, exitcode=code,
                                          error_file=self._error_file(r))
                        for r, code in codes.items() if code not in (None, 0)}
            if failures or all(code is not None for code in codes.values()):
                return RunProcsResult(failures=failures, stdouts=self._pcontext.stdouts,
                                      stderrs=self._pcontext.stderrs)
            if time.monotonic() >= deadline:
                return None
            time.sleep(period)

    def pid(self, index: int) -> int | None:
        if not hasattr(self._pcontext, "subprocess_handlers"):
            return None
        handler = self._handlers().get(index)
        return handler.proc.pid if handler is not None else None

    def close(self, *args, **kwargs):
        with self._lock:
            try:
                for added in self._added:
                    added.close(*args, **kwargs)
                return self._pcontext.close(*args, **kwargs)
            finally:
                if self.owned_dir is not None:
                    shutil.rmtree(self.owned_dir, ignore_errors=True)
                    self.owned_dir = None

    def __getattr__(self, name: str):
        return getattr(self._pcontext, name)
