"""Conformance: every deterministic OpInfo sample of torch's op database runs on a mesh and
gives local torch's result (issue 13), with its inputs as OpInfo gives them, permuted
(channels-last, column-major) and non-contiguous.  The client's proxies of the results must
have local torch's strides too: a proxy with other strides than the worker's tensor makes
composite ops take other paths than local torch (results a rounding apart) and code that
trusts strides (``as_strided``) read other elements.  The rates are printed; an op that fails
and is not in KNOWN_FAILURES, or whose proxies have other strides and is not in
KNOWN_STRIDE_DIFFERENCES (each with its reason), fails the test, so coverage can only grow."""

import pytest
import torch

from opinfo_conformance import conformance, summary

# op -> why some of its samples cannot match yet (none, at present, on CPU)
KNOWN_FAILURES: dict[str, str] = {}

_MIXED = ("torch's meta kernel (its elementwise reference) orders the output's dims otherwise than the CPU kernel's "
          "TensorIterator for inputs of different layouts; fake CPU tensors run the same meta kernel")
_META = "torch's meta kernel gives a contiguous output where the CPU kernel keeps the input's layout"
# layout -> op -> why the client's proxies of its results have other strides than local torch's
# results (values identical); measured with torch 2.13's meta kernels
KNOWN_STRIDE_DIFFERENCES: dict[str, dict[str, str]] = {
    "as_given": {},
    "permuted": {**dict.fromkeys(("copysign", "div.floor_rounding", "floor_divide", "heaviside", "ldexp", "logaddexp",
                                  "logical_and", "logical_or", "logical_xor"), _MIXED),
                 **dict.fromkeys(("_batch_norm_with_update", "_native_batch_norm_legit", "native_batch_norm",
                                  "nn.functional.batch_norm", "nn.functional.channel_shuffle",
                                  "nn.functional.max_pool1d", "nn.functional.max_unpool2d",
                                  "nn.functional.max_unpool2d.grad"), _META)},
    "noncontiguous": dict.fromkeys(("flip", "fliplr", "flipud", "frexp", "nn.functional.prelu",
                                    "nn.functional.hardtanh", "nn.functional.relu6", "nan_to_num", "isreal",
                                    "zeros_like", "ones_like", "full_like", "fill"),
                                   "torch's meta kernel makes a dense output from an input with gaps (stride 2), the "
                                   "CPU kernel keeps the input's strides, gaps and all"),
}


@pytest.mark.parametrize("layout", list(KNOWN_STRIDE_DIFFERENCES))
def test_opinfo_samples_match_local_torch(mesh1, capsys, layout):
    if mesh1.device_type != "cpu":
        pytest.skip("the CPU conformance run; tests/gpu/test_gpu.py runs the CUDA one")
    outcomes = conformance(mesh1, "cpu", torch.float32, layout=layout)
    with capsys.disabled():
        print(f"\nOpInfo conformance, cpu float32, inputs {layout}: {summary(outcomes)}")
    new = sorted({f"{o.op}[{o.sample}]: {o.error}" for o in outcomes if o.error and o.op not in KNOWN_FAILURES})
    assert not new, "ops that fail on a mesh and not locally:\n" + "\n".join(new)
    known = KNOWN_STRIDE_DIFFERENCES[layout]
    strided = sorted({f"{o.op}[{o.sample}]: {o.strides}" for o in outcomes if o.strides and o.op not in known})
    assert not strided, "ops whose proxies have other strides than local torch's results:\n" + "\n".join(strided)
    assert len({o.op for o in outcomes}) > 600  # the database really ran
