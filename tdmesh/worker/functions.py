"""Turning a function reference from the wire into a callable on the worker.

The client sends an import path (``"torch.ops.aten.add.Tensor"``, ``"os.path.split"``)
or the pickled bytes of a callable that has no importable path.  Resolution is cached:
the hot path resolves the same few aten ops over and over.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from ..errors import ResolveError
from ..protocol.codec import load_callable

_cache: dict[Any, Callable] = {}


def clear() -> None:
    """Forget resolved functions (a pooled worker's next job may send other pickled ones)."""
    _cache.clear()


def resolve(function: Any) -> Callable:
    """The callable named by ``function`` (an import path or pickled bytes)."""
    try:
        return _cache[function]
    except (KeyError, TypeError):
        pass
    if isinstance(function, str):
        path, _, registrar = function.partition("@")  # "torch.ops.ns.op.overload@module that defines it"
        if registrar:
            try:
                importlib.import_module(registrar)
            except ImportError as e:
                raise ResolveError(f"failed to resolve function {path!r}: the module that defines it, "
                                   f"{registrar!r}, does not import on this worker ({e})") from None
        fn = _import_path(path)
    elif isinstance(function, bytes):
        try:
            fn = _loads(function)
        except Exception as e:
            raise ResolveError(f"failed to resolve function: could not unpickle it on the worker "
                               f"({type(e).__name__}: {e})") from e
    else:
        raise ResolveError(f"failed to resolve function {function!r}: expected an import path or pickled bytes")
    if not callable(fn):
        raise ResolveError(f"failed to resolve function {function!r}: {type(fn).__name__} is not callable")
    if len(_cache) < 4096:
        _cache[function] = fn
    return fn


def _loads(data: bytes):
    import cloudpickle  # noqa: F401  (cloudpickled payloads unpickle with plain pickle once it is importable)
    return load_callable(data)


def _import_path(path: str) -> Callable:
    parts = path.split(".")
    if len(parts) < 2 or not all(parts):
        raise ResolveError(f"failed to resolve function {path!r}: expected a dotted path like 'os.path.split'")
    module = None
    error = None
    for i in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError as e:
            error = error or e
            continue
        obj: Any = module
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError as e:
            raise ResolveError(f"failed to resolve function {path!r}: {e}") from None
        return obj
    raise ResolveError(f"failed to resolve function {path!r}: no importable module ({error})")


def take_part_when_poisoned(fn, args, kwargs, device, rank: int) -> None:
    """A call whose argument failed upstream is not made (its results are poisoned); a function whose
    peers would wait for it in a collective (``fn.on_poison``, e.g. a backward that reduces gradients as
    it goes) is told, so it takes part anyway."""
    on_poison = getattr(fn, "on_poison", None)
    if on_poison is None:
        return
    try:
        on_poison(args, kwargs or {}, device)
    except Exception:  # noqa: BLE001 - its results are poisoned already; a broken collective shows there
        logging.getLogger("tdmesh.worker").exception("tdmesh worker %d: %s could not take part in its collectives",
                                                     rank, getattr(fn, "__name__", fn))
