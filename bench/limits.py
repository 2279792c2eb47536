"""How far a step is from what the GPU can do: the model's FLOPs per step, the GPU's measured dense
matmul peak, and the GPU's busy time in a profiler trace (``bench.train_step`` prints them per variant).

Model FLOPs are the PaLM / nanoGPT estimate for a decoder's training step: ``6 N`` per token for the
weights (forward 2, backward 4; ``N`` without the embedding tables, which are gathers: the output head,
a matmul, counts) plus ``12 L d T`` per token for attention's two matmuls (``L`` layers, width ``d``,
context ``T``).  MFU is those FLOPs over the step's time, over the peak of one GPU measured here
(large square matmuls in the step's dtype), not a datasheet's: it is the fraction the hardware could
give this process today.
"""

from __future__ import annotations

import json


def model_flops_per_step(model, cfg, tokens: int) -> float:
    """Training FLOPs of one step of ``tokens`` tokens (one worker's batch x context)."""
    import torch
    tables = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    n = sum(p.numel() for p in model.parameters() if id(p) not in tables)
    return (6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size) * tokens


def matmul_peak(dtype: str, size: int = 8192, reps: int = 20) -> float:
    """FLOP/s of a ``size`` square matmul in ``dtype`` ("bf16" or "fp32", torch's default precision for it)
    on this process's GPU: the best of ``reps`` timed after a warm-up."""
    import torch
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    a = torch.randn(size, size, device="cuda", dtype=kind)
    b = torch.randn(size, size, device="cuda", dtype=kind)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * size ** 3 / best


def gpu_busy_s(trace_path: str, steps: int = 1) -> float:
    """Seconds a step the GPU ran kernels or copies (the union of their intervals, so streams that overlap
    count once) in a torch.profiler Chrome trace of ``steps`` steps."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy / 1e6 / steps


def top_kernels(trace_path: str, n: int = 8) -> list[tuple[str, float, int]]:
    """The ``n`` kernels that took the most GPU time in a trace: (name, ms, launches)."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    by: dict = {}
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e:
            total, count = by.get(e["name"], (0.0, 0))
            by[e["name"]] = (total + e["dur"] / 1e3, count + 1)
    return sorted(((k, t, c) for k, (t, c) in by.items()), key=lambda r: -r[1])[:n]


def mfu_line(label: str, step_s: float, flops: float, peak: float) -> str:
    rate = flops / step_s
    return f"    {label:<22}: {step_s * 1e3:8.2f} ms/step  {rate / 1e12:7.1f} TFLOP/s  MFU {rate / peak:6.1%}"
