"""Real models no one here wrote: Hugging Face ``transformers`` GPT-2, Llama and ResNet (tiny
configs, random weights) trained on a CPU mesh eagerly and under ``tdmesh.compile`` from the
first step, against the same code run locally with torch: every loss identical, bit for bit,
and so are the parameters after the last step (``bench/compile_models.py`` holds the rows;
the local reference runs on one thread, as the workers do: two thread counts may sum a matmul
in different orders).  On a GPU host ``mesh1`` is a CUDA worker: the reference then runs on the
local GPU and the rows must agree within 1e-5 relative (issue 26's bound for one H200), since
CUDA kernels do not promise one summation order from run to run."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from _logs import kept_records  # noqa: E402

from bench.compile_models import CPU_ROWS, ROWS, local_reference, on_mesh  # noqa: E402
from tdmesh.engine.backward import COUNTS  # noqa: E402

STEPS = 6


@pytest.fixture(scope="module")
def reference(mesh1):
    rows = ROWS + (CPU_ROWS if mesh1.device_type == "cpu" else [])
    return {row: local_reference(*row, STEPS, mesh1.device_type) for row in rows}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind,optimizer", ROWS + CPU_ROWS, ids=[f"{k}-{o}" for k, o in ROWS + CPU_ROWS])
def test_hf_model_trains_on_a_mesh_as_it_trains_locally(mesh1, reference, kind, optimizer, compiled):
    if (kind, optimizer) in CPU_ROWS and mesh1.device_type != "cpu":
        pytest.skip("a CPU row: its fixes (fake CPU propagation, float32 _grouped_mm) are CPU workers'")
    state, want_losses, want_params = reference[kind, optimizer]
    on_workers = COUNTS["workers"]
    losses, params, fn = on_mesh(mesh1, kind, optimizer, state, STEPS, compiled)
    if not compiled:  # every eager backward ran on the workers' own autograd (tdmesh/engine/backward.py)
        assert COUNTS["workers"] - on_workers == STEPS
    if mesh1.device_type == "cpu":
        assert losses == want_losses
        assert all(torch.equal(a, b) for a, b in zip(params, want_params))
    else:
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=0)
        for a, b in zip(params, want_params):
            torch.testing.assert_close(a, b.cpu(), rtol=1e-5, atol=1e-7)
    if not compiled:
        return
    if optimizer == "adamw_foreach":  # reads its step counters on the host: eager, with one warning
        assert fn.eager_because is not None and not fn.recordings
        said = [s for s in fn.said if "runs eagerly" in s]
        assert len(said) == 1 and "fused=True" in said[0] and "compile_models.py" in said[0], said
    else:  # new gradients each step settle at the third call; the rest are replays
        assert fn.eager_because is None and not fn.said
        assert sum(r.replays for r in fn.recordings.values()) == STEPS - 3


def test_a_compiled_moe_step_settles_while_a_handler_keeps_torchs_fake_mode_records(mesh1, reference):
    """A full suite run saw Mixtral's compiled step never settle: each of its float32 _grouped_mm
    propagations failed in torch's fake mode, which logged the traceback; where a handler keeps such
    records (pytest's log capture, once an earlier test had made torch's loggers propagate), their
    frames kept every traced call's state alive, so each call looked as if a later one read it.
    Propagation's failures are not logged now (tdmesh/engine/propagation.py)."""
    if mesh1.device_type != "cpu":
        pytest.skip("a CPU row")
    state, want_losses, _ = reference["mixtral", "fused_adamw"]
    with kept_records() as kept:
        losses, _, fn = on_mesh(mesh1, "mixtral", "fused_adamw", state, STEPS, True)
    assert losses == want_losses and not kept
    assert fn.eager_because is None and sum(r.replays for r in fn.recordings.values()) == STEPS - 3
