"""The data-parallel training step the compiled-step suites (tests/fleet/test_programs.py,
tests/gpu/test_cuda_graphs.py) run eagerly and compiled: what bench/train_step.py times."""

from __future__ import annotations

import torch.nn.functional as F

import tdmesh


def data_parallel_step(model, opt, mesh):
    """``step(x, y) -> loss``: forward, backward, gradients averaged over the whole mesh with one
    bucketed reduce, an optimizer step; the gradients stay the same tensors, as a recording needs."""
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        tdmesh.reduce_([p.grad for p in model.parameters()], mesh.names, "avg")
        opt.step()
        return loss.detach()
    return step
