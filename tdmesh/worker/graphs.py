"""Compiled functions as CUDA graphs: a program captured once, then replayed with one launch.

The client asks for a graph (``DefineRecording.mode``) only for recordings it has checked can
be one: CUDA tensors only, one stream, no borrows or user functions, no input written in place,
no result viewing an input or a captured tensor.  Every rank gets the same mode, so every rank
runs the same collectives in the same order whether it replays the graph or not (a graph's NCCL
kernels are the same calls on the same communicators as eager ones).

The first call runs the program (warm-up: cuBLAS handles, NCCL communicators, the allocator);
the next ``TRIALS`` run it too, timed; then it is captured with static copies of the inputs and
replayed, and the first ``TRIALS`` replays are timed the same way: CUDA events around each call
on the stream, so a time counts the GPU's work and its waits for the host's launches alike.  A
graph whose median is slower than the program's (by more than ``MARGIN``) is dropped and the
recording stays a program (the mode says so with both figures), with ``cuda_graph=True`` too
(there it asks that the function can be captured): a graph saves launches, and where the launches
were not the cost it can cost more (its own memory pool, the copies at its edges).
Later calls copy their inputs into the static copies and replay.  Captured tensors are read and written where they are
(their memory never moves: the client holds them for as long as the recording exists); results
are fresh tensors (copies of the graph's outputs, which the next replay overwrites; one
multi-tensor copy for all of them).  A call
with a poisoned input runs the program instead (message-by-message semantics), and a capture
that fails (a host sync, a CPU op feeding the device, ...) leaves the recording a program for
good, with a warning in the worker's log; in mode ``cuda_graph_required`` it fails the call.
"""

from __future__ import annotations

import logging

import torch

from ..config import env_int
from ..protocol import messages as m
from .programs import Program
from .streams import Stream

log = logging.getLogger("tdmesh.worker")

TRIALS = env_int("TDMESH_GRAPH_TRIALS")  # timed calls of each form before the choice (0: a graph is kept untimed)
MARGIN = 0.02  # a graph this much slower than the program (median call) is dropped


class CaptureFailed(RuntimeError):
    """A recording compiled with ``cuda_graph=True`` could not be captured on this worker."""


class GraphedProgram:
    """A program that runs as one CUDA graph from its second call on."""

    def __init__(self, program: Program, required: bool) -> None:
        self.program = program
        self.stream = program.stream
        self.required = required
        self.warmed = False  # the first call runs the program: cuBLAS, NCCL and the allocator warm up
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed: str | None = None
        self.static_inputs: list[torch.Tensor] = []
        self.static_outputs: list[torch.Tensor] = []
        self.timed: dict[str, list] = {"program": [], "graph": []}  # (start, end) CUDA events per call
        self.chosen: str | None = None  # why the graph was kept or dropped, with both medians

    @property
    def mode(self) -> str:
        inner = self.program.mode  # "program", or "inductor"
        prefix = "inductor+" if inner == "inductor" else ""
        if self.graph is not None:
            return prefix + "cuda_graph" + (f" ({self.chosen})" if self.chosen else "")
        if self.chosen:
            return f"{inner} ({self.chosen})"
        return f"{inner}: capture failed ({self.failed})" if self.failed else f"{inner} (not captured yet)"

    def _timing(self, form: str):
        """Events around this call while ``form``'s trials last (None once they are done)."""
        if self.chosen is not None or len(self.timed[form]) >= TRIALS:  # also TRIALS == 0: never timed
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.timed[form].append((start, end))
        start.record()
        return end

    def _choose(self) -> None:
        """After the graph's trials: keep it, or drop it where the program was faster."""
        def median(form: str) -> float:
            times = sorted(s.elapsed_time(e) for s, e in self.timed[form])
            return times[len(times) // 2]
        self.timed["graph"][-1][1].synchronize()  # once per recording
        program, graph = median("program"), median("graph")
        if graph > program * (1 + MARGIN):
            self.chosen = f"a CUDA graph was slower: {graph:.3f} against {program:.3f} ms a call"
            self.graph, self.static_inputs, self.static_outputs = None, [], []
            log.info("recording %s stays a program: %s", self.program.recording, self.chosen)
        else:
            self.chosen = f"measured {graph:.3f} against {program:.3f} ms a call as a program"

    def call(self, call: m.CallRecording, stream: Stream) -> None:
        program = self.program
        env = stream.env
        inputs: list = [env.get(a) for a in call.actuals]
        if not (all(isinstance(v, torch.Tensor) for v in inputs)
                and all(isinstance(env.get(r), torch.Tensor) for r in program.capture_refs)):
            return program.call(call, stream)  # poisoned or missing inputs: the program's own semantics
        if self.graph is None:
            if not self.warmed:
                self.warmed = True
                return program.call(call, stream)
            end = self._timing("program")
            if end is not None or self.chosen is not None:  # a timed trial, or the program was chosen
                program.call(call, stream)
                if end is not None:
                    end.record()
                return
            if self.failed is None:
                try:
                    self._capture(inputs, env)
                except Exception as e:  # noqa: BLE001 - any capture failure falls back (or fails the call)
                    self.failed = f"{type(e).__name__}: {e}{program.failed_step(e)}"
                    log.warning("recording %s runs as a program, not a CUDA graph: its capture failed: %s",
                                program.recording, self.failed)
            if self.graph is None:
                if not self.required:
                    return program.call(call, stream)
                error = CaptureFailed(f"tdmesh.compile(cuda_graph=True): the function could not be captured as "
                                      f"a CUDA graph on worker {program.interp.rank}: {self.failed}")
                program.interp.fail(env, call.seq, call.results, (), error, "cuda graph capture")
                return
            end = self._timing("graph")
        else:
            end = self._timing("graph")  # the inputs' copies are the graph's cost too
            for static, value in zip(self.static_inputs, inputs):
                if static.data_ptr() != value.data_ptr():
                    static.copy_(value)
        self.graph.replay()
        # fresh results: allocated one by one (the caching allocator: no kernel) and filled by one
        # multi-tensor copy, not a clone (a kernel launch) each: a training step's gradients are
        # about a hundred results
        outs = self.static_outputs
        fresh = [torch.empty_like(out) for out in outs]
        if fresh:
            torch._foreach_copy_(fresh, outs)
        for ref, value in zip(call.results, fresh):
            env[ref] = value
        if end is not None:
            end.record()
            if len(self.timed["graph"]) == TRIALS:
                self._choose()

    def _capture(self, inputs: list[torch.Tensor], env: dict) -> None:
        program = self.program
        self.static_inputs = [v.clone() for v in inputs]
        scratch: dict = {r: env[r] for r in program.capture_refs}
        formals = tuple(("in", i) for i in range(len(inputs)))
        results = tuple(("out", j) for j in range(program.result_count))
        scratch.update(zip(formals, self.static_inputs))
        graph = torch.cuda.CUDAGraph()
        # in the program's grad mode (Program.call): an eager op on this stream since its last call may have turned
        # it on, and an optimizer's in-place writes to parameters inside an inductor graph then refuse to run
        torch._C._set_grad_enabled(False)
        # thread_local: the worker's other streams (threads) may launch work while this one captures
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            program.run(scratch, formals, results)
        self.static_outputs = [scratch[k] for k in results]
        self.graph = graph
