"""The worker's message interpreter: a ref table and one handler per message.

Values that could not be computed are stored as :class:`Poison`.  Only the op that raised
reports ``RemoteFunctionFailed``; ops that read a poisoned ref poison their own results
silently, because the controller's dataflow history already knows they depend on the root.
"""

from __future__ import annotations

import logging
import pickle
import traceback
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves, tree_map

from .. import messages as m
from .functions import resolve
from .mesh import WorkerMesh

log = logging.getLogger("tdmesh.worker")


class Poison:
    """The slot of a value whose computation failed at ``seq``."""
    __slots__ = ("seq", "message")

    def __init__(self, seq: int, message: str) -> None:
        self.seq = seq
        self.message = message

    def __repr__(self) -> str:
        return f"Poison(seq={self.seq}, {self.message!r})"


class DependentOnError(Exception):
    def __init__(self, poison: Poison) -> None:
        super().__init__(poison.message)
        self.poison = poison


class ProtocolViolation(RuntimeError):
    """A message this worker cannot interpret: a bug or a foreign peer, never ignored."""


class Interpreter:
    """Executes client messages in order for one worker rank.

    ``send`` delivers a worker->client message.  Streams other than the default one come
    with the streams issue; every message carries its stream id already.
    """

    current: "Interpreter | None" = None  # this process's interpreter, for builtins that report on it

    def __init__(self, rank: int, device: torch.device, send: Callable[[Any], None]) -> None:
        Interpreter.current = self
        self.rank = rank
        self.device = device
        self.send = send
        self.env: dict[int, Any] = {}
        self.caused_error = False
        self.exit_request: m.Exit | None = None
        self._handlers = {cls: getattr(self, cls.__name__) for cls in m.CLIENT_TO_WORKER}

    # -- dispatch ----------------------------------------------------------------------
    def handle(self, msg) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise ProtocolViolation(f"worker {self.rank} got an unknown message {type(msg).__name__}: {msg!r}")
        handler(msg)

    # -- handlers (named after their messages) -------------------------------------------
    def CallFunction(self, msg: m.CallFunction) -> None:
        try:
            fn = resolve(msg.function)
            args = self._resolve(msg.args)
            kwargs = self._resolve(msg.kwargs) if msg.kwargs else {}
            self._bind(msg.results, fn(*args, **kwargs))
        except DependentOnError as e:
            self._poison(msg.results, msg.mutates, e.poison)
        except ProtocolViolation:
            raise  # a broken message, not a failing user function: the worker loop stops
        except Exception as e:
            self._fail(msg.seq, msg.results, msg.mutates, e, msg.function)

    def SendValue(self, msg: m.SendValue) -> None:
        try:
            fn = resolve(msg.function) if msg.function is not None else None
            args = self._resolve(msg.args)
            kwargs = self._resolve(msg.kwargs) if msg.kwargs else {}
            if fn is None:
                if len(args) != 1 or kwargs:
                    raise ProtocolViolation("SendValue without a function takes exactly one argument")
                value = args[0]
            else:
                value = fn(*args, **kwargs)
            payload = pickle.dumps(tree_map(_to_fetchable, value), protocol=pickle.HIGHEST_PROTOCOL)
        except DependentOnError as e:
            self._poison((), msg.mutates, e.poison)
            self.send(m.FetchResult(msg.seq, None, m.DependentError(e.poison.seq)))
            return
        except ProtocolViolation:
            raise
        except Exception as e:
            self._fail(msg.seq, (), msg.mutates, e, msg.function)
            self.send(m.FetchResult(msg.seq, None, m.DependentError(msg.seq)))
            return
        self.send(m.FetchResult(msg.seq, payload))

    def DeleteRefs(self, msg: m.DeleteRefs) -> None:
        env = self.env
        for ref in msg.refs:
            env.pop(ref, None)

    def RequestStatus(self, msg: m.RequestStatus) -> None:
        self.send(m.Status(self.rank, msg.seq + 1))

    def CommandGroup(self, msg: m.CommandGroup) -> None:
        for command in msg.commands:
            self.handle(command)

    def Exit(self, msg: m.Exit) -> None:
        self.exit_request = msg

    # -- helpers ---------------------------------------------------------------------------
    def _resolve(self, obj):
        t = type(obj)
        if t is m.Ref:
            try:
                value = self.env[obj.id]
            except KeyError:
                raise ProtocolViolation(f"ref {obj.id} is not defined on worker {self.rank}: it was deleted "
                                        f"or never created") from None
            if type(value) is Poison:
                raise DependentOnError(value)
            return value
        if t is tuple or t is list:
            return t(self._resolve(x) for x in obj)
        if t is dict:
            return {k: self._resolve(v) for k, v in obj.items()}
        if t is m.MeshArg:
            return WorkerMesh(obj.shape, self.rank, self.device)
        if t is torch.device and obj.type != "cpu":
            return self.device
        return obj

    def _bind(self, results: tuple, value) -> None:
        if not results:  # the client asked for no results (propagate="inspect")
            return
        if len(results) == 1 and isinstance(value, torch.Tensor):
            if results[0] is not None:
                self.env[results[0]] = value
            return
        leaves = tree_leaves(value)
        if len(leaves) != len(results):
            raise TypeError(f"function returned {len(leaves)} values where the client expected "
                            f"{len(results)}")
        env = self.env
        for ref, leaf in zip(results, leaves):
            if ref is not None:
                env[ref] = leaf

    def _poison(self, results, mutates, poison: Poison) -> None:
        env = self.env
        for ref in results:
            if ref is not None:
                env[ref] = poison
        for ref in mutates:
            env[ref] = poison

    def _fail(self, seq, results, mutates, error: BaseException, function) -> None:
        self.caused_error = True
        tb = traceback.format_exc()
        name = function if isinstance(function, str) else getattr(error, "__qualname__", "a pickled function")
        log.debug("seq %s failed on worker %s running %s:\n%s", seq, self.rank, name, tb)
        self.send(m.RemoteFunctionFailed(seq, self.rank, type(error).__name__, str(error), tb))
        self._poison(results, mutates, Poison(seq, f"{type(error).__name__}: {error}"))


def _to_fetchable(leaf):
    """Tensors travel to the client on CPU, carrying only their own elements."""
    if isinstance(leaf, torch.Tensor):
        leaf = leaf.detach()
        if leaf.device.type != "cpu":
            leaf = leaf.cpu()
        return m.pack_tensor(leaf)
    return leaf
