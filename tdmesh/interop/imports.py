"""``when_imported(name, fn)``: ``fn(module)`` once ``name`` is imported, now if it already is.

The adaptations of libraries a script may import after its first activation of a mesh (``transformers``
inside the ``with mesh.activate():`` block) are installed the moment the library's module has run."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable

__all__ = ["when_imported"]

_lock = threading.Lock()


class _Loader(importlib.abc.Loader):
    """The module's own loader, and then the hooks waiting for it."""

    def __init__(self, loader, hooks: list) -> None:
        self.loader, self.hooks = loader, hooks

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        for hook in self.hooks:
            try:
                hook(module)
            except Exception:  # noqa: BLE001 - the user's import goes on; the adaptation is missing, and said so
                logging.getLogger("tdmesh").exception("tdmesh could not adapt %s for meshes", module.__name__)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.waiting: dict[str, list[Callable]] = {}

    def find_spec(self, name, path, target=None):
        hooks = self.waiting.get(name)
        if hooks is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        del self.waiting[name]
        spec.loader = _Loader(spec.loader, hooks)
        return spec


_finder = _Finder()


def when_imported(name: str, fn: Callable) -> None:
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _finder.waiting.setdefault(name, []).append(fn)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    fn(module)
