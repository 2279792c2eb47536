"""Which compiled functions can run as CUDA graphs: decided here, on the client, for every rank.

A CUDA graph replays the kernels of one capture.  So a recording qualifies only where that is
the same as running it again: every tensor on the GPU (a CPU op would run at capture time only),
one stream, nothing but ops, aten calls and collectives (borrows, moves between meshes and user
functions run Python the graph would not), no input written in place (a graph reads its inputs
from static copies), and no result that views an input or a captured tensor (results are fresh
copies of the graph's outputs).  A host read cannot be inside a graph: a recording with reads
(``tdmesh.programs.guards``) runs its parts as programs.  Deciding on the client gives every
rank the same mode, so NCCL collectives always pair up.
"""

from __future__ import annotations

from ..errors import UsageError, user_line, warn_at_user_line
from ..protocol import messages as m

_GRAPHABLE = (m.CallOp, m.CallFunction, m.Reduce, m.ReduceMany, m.DeleteRefs)
# By default a graph is captured only for a recording of at least this many ops.  A replay costs
# one launch plus a copy per input and per result, which a handful of ops does not win back
# (measured on an H200 host: a compiled function of one add runs 48.7k calls/s as a program and
# 24.7k as a graph; of 100 adds, 1.07x and 8.2x local eager).  cuda_graph=True captures any size.
MIN_GRAPH_OPS = 10


def graph_blocker(rec, inputs) -> str | None:
    """Why recording ``rec`` (a ``recording._Recording``) cannot be a CUDA graph, or None;
    ``inputs``: the traced call's tensors."""
    if rec.guards:
        g = rec.guards[0]
        return f"it reads a value on the host ({g.what} at {g.site}): its parts run as programs between the reads"
    streams = set()
    for _, msg, _, _ in rec.messages:
        t = type(msg)
        if t not in _GRAPHABLE:
            return f"it contains a {t.__name__} (only ops, aten calls and collectives can be captured)"
        if t is m.CallFunction and type(msg.args) is bytes:
            return "it calls a remote user function (Python the graph would not run again)"
        if t is not m.DeleteRefs:
            streams.add(msg[5] if t is m.CallOp else msg.stream)
    if len(streams) > 1:
        return f"it uses {len(streams)} streams"
    others = sorted((rec.devices | {t.device.type for t in list(inputs) + rec.captures}) - {"cuda"})
    if others:
        return f"it uses tensors on {', '.join(others)} (a CUDA graph replays GPU work only)"
    written = [r for r in rec.mutated_outside if r in rec.formal_index]
    if written:
        return "it writes an input in place (a CUDA graph reads its inputs from static copies)"
    held = {id(t._r.aliases) for t in list(inputs) + rec.captures}
    if any(o[0] == "result" and o[2] is not None for o in rec.outputs) or held & set(rec.result_alias_ids):
        return "a result views an input or a captured tensor (results are copies of the graph's outputs)"
    return None


def recording_mode(backend: str, cuda_graph: bool | None, mesh, rec, inputs, compiled) -> str:
    """The DefineRecording mode of a new trace.  ``cuda_graph=None`` captures a graph on CUDA
    meshes where the recording qualifies and holds ``MIN_GRAPH_OPS`` ops or more, and says once
    (a warning) why not where it does not qualify;
    ``True`` makes that an error, raised at the user's line; ``False`` never captures."""
    if backend == "messages" or cuda_graph is False:
        return backend
    if mesh.device_type != "cuda":
        if cuda_graph:
            raise UsageError(f"tdmesh.compile(cuda_graph=True) needs a CUDA mesh; this one is on "
                             f"{mesh.device_type}\n  at {user_line()}")
        return backend
    blocker = graph_blocker(rec, inputs)
    ops = sum(type(msg) is not m.DeleteRefs for _, msg, _, _ in rec.messages)
    if blocker is None and not cuda_graph and ops < MIN_GRAPH_OPS:
        return backend  # too short to gain from a graph: a program, and nothing to warn about
    if blocker is None:
        graph = "cuda_graph_required" if cuda_graph else "cuda_graph"
        return graph if backend == "program" else f"{backend}+{graph}"
    if cuda_graph:
        raise UsageError(f"tdmesh.compile(cuda_graph=True): {compiled.__name__} cannot be captured as a CUDA graph: "
                         f"{blocker}\n  at {user_line()}")
    if not compiled.warned:
        compiled.warned = True
        warn_at_user_line(f"tdmesh.compile: {compiled.__name__} runs as a program, not a CUDA graph: {blocker}")
    return backend
