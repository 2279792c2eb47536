"""Hugging Face weights in and out of a mesh, against the same calls on local torch: ``from_pretrained`` under a
mesh gives a model on the mesh whose outputs and generations are local's; ``save_pretrained`` of a mesh model
writes one replica's files, byte for byte what a local save of the same weights writes, or refuses before writing
anything (safetensors' own save of mesh tensors refuses too); tied weights load through
``tdmesh.checkpoint.load``; ``Trainer`` refuses a mesh model."""

from __future__ import annotations

import os

import pytest
import torch

import tdmesh
import tdmesh.checkpoint

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=101, n_positions=32),
    "bert": lambda: transformers.BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                            intermediate_size=48, vocab_size=101, max_position_embeddings=32),
}
HEADS = {"gpt2": "GPT2LMHeadModel", "bert": "BertForMaskedLM"}


@pytest.fixture(scope="module")
def mesh():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as m:
        yield m


@pytest.fixture(scope="module", params=list(CONFIGS))
def pretrained(request, tmp_path_factory):
    """A model saved by local torch (random weights), its directory, and its local copy."""
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    torch.manual_seed(0)
    model = getattr(transformers, HEADS[kind])(CONFIGS[kind]()).eval()
    model.save_pretrained(folder)
    return kind, str(folder), model


def ids():
    return torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(5))


def test_from_pretrained_under_a_mesh_gives_a_model_on_it_with_local_outputs(mesh, pretrained):
    kind, folder, local = pretrained
    with torch.no_grad():
        want = local(ids()).logits
    with mesh.activate():
        model = getattr(transformers, HEADS[kind]).from_pretrained(folder).eval()
        assert all(type(p) is tdmesh.Tensor for p in model.parameters())
        assert all(type(b) is tdmesh.Tensor for b in model.buffers())
        if kind == "gpt2":  # tied weights stay one tensor
            assert model.lm_head.weight is model.transformer.wte.weight
        with torch.no_grad():
            logits = model(torch.tensor(ids())).logits
        for g in range(2):
            assert torch.equal(tdmesh.fetch_shard(logits, host=0, gpu=g).result(), want)


def test_generate_on_a_mesh_is_local_generate(mesh, pretrained):
    kind, folder, local = pretrained
    if kind != "gpt2":
        pytest.skip("a causal model generates")
    want = local.generate(ids()[:, :4], max_new_tokens=5, do_sample=False, pad_token_id=0)
    with mesh.activate():
        model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
        got = model.generate(torch.tensor(ids()[:, :4]), max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(tdmesh.fetch_shard(got).result(), want)


def test_save_pretrained_of_a_mesh_model_writes_what_a_local_save_writes(mesh, pretrained, tmp_path):
    kind, folder, local = pretrained
    with mesh.activate():
        model = getattr(transformers, HEADS[kind]).from_pretrained(folder)
        with torch.no_grad():
            for p in model.parameters():  # the replicas move together: the save is of the new weights
                p.mul_(0.5)
        model.save_pretrained(tmp_path / "mesh")
    with torch.no_grad():
        for p in local.parameters():
            p.mul_(0.5)
    local.save_pretrained(tmp_path / "local")
    try:
        assert sorted(os.listdir(tmp_path / "mesh")) == sorted(os.listdir(tmp_path / "local"))
        mesh_file, local_file = (tmp_path / d / "model.safetensors" for d in ("mesh", "local"))
        assert mesh_file.read_bytes() == local_file.read_bytes()
        again = getattr(transformers, HEADS[kind]).from_pretrained(tmp_path / "mesh")
        assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), local.state_dict().values()))
    finally:
        with torch.no_grad():
            for p in local.parameters():
                p.mul_(2.0)


def test_a_save_of_ranks_that_disagree_writes_nothing(mesh, tmp_path):
    with mesh.activate():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(CONFIGS["gpt2"]())
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.bias.add_(mesh.rank("gpu"))  # rank 1's replica drifted
        with pytest.raises(tdmesh.UsageError, match=r"transformer\.h\.1\.mlp\.c_fc\.bias.*nothing was written"):
            model.save_pretrained(tmp_path / "model")
        with pytest.raises(tdmesh.UsageError, match="has no memory on the client.*save_pretrained"):
            save_file({"w": model.transformer.wte.weight}, str(tmp_path / "w.safetensors"))
        wte = tdmesh.fetch_shard(model.transformer.wte.weight).result()
    assert not (tmp_path / "model").exists() or not os.listdir(tmp_path / "model")
    assert not (tmp_path / "w.safetensors").exists()
    save_file({"w": wte}, str(tmp_path / "ok.safetensors"))  # the way: a replica fetched first
    assert torch.equal(load_file(str(tmp_path / "ok.safetensors"))["w"], wte)


def test_checkpoint_load_of_a_file_with_tied_weights(mesh, pretrained):
    kind, folder, local = pretrained
    with mesh.activate():
        torch.manual_seed(1)
        model = getattr(transformers, HEADS[kind])(CONFIGS[kind]())
        tdmesh.checkpoint.load(model.state_dict(), checkpoint_id=os.path.join(folder, "model.safetensors"))
        for g in range(2):
            got = tdmesh.fetch_shard(model.state_dict(), host=0, gpu=g).result()
            assert all(torch.equal(got[k], v) for k, v in local.state_dict().items()), g


def test_trainer_refuses_a_model_on_a_mesh_and_names_the_way(mesh):
    with mesh.activate():
        model = transformers.GPT2LMHeadModel(CONFIGS["gpt2"]())
        with pytest.raises(tdmesh.UsageError, match="write the loop"):  # before Trainer looks at anything else
            transformers.Trainer(model=model)
