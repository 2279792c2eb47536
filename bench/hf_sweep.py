"""Every Hugging Face architecture this ``transformers`` has, trained on a 1-worker CPU mesh
eagerly and under ``tdmesh.compile`` from the first step, against the same code run locally
with torch: the losses and the final parameters must be identical, bit for bit.

    python -m bench.hf_sweep                          # causal-LM, masked-LM, image and seq2seq heads
    python -m bench.hf_sweep --kind causal --model mixtral --model qwen2_moe

Each model type gets a tiny config (hidden size 32, two layers, two heads, four experts ...;
every dropout, layer drop, drop path and router jitter at 0: the workers draw from their own
generators, not the client's), random weights, AdamW (single-tensor), 3 steps of one batch.
A row prints ``OK``, ``MISMATCH`` (a silent difference: the worst kind of defect), ``ERROR``
(tdmesh refused what torch ran) or ``SKIP`` (composite configs, over 3M parameters, or a
config this generic recipe cannot make that local torch refuses too).  Found with it: a
channels-last convolution's proxy strides (SegFormer), views written in place (Longformer,
LED), float32 ``_grouped_mm`` (every MoE model): ``tests/fleet/test_device_metadata.py``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import warnings
from collections import Counter

import torch

import tdmesh
from bench import helpers as h
from bench.compile_models import run_steps

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
             vocab_size=64, max_position_embeddings=64, head_dim=16, d_model=32, d_ff=64, num_layers=2, num_heads=2,
             encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
             encoder_ffn_dim=64, decoder_ffn_dim=64, d_kv=16, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, n_routed_experts=4, image_size=32, patch_size=8, num_channels=3, num_labels=4,
             embedding_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
             tie_word_embeddings=False, use_cache=False)
IMAGE = dict(hidden_sizes=[8, 16], depths=[1, 1], embed_dim=8, embed_dims=[8, 16], num_heads=[1, 2], embedding_size=8,
             num_stages=2, widths=[8, 16], hidden_dim=16, sr_ratios=[2, 1], mlp_ratios=[2, 2], strides=[4, 2],
             patch_sizes=[4, 2], num_encoder_blocks=2, num_attention_heads=[1, 2], stem_channels=8, dims=[8, 16])
HEADS = {"causal": "AutoModelForCausalLM", "masked": "AutoModelForMaskedLM",
         "image": "AutoModelForImageClassification", "seq2seq": "AutoModelForSeq2SeqLM"}
MAPPINGS = {"causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
            "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
            "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"}
MAX_PARAMETERS = 3_000_000
RANDOM = ("dropout", "pdrop", "drop_path", "layerdrop", "jitter")


def _set(cfg, values: dict) -> None:
    for key, value in values.items():
        if hasattr(cfg, key) or key in getattr(cfg, "attribute_map", {}):
            old = getattr(cfg, key, None)
            if isinstance(old, list) == isinstance(value, list):
                try:
                    setattr(cfg, key, value)
                except Exception:  # noqa: BLE001 - a config that validates this key otherwise keeps its own
                    pass


def config(kind: str, model_type: str):
    """A tiny config of ``model_type`` with nothing random in training, or None (a composite one)."""
    from transformers import AutoConfig
    cfg = AutoConfig.for_model(model_type)
    if getattr(cfg, "text_config", None) is not None or getattr(cfg, "vision_config", None) is not None:
        return None
    _set(cfg, SMALL)
    if kind == "image":
        _set(cfg, IMAGE)
    for key, value in list(vars(cfg).items()):
        if isinstance(value, float) and (any(word in key for word in RANDOM) or key.endswith("_drop")):
            setattr(cfg, key, 0.0)
    return cfg


def build(kind: str, cfg):
    import transformers
    return getattr(transformers, HEADS[kind]).from_config(cfg, attn_implementation="eager")


def batch(kind: str, channels_last: bool = False) -> dict:
    g = torch.Generator().manual_seed(1)
    if kind == "image":
        pixels = torch.randn(2, 3, 32, 32, generator=g)
        if channels_last:
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        return {"pixel_values": pixels, "labels": torch.tensor([0, 3])}
    ids = torch.randint(3, 64, (2, 8), generator=g)
    if kind == "seq2seq":
        return {"input_ids": ids, "labels": torch.randint(3, 64, (2, 6), generator=g)}
    return {"input_ids": ids, "labels": ids}


def train(kind: str, cfg, state: dict, data: dict, compiled: bool, steps: int, channels_last: bool = False):
    model = build(kind, cfg)
    model.load_state_dict(state)
    model.train()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    return run_steps(model, opt, data, compiled, steps)[0], model


def _local(kind: str, cfg, steps: int, channels_last: bool):
    with torch.device("meta"):
        n = sum(p.numel() for p in build(kind, cfg).parameters())
    if n > MAX_PARAMETERS:
        raise ValueError(f"{n} parameters")
    torch.manual_seed(0)
    state = build(kind, cfg).state_dict()
    data = batch(kind, channels_last)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker runs: two thread counts may sum a matmul in different orders
    try:
        losses, model = train(kind, cfg, state, data, False, steps, channels_last)
    finally:
        torch.set_num_threads(threads)
    return state, data, [x.item() for x in losses], [p.detach() for p in model.parameters()]


class _Timeout(Exception):
    pass


def _on_mesh(mesh, kind, cfg, state, data, steps, compiled, want, want_params, channels_last) -> str:
    with mesh.activate(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses, model = train(kind, cfg, tdmesh.to_mesh(state, mesh), tdmesh.to_mesh(data, mesh), compiled, steps,
                              channels_last)
        got = [tdmesh.fetch_shard(x).result().item() for x in losses]
        params = tdmesh.fetch_shard([p.detach() for p in model.parameters()]).result()
    if got == want and all(torch.equal(a, b) for a, b in zip(params, want_params)):
        return "OK"
    worst = max((a - b).abs().max().item() for a, b in zip(params, want_params))
    return f"MISMATCH losses {got} vs {want}, parameters up to {worst:.3g} apart"


def sweep(mesh, kind: str, model_types: list[str], steps: int, seconds: int, channels_last: bool = False) -> Counter:
    outcomes: Counter = Counter()

    def alarm(*_):
        raise _Timeout()

    signal.signal(signal.SIGALRM, alarm)
    for model_type in model_types:
        try:
            cfg = config(kind, model_type)
            if cfg is None:
                raise ValueError("a composite config")
            state, data, want, want_params = _local(kind, cfg, steps, channels_last)
        except Exception as e:  # noqa: BLE001 - what this generic recipe cannot make: not tdmesh's
            print(f"{kind:8} {model_type:26} SKIP {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
            outcomes["SKIP"] += 1
            continue
        for compiled in (False, True):
            start = time.monotonic()
            signal.alarm(seconds)
            try:
                said = _on_mesh(mesh, kind, cfg, state, data, steps, compiled, want, want_params, channels_last)
            except _Timeout:
                said = "TIMEOUT"
            except Exception as e:  # noqa: BLE001 - tdmesh refused what torch ran
                said = f"ERROR {type(e).__name__}: {' | '.join(str(e).strip().splitlines()[:2])[:240]}"
            finally:
                signal.alarm(0)
            outcomes[said.split()[0]] += 1
            print(f"{kind:8} {model_type:26} {'compiled' if compiled else 'eager':8} {said} "
                  f"({time.monotonic() - start:.1f} s)", flush=True)
    return outcomes


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", action="append", choices=list(HEADS), help="heads to sweep (repeatable; default all)")
    p.add_argument("--model", action="append", help="only these model types (repeatable)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=int, default=240, help="seconds a row may take on the mesh")
    p.add_argument("--channels-last", action="store_true",
                   help="image models and batches channels-last (model.to(memory_format=...)), as convnets train")
    args = h.parse(p, argv, kind=["causal"], model=["gpt2"], steps=1)
    os.environ["TDMESH_DEVICE"] = "cpu"
    import transformers
    from transformers.models.auto import modeling_auto
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: 1 CPU worker vs local torch")
    total: Counter = Counter()
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh:
        for kind in args.kind or list(HEADS):
            model_types = list(getattr(modeling_auto, MAPPINGS[kind]))
            if args.model:
                model_types = [t for t in model_types if t in args.model]
            total += sweep(mesh, kind, model_types, args.steps, args.timeout, args.channels_last)
    print("rows: " + ", ".join(f"{k} {v}" for k, v in sorted(total.items())))


if __name__ == "__main__":
    main()
