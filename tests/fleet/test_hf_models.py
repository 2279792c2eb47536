"""Real models no one here wrote: Hugging Face ``transformers`` GPT-2, Llama and ResNet (tiny
configs, random weights) trained on a CPU mesh eagerly and under ``tdmesh.compile`` from the
first step, against the same code run locally with torch: every loss identical, bit for bit,
and so are the parameters after the last step.  (The local reference runs on one thread, as
the workers do: two thread counts may sum a matmul in different orders.)"""

from __future__ import annotations

import warnings

import pytest
import torch

import tdmesh

transformers = pytest.importorskip("transformers")
STEPS = 6


def _model(kind: str):
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


def _batch(kind: str) -> dict:
    g = torch.Generator().manual_seed(1)
    if kind == "resnet":  # BatchNorm in train mode: running stats and num_batches_tracked are buffers
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.tensor([0, 3])}
    ids = torch.randint(0, 64, (2, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


OPTIMIZERS = {
    "fused_adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "sgd_nesterov_foreach": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, foreach=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
}
# (model, optimizer): the rows of issue 26's table
ROWS = [("gpt2", "fused_adamw"), ("resnet", "sgd_momentum"), ("llama", "sgd_nesterov_foreach"),
        ("gpt2", "adamw_foreach")]


def _train(kind: str, optimizer: str, state: dict, batch: dict, compiled: bool):
    model = _model(kind)
    model.load_state_dict(state)
    model.train()
    opt = OPTIMIZERS[optimizer](model.parameters())

    def step(b):
        loss = model(**b).loss
        opt.zero_grad()  # set_to_none=True, torch's default: new gradients every step
        loss.backward()
        opt.step()
        return loss.detach()

    fn = tdmesh.compile(step) if compiled else step
    return [fn(batch) for _ in range(STEPS)], model, fn


@pytest.fixture(scope="module")
def reference():
    """Each row trained locally: losses and final parameters."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for kind, optimizer in ROWS:
            torch.manual_seed(0)
            state = _model(kind).state_dict()
            losses, model, _ = _train(kind, optimizer, state, _batch(kind), compiled=False)
            out[kind, optimizer] = (state, [x.item() for x in losses], [p.detach().clone() for p in model.parameters()])
        return out
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind,optimizer", ROWS, ids=[f"{k}-{o}" for k, o in ROWS])
def test_hf_model_trains_on_a_mesh_as_it_trains_locally(mesh1, reference, kind, optimizer, compiled):
    state, want_losses, want_params = reference[kind, optimizer]
    with mesh1.activate(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, model, fn = _train(kind, optimizer, tdmesh.to_mesh(state, mesh1), tdmesh.to_mesh(_batch(kind), mesh1),
                                   compiled)
        got_losses = [tdmesh.fetch_shard(x).result().item() for x in losses]
        got_params = tdmesh.fetch_shard([p.detach() for p in model.parameters()]).result()
    assert got_losses == want_losses
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params))
    if not compiled:
        return
    if optimizer == "adamw_foreach":  # reads its step counters on the host: eager, with one warning
        assert fn.eager_because is not None and not fn.recordings
        said = [str(w.message) for w in caught if "runs eagerly" in str(w.message)]
        assert len(said) == 1 and "fused=True" in said[0], said
    else:  # new gradients each step settle at the third call; the rest are replays
        assert fn.eager_because is None
        assert sum(r.replays for r in fn.recordings.values()) == STEPS - 3
