"""Which compiled functions can run as CUDA graphs: decided here, on the client, for every rank.

A CUDA graph replays the kernels of one capture.  So a recording qualifies only where that is
the same as running it again: every tensor on the GPU (a CPU op would run at capture time only),
one stream, nothing but ops, aten calls and collectives (borrows, moves between meshes and user
functions run Python the graph would not), no input written in place (a graph reads its inputs
from static copies), and no result that views an input or a captured tensor (results are fresh
copies of the graph's outputs).  A host read cannot be inside a graph: a recording with reads
(``tdmesh.programs.guards``) is one graph per part that qualifies on its own (also: it writes
no tensor it is given, reads no state an earlier part makes anew every call, and does not end
with an op whose shape only the data decides), the other parts programs.  Deciding on the
client gives every rank the same mode, so NCCL collectives always pair up.
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
    ``inputs``: the traced call's tensors (one with reads: ``segment_modes``)."""
    blocker = _messages_blocker(rec.messages) or _device_blocker(rec, inputs)
    if blocker is not None:
        return blocker
    written = [r for r in rec.mutated_outside if r in rec.formal_index]
    if written:
        return "it writes an input in place (a CUDA graph reads its inputs from static copies)"
    held = {id(t._r.aliases) for t in list(inputs) + rec.captures}
    if any(o[0] == "result" and o[2] is not None for o in rec.outputs) or held & set(rec.result_alias_ids):
        return "a result views an input or a captured tensor (results are copies of the graph's outputs)"
    return None


def _messages_blocker(messages) -> str | None:
    streams = set()
    for _, msg, _, _ in messages:
        t = type(msg)
        if t not in _GRAPHABLE:
            return f"it contains a {t.__name__} (only ops, aten calls and collectives can be captured)"
        if t is m.CallFunction and type(msg.args) is bytes:
            return "it calls a remote user function (Python the graph would not run again)"
        if t is not m.DeleteRefs:
            streams.add(msg[5] if t is m.CallOp else msg.stream)
    if len(streams) > 1:
        return f"it uses {len(streams)} streams"
    return None


def _device_blocker(rec, inputs) -> str | None:
    others = sorted((rec.devices | {t.device.type for t in list(inputs) + rec.captures}) - {"cuda"})
    if others:
        return f"it uses tensors on {', '.join(others)} (a CUDA graph replays GPU work only)"
    return None


def segment_modes(backend: str, rec, inputs) -> tuple[list[str], str | None]:
    """The DefineRecording mode of each part of a recording with reads (``tdmesh.programs.guards``)
    on a CUDA mesh: a graph for each part that qualifies on its own (as a whole recording would,
    and with ``MIN_GRAPH_OPS`` ops), a program for the others; and why the first of those is not
    a graph (None: every part that has enough ops is one)."""
    graph = "cuda_graph" if backend == "program" else f"{backend}+cuda_graph"
    device = _device_blocker(rec, inputs)
    keys = {r: info[-1] for seg in rec.segments for r, info in seg.infos.items()}
    kept = set(rec.kept_refs)
    modes: list[str] = []
    why = None
    for k, seg in enumerate(rec.segments):
        ends_at_shape = k < len(rec.guards) and rec.guards[k].reads_shapes
        blocker = device or _messages_blocker(seg.messages) or _segment_blocker(seg, keys, kept, ends_at_shape)
        if blocker is None and sum(type(msg) is not m.DeleteRefs for _, msg, _, _ in seg.messages) >= MIN_GRAPH_OPS:
            modes.append(graph)
            continue
        modes.append(backend)
        if blocker is not None and why is None:
            where = f"before {rec.guards[k].what} at {rec.guards[k].site}" if k < len(rec.guards) else \
                "after its last read"
            why = f"its part {where} runs as a program: {blocker}"
    return modes, why


def _segment_blocker(seg, keys: dict, kept: set, ends_at_shape: bool) -> str | None:
    """What keeps one part from being a graph beyond what keeps a whole recording: ``keys``
    tells the storage of each tensor a part hands on (``guards._alias_keys``)."""
    if ends_at_shape:
        return "it ends with an op whose output shape only the data decides (its kernel waits for the host)"
    if set(seg.written) & set(seg.formals):
        return "it writes a tensor it is given in place (a CUDA graph reads its inputs from static copies)"
    if kept & set(seg.captures):
        return ("it reads state an earlier part makes (a graph reads a tensor where it was at its capture; "
                "that state is a new tensor every call)")
    given = {keys.get(r, ("input", r)) for r in seg.formals}
    for r in seg.new:
        key = seg.infos[r][-1]
        if key[0] != "group" or key in given:
            return "a tensor it hands on views a tensor it is given or a captured one (results are copies)"
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
    if rec.segments is not None:  # a recording with reads (never cuda_graph=True): a graph per part that can be
        rec.segment_modes, why = segment_modes(backend, rec, inputs)
        if why is not None and not compiled.warned:
            compiled.warned = True
            warn_at_user_line(f"tdmesh.compile: {compiled.__name__} reads a value on the host, and {why}")
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
