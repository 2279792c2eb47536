"""Worker side of ``mesh.spawn``: an object in the ref table, and calls of its methods."""

from __future__ import annotations

from .functions import resolve


class Resident:
    """The box an object lives in: a leaf, whatever its type (a dict subclass would otherwise
    be taken apart as a pytree when the result is bound), and never sent to the client."""
    __slots__ = ("obj",)

    def __init__(self, obj) -> None:
        self.obj = obj

    @property
    def value(self):
        """The object, under Monarch's name (``OpaqueRef.value``, read in a remote function)."""
        return self.obj

    def __reduce__(self):
        raise TypeError(f"a worker-resident {type(self.obj).__qualname__} cannot be fetched; call one of its "
                        f"methods to get values out of it")


def construct(target, args, kwargs) -> Resident:
    """``mesh.spawn``: build the object (``target`` is the class's import path or pickled bytes)."""
    return Resident(resolve(target)(*args, **kwargs))


def call_method(resident: Resident, name: str, *args, **kwargs):
    """``handle.call`` and ``handle.remote``: one method call on this rank's object."""
    if type(resident) is not Resident:
        raise TypeError(f"expected a worker-resident object (mesh.spawn), got {type(resident).__name__}")
    return getattr(resident.obj, name)(*args, **kwargs)
