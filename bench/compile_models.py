"""Hugging Face models trained on a 1-worker mesh, eagerly and compiled from the first step,
against the same code run locally with torch, same process (issue 26's table).

    python -m bench.compile_models                   # CPU worker: must be identical, bit for bit
    python -m bench.compile_models --device cuda     # one GPU worker against local CUDA torch

Each row: GPT-2, Llama or ResNet (tiny configs, random weights, no dropout), an optimizer as
users write it, ``opt.zero_grad()`` (new gradients every step), ``--steps`` steps of one
fixed batch.  Printed per row: the worst relative difference of the losses from the local run,
eager on the mesh and under ``tdmesh.compile`` from step 0, and how the compiled step ran.
``tests/fleet/test_hf_models.py`` runs the same rows on CPU workers.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch

import tdmesh
from bench import helpers as h

ROWS = [("gpt2", "fused_adamw"), ("resnet", "sgd_momentum"), ("llama", "sgd_nesterov_foreach"),
        ("gpt2", "adamw_foreach")]
OPTIMIZERS = {
    "fused_adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "sgd_nesterov_foreach": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, foreach=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
}


# rows that found client-metadata defects (tests/fleet/test_device_metadata.py), run on CPU workers:
# SegFormer (a convolution of a channels-last view), Longformer (views written in place),
# Mixtral (MoE experts through float32 _grouped_mm)
CPU_ROWS = [("segformer", "fused_adamw"), ("longformer", "sgd_momentum"), ("mixtral", "fused_adamw")]


def build(kind: str):
    """A tiny, dropout-free ``transformers`` model of ``kind`` (random weights)."""
    import transformers
    if kind == "segformer":  # two stages of torch's default widths: its Mix-FFN's 256 channels are the case
        return transformers.SegformerForImageClassification(transformers.SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[8, 4], hidden_sizes=[32, 64], patch_sizes=[7, 3],
            strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[4, 4], hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, drop_path_rate=0.0, num_labels=4))
    if kind == "longformer":
        return transformers.LongformerForMaskedLM(transformers.LongformerConfig(
            num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64, vocab_size=64,
            max_position_embeddings=64, attention_window=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            pad_token_id=0))
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=32, intermediate_size=32,
            vocab_size=64, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
            attn_implementation="eager"))
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, attn_implementation="eager"))
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=32, intermediate_size=64,
            vocab_size=64, max_position_embeddings=32, attn_implementation="eager"))
    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4))


def batch(kind: str) -> dict:
    g = torch.Generator().manual_seed(1)
    if kind in ("resnet", "segformer"):  # BatchNorm in train mode: running stats and num_batches_tracked are buffers
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.tensor([0, 3])}
    ids = torch.randint(1 if kind == "longformer" else 0, 64, (2, 8), generator=g)  # Longformer: 0 pads
    return {"input_ids": ids, "labels": ids}


def train(kind: str, optimizer: str, state: dict, data: dict, compiled: bool, steps: int):
    """``steps`` training steps of a model loaded from ``state``: (losses, model, the step)."""
    model = build(kind)
    model.load_state_dict(state)
    model.train()
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses, fn = run_steps(model, opt, data, compiled, steps)
    return losses, model, fn


def run_steps(model, opt, data: dict, compiled: bool, steps: int):
    """``steps`` steps as users write them (``opt.zero_grad()`` between forward and backward):
    (the detached losses, the step function, compiled by ``tdmesh.compile`` from its first call
    where ``compiled``)."""
    def step(b):
        loss = model(**b).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    fn = tdmesh.compile(step) if compiled else step
    return [fn(data) for _ in range(steps)], fn


def local_reference(kind: str, optimizer: str, steps: int, device: str) -> tuple[dict, list[float], list]:
    """The row trained with plain torch on ``device`` (one thread, as a worker runs)."""
    torch.manual_seed(0)
    state = build(kind).state_dict()
    on = {k: v.to(device) for k, v in state.items()}
    data = {k: v.to(device) for k, v in batch(kind).items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.device(device):
            losses, model, _ = train(kind, optimizer, on, data, False, steps)
        return state, [x.item() for x in losses], [p.detach().cpu() for p in model.parameters()]
    finally:
        torch.set_num_threads(threads)


def on_mesh(mesh, kind: str, optimizer: str, state: dict, steps: int, compiled: bool):
    """The row on ``mesh``: (losses, final parameters, the compiled function or None)."""
    data = batch(kind)  # made locally, then shipped
    with mesh.activate(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        losses, model, fn = train(kind, optimizer, tdmesh.to_mesh(state, mesh), tdmesh.to_mesh(data, mesh), compiled,
                                  steps)
        got = [tdmesh.fetch_shard(x).result().item() for x in losses]
        params = tdmesh.fetch_shard([p.detach() for p in model.parameters()]).result()
    fn.said = [str(w.message) for w in said if "tdmesh.compile" in str(w.message)]  # type: ignore[attr-defined]
    return got, params, fn


def _worker_modes(mesh) -> dict:
    with mesh.activate():
        return tdmesh.call_on_shard_and_fetch(tdmesh.remote("tdmesh.worker.builtins.recording_modes")).result()


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=6)
    args = h.parse(p, argv, steps=2)
    h.require_cuda("compile_models", args.device)
    if args.device == "cpu":
        os.environ["TDMESH_DEVICE"] = "cpu"
    print(f"HF models, {args.steps} steps from step 0, 1 {args.device} worker vs local torch, "
          f"torch {torch.__version__}")
    print(f"  {'model':<7} {'optimizer':<22} {'eager rel':>10} {'compiled rel':>13}  compiled step ran as")
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh:
        for kind, optimizer in ROWS:
            state, want, _ = local_reference(kind, optimizer, args.steps, args.device)
            eager, _, _ = on_mesh(mesh, kind, optimizer, state, args.steps, False)
            before = _worker_modes(mesh)
            got, _, fn = on_mesh(mesh, kind, optimizer, state, args.steps, True)
            modes = [mode for key, mode in _worker_modes(mesh).items() if key not in before]
            if fn.eager_because is not None:
                how = f"eager after {len(got)} calls, warned: {fn.eager_because[:60]}..."
            else:
                replays = sum(r.replays for r in fn.recordings.values())
                how = f"recording ({fn.mode}), {replays} replays of {args.steps} steps"
            print(f"  {kind:<7} {optimizer:<22} {_worst(eager, want):10.2e} {_worst(got, want):13.2e}  {how}")
            for mode in modes:  # a worker's mode per recording: a program, a CUDA graph, or why not
                print(f"  {'':<30} {'':>24}  on the worker: {mode}")


if __name__ == "__main__":
    main()
