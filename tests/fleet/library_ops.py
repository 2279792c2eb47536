"""A library op registered without a fake (meta) implementation, as user libraries often
are: the client cannot derive its output shape, so a mesh runs it and asks the workers."""

import torch


@torch.library.custom_op("tdmesh_tests::every_other", mutates_args=())
def every_other(x: torch.Tensor) -> torch.Tensor:
    return x[::2].clone()


@torch.library.custom_op("tdmesh_tests::positives", mutates_args=())
def positives(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0].clone()
