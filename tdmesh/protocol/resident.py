"""The box a worker-resident Python object lives in (``mesh.spawn``, Monarch's ``OpaqueRef``).

Shared by both sides because user code makes one: a remote function that returns
``tdmesh.OpaqueRef(obj)`` returns this box, and the worker binds it to the result ref the client
allocated for it, where a later call that is passed the client's handle finds it again.  It is a
pytree leaf whatever it holds (a dict would otherwise be taken apart when the result is bound), and
it never travels: the client holds a handle, the worker holds the object.
"""

from __future__ import annotations

__all__ = ["Resident"]


class Resident:
    """One rank's worker-resident object; ``.value`` (Monarch's name) or ``.obj``."""
    __slots__ = ("obj",)

    def __init__(self, obj) -> None:
        self.obj = obj

    @property
    def value(self):
        """The object, under Monarch's name (``OpaqueRef.value``, read in a remote function)."""
        return self.obj

    @value.setter
    def value(self, obj) -> None:
        self.obj = obj

    def __reduce__(self):
        raise TypeError(f"a worker-resident {type(self.obj).__qualname__} cannot be fetched; call one of its "
                        f"methods to get values out of it")

    def __repr__(self) -> str:
        return f"<worker-resident {type(self.obj).__qualname__}>"
