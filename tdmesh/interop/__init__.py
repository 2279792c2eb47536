"""torch's ecosystem around a training loop, on a mesh: what a training script does besides the model.

Each module adapts one idiom that a mesh would otherwise break, crash or silently change, so that it does
what torch does without a mesh (or, for SPMD idioms, what every torchrun rank does), or refuses at the
user's line naming the way out.  They install themselves at a process's first activation of a mesh
(``engine.activation.AT_FIRST_ACTIVATION``): until then torch is untouched, and outside an active mesh each
adapted function behaves exactly as torch's own.

- ``seeds``: ``torch.manual_seed`` and ``torch.cuda.manual_seed[_all]`` seed every worker of the active mesh.
- ``data``: a ``DataLoader`` iterates as plain torch (its workers forked with no mesh in them).
- ``batchnorm``: ``nn.SyncBatchNorm`` normalises with statistics over the whole mesh.
- ``hf``: Hugging Face weights in and out (``from_pretrained``, ``save_pretrained``, safetensors, ``Trainer``).
- ``distributed``: the ``torch.distributed`` calls of a torchrun script, on the mesh or refused with the way out.

docs/coverage.md ("The ecosystem around the loop") says what works, at what cost, and what is refused.
"""

from __future__ import annotations

from ..engine.activation import AT_FIRST_ACTIVATION
from . import batchnorm, data, distributed, hf, seeds

__all__ = ["install"]


def install() -> None:
    for module in (seeds, data, batchnorm, hf, distributed):
        module.install()


AT_FIRST_ACTIVATION.append(install)
