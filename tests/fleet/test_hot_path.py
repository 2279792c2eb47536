"""The eager hot path (issue 29): an op seen before is issued by its plan in one pass
(``issue.issue_lean``), an operator on proxies skips the mesh's torch-function mode where that mode is
the innermost, and a learnt operator skips torch's dispatcher where nothing else would see it
(``engine/operators.py``).  What the shortcuts must keep: the user's line on every path, every user
mode, subclass, autograd, autocast and profiler that would have seen the call, the placement checks,
and local torch's values."""

import inspect as pyinspect
import os

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import tdmesh
from tdmesh import inspect
from tdmesh.engine.activation import MeshFunctions

HERE = os.path.basename(__file__)


def this_line() -> int:
    return pyinspect.currentframe().f_back.f_lineno


def function_modes() -> list:
    return [type(m) for m in torch.overrides._get_current_function_mode_stack()]


class Seen(TorchFunctionMode):
    """A user's torch-function mode: notes every call it sees, and passes it on."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_every_path_of_an_op_records_the_users_line(mesh1):
    """The same ops the first time (propagated, then issued by their new plan) and the second (the
    lean path), as an operator, a function, a method, and on a proxy outside any activation
    (``Tensor.__torch_dispatch__``): each op's recorded site is this file's line that issued it."""
    from _sites import recorded_sites
    lines: list[int] = []
    with mesh1.activate():
        x, y = torch.ones(3, 5), torch.full((3, 5), 2.0)
    with recorded_sites(mesh1.client) as sites:
        for _ in range(2):
            with mesh1.activate():
                lines.append(this_line()); a = x * y  # noqa: E702
                lines.append(this_line()); b = torch.sub(a, x)  # noqa: E702
                lines.append(this_line()); c = b.div(y)  # noqa: E702
                lines.append(this_line()); d = c.T  # noqa: E702
            lines.append(this_line()); e = d + 1  # noqa: E702  (no mesh active: the proxy's own dispatch)
    assert len(sites) == len(lines) == 10
    assert all(HERE in s and f"line {line}" in s for s, line in zip(sites, lines)), sites
    assert torch.equal(inspect(e), torch.full((5, 3), 1.5))


def test_a_users_torch_function_mode_entered_inside_or_outside_the_activation_sees_every_operator(mesh1):
    """Operators skip the mesh's mode only, and only where it is the innermost; a user's mode entered
    inside the activation or before it (the mesh's mode, a DeviceContext, goes to the bottom of the
    stack either way) sees each operator as it sees local torch's, and the mode stack is as it was
    after every op, one that raised included."""
    local = torch.ones(4)
    with Seen() as plain:  # what such a mode sees of the same operators on local tensors
        2 * (local + local)
        local - 1
        local + local
    with mesh1.activate():
        x = torch.ones(4)
        with Seen() as inside:
            y = x + x
            z = 2 * y
        assert inside.names == plain.names[:2] and function_modes() == [MeshFunctions]
    with Seen() as outside:
        with mesh1.activate():
            w = x - 1
            assert function_modes() == [MeshFunctions, Seen]
            with pytest.raises(TypeError, match="LOCAL_TENSOR"):
                x + local
            assert function_modes() == [MeshFunctions, Seen]
    assert plain.names[2] in outside.names and plain.names[3] in outside.names and len(plain.names) == 4
    assert torch.equal(inspect(z), torch.full((4,), 4.0)) and torch.equal(inspect(w), torch.zeros(4))


def test_an_operator_with_an_object_torch_cannot_take_falls_back_to_the_objects_reflected_method(mesh1):
    class Units:
        def __radd__(self, other):
            return ("units", other.shape)

        def __rmul__(self, other):
            raise TypeError("Units refuses")

    with mesh1.activate():
        x = torch.ones(2, 3)
        assert x + Units() == ("units", torch.Size([2, 3]))
        with pytest.raises(TypeError, match="Units refuses"):
            x * Units()
        assert function_modes() == [MeshFunctions]


def test_inputs_that_are_not_plainly_placed_get_the_full_checks_on_a_planned_op(mesh1):
    """Once an op has a plan, a dropped input, one borrowed mutably elsewhere or one on another stream is
    refused with the placement rule's error (the lean path hands every such case to the full check)."""
    other = tdmesh.Stream("other")
    with mesh1.activate():
        x, y = torch.ones(3), torch.ones(3)
        x + y  # the plan
        gone = torch.ones(3)
        gone.drop()
        with pytest.raises(TypeError, match="DROPPED"):
            gone + y
        _, borrow = other.borrow(x, mutable=True)
        with pytest.raises(TypeError, match="BORROWED"):
            x + y
        borrow.drop()
        with other.activate():
            with pytest.raises(TypeError, match="WRONG_STREAM"):
                x + y
        total = inspect(x + y)
    assert torch.equal(total, torch.full((3,), 2.0))  # outside the activation: a local tensor on CUDA meshes too


# ----------------------------------------------------------------------------- operators without the dispatcher
def counting_dispatch():
    """Counts the calls that reach the mesh's dispatch mode (torch's dispatcher handing it an op)."""
    from tdmesh.engine import dispatch as dispatch_module
    mode, handler = dispatch_module._MeshMode, dispatch_module._MeshMode.__torch_dispatch__
    calls: list = []

    class Counting:
        def __enter__(self):
            def counted(*a, **k):
                calls.append(a[1])
                return handler(*a, **k)
            mode.__torch_dispatch__ = counted
            return calls

        def __exit__(self, *exc):
            mode.__torch_dispatch__ = handler
    return Counting()


def test_a_learnt_operator_is_issued_without_torchs_dispatcher_and_gives_the_same_values(mesh1):
    with mesh1.activate():
        a, b = torch.arange(6.0).reshape(2, 3), torch.full((2, 3), 2.0)
        for _ in range(2):  # planned at the first call; learnt at the second (one lean op dispatched each)
            first = [a * b, a - 1, 3 * a, a > 2]
        with counting_dispatch() as reached:
            again = [a * b, a - 1, 3 * a, a > 2]
            other_value = a - 2          # another scalar: another key, through the dispatcher
        assert reached == [torch.ops.aten.sub.Tensor], reached
        for x, y in zip(first, again):
            assert torch.equal(inspect(x), inspect(y))
        other_value = inspect(other_value)
    assert torch.equal(other_value, torch.arange(6.0).reshape(2, 3) - 2)


def test_a_nested_activation_and_no_mesh_inside_an_activation_keep_the_operators_right(mesh1):
    """An activation inside another replaces the mesh's torch-function mode (torch keeps one device context,
    at the bottom of the stack): learnt operators stay learnt.  Inside ``no_mesh`` the mesh's dispatch mode is
    set aside: a proxy's operator reaches the mesh through torch's dispatcher (the tensor's own handler), a
    local tensor's is plain torch's."""
    with mesh1.activate():
        a = torch.arange(6.0)
        for _ in range(2):
            learnt = a * 3
        with mesh1.activate():
            assert function_modes() == [MeshFunctions]
            with counting_dispatch() as reached:
                nested = a * 3
        assert reached == [], reached
        with tdmesh.no_mesh.activate():
            outside = a * 3
            local = torch.arange(6.0) * 3
        assert type(outside) is tdmesh.Tensor and type(local) is torch.Tensor
        for x in (learnt, nested, outside):
            assert torch.equal(inspect(x), local)


def test_a_learnt_operator_goes_through_torch_where_autograd_autocast_or_a_mode_must_see_it(mesh1):
    """The same operator and operand metadata, learnt on plain tensors, then: an input that requires grad
    (autograd records it), autocast (it casts), a user's dispatch mode (it sees the aten op), the
    profiler (it records the op), inference mode: each as local torch does it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    device_type = mesh1.device_type
    local = torch.ones(4, 4)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        cast_dtype = (local.to(device_type) @ local.to(device_type)).dtype if device_type == "cuda" else \
            (local @ local).dtype
    with mesh1.activate():
        a, b = torch.ones(4, 4), torch.full((4, 4), 2.0)
        for _ in range(3):
            a * b, a @ b
        w = torch.ones(4, 4, requires_grad=True)
        y = w * b
        assert y.requires_grad and y.grad_fn is not None
        y.sum().backward()
        assert torch.equal(inspect(w.grad), inspect(torch.full((4, 4), 2.0)))
        with torch.autocast(device_type, dtype=torch.bfloat16):
            assert (a @ b).dtype == cast_dtype == torch.bfloat16
        with Seen() as seen:
            a * b
        assert seen.ops == [torch.ops.aten.mul.Tensor]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            a * b
        assert "aten::mul" in {e.name for e in profile.events()}
        with torch.inference_mode():
            with counting_dispatch() as reached:
                a * b
        assert reached == [torch.ops.aten.mul.Tensor]
        with fwAD.dual_level():  # no dual inputs here: torch's answer is the plain product, by its dispatcher
            with counting_dispatch() as reached:
                product = a * b
        assert reached == [torch.ops.aten.mul.Tensor]
        product = inspect(product)
    assert torch.equal(product, torch.full((4, 4), 2.0))


def test_learnt_operators_under_torch_func_transforms_give_local_torchs_values(mesh1):
    """``torch.func.vmap`` and ``torch.func.jvp`` over proxies, with every operator of the function already
    learnt: local torch's values.  Under a transform an operator on a proxy the transform did not wrap (one
    the function closes over) goes through torch's dispatcher, not its learnt plan: a transform is torch's
    to see (``_functorch_active`` among the checks of ``operators._operator``)."""
    local_x = torch.arange(12.0, dtype=torch.float64).reshape(3, 4)
    local_w = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)

    def f(row, w):
        return row * w + 2.0 - row / (w + 3.0)

    expected_vmap = torch.func.vmap(f, in_dims=(0, None))(local_x, local_w)
    expected_jvp = torch.func.jvp(lambda r: f(r, local_w), (local_x,), (torch.ones_like(local_x),))
    with mesh1.activate():
        x, w = torch.tensor(local_x.tolist(), dtype=torch.float64), torch.tensor(local_w.tolist(), dtype=torch.float64)
        for _ in range(3):  # every operator of f on these operands: planned, then learnt
            f(x, w), w * 2.0
        got_vmap = torch.func.vmap(f, in_dims=(0, None))(x, w)
        got_primal, got_tangent = torch.func.jvp(lambda r: f(r, w), (x,), (torch.ones_like(x),))
        with counting_dispatch() as reached:
            doubled = torch.func.vmap(lambda row: row + w * 2.0)(x)  # w * 2.0: learnt, on a proxy not wrapped
        assert torch.ops.aten.mul.Tensor in reached
        assert torch.equal(inspect(got_vmap), expected_vmap)
        assert torch.equal(inspect(got_primal), expected_jvp[0])
        assert torch.equal(inspect(got_tangent), expected_jvp[1])
        assert torch.equal(inspect(doubled), local_x + local_w * 2.0)


def test_an_operator_seen_under_a_users_mode_that_rewrites_it_is_not_learnt(mesh1):
    """What an operator dispatches is learnt only where nothing else could have changed it: a user's
    dispatch mode that turns add into sub must not make later plain additions subtract."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class AddIsSub(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return (torch.ops.aten.sub.Tensor if func is torch.ops.aten.add.Tensor else func)(*args, **(kwargs or {}))

    with mesh1.activate():
        a, b = torch.full((2, 7), 3.0, dtype=torch.float64), torch.ones(2, 7, dtype=torch.float64)
        with AddIsSub():
            rewritten = [a + b for _ in range(3)]
        plain = [a + b for _ in range(3)]
    assert all(torch.equal(inspect(r), torch.full((2, 7), 2.0, dtype=torch.float64)) for r in rewritten)
    assert all(torch.equal(inspect(p), torch.full((2, 7), 4.0, dtype=torch.float64)) for p in plain)


def test_an_operator_torch_makes_of_two_ops_is_never_learnt_as_one(mesh1):
    """``2.0 / x`` is ``x.reciprocal() * 2.0`` in torch: with the reciprocal planned and the product new,
    the call dispatches one lean op and one other; it must not be learnt as the reciprocal alone."""
    with mesh1.activate():
        x = torch.full((3, 4), 4.0, dtype=torch.float64)
        for _ in range(2):
            x.reciprocal()
        quotients = [2.0 / x for _ in range(4)]
    assert all(torch.equal(inspect(q), torch.full((3, 4), 0.5, dtype=torch.float64)) for q in quotients)


def test_opinfo_operator_samples_match_local_torch_when_issued_again_and_again(mesh1):
    """torch's OpInfo samples of the reflected operators (scalars on the left: ``2.0 / x``, ``3 - x``...),
    three rounds of fresh inputs with the same metadata: planned, then learnt, then issued from the learnt
    plans; every round gives local torch's values."""
    if mesh1.device_type != "cpu":
        pytest.skip("the CPU run")
    from torch.testing._internal.common_methods_invocations import op_db

    from opinfo_conformance import conformance
    names = {op.name for op in op_db if op.name.startswith("__r")}
    for _ in range(3):
        outcomes = conformance(mesh1, "cpu", torch.float32, only=names)
        assert len({o.op for o in outcomes}) >= 7 and len(outcomes) >= 40  # those with float32 samples
        failed = [f"{o.op}[{o.sample}]: {o.error}" for o in outcomes if o.error]
        assert not failed, failed


_OPERATORS = ["+", "-", "*", "/", "//", "%", "**", "<", "<=", "==", "!=", ">", ">="]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(_OPERATORS), st.sampled_from([(3,), (2, 3), (1, 3), (4, 1, 3)]),
       st.sampled_from([torch.float32, torch.float64, torch.int64]),
       st.one_of(st.none(), st.integers(-3, 3), st.floats(-2.5, 2.5, allow_nan=False), st.booleans()),
       st.booleans(), st.integers(0, 2**16))
def test_operators_issued_again_and_again_match_local_torch(mesh1, op, shape, dtype, scalar, left, seed):
    """Drawn operators, shapes, dtypes and operands (a proxy, or a Python scalar on either side), each
    call made three times with fresh inputs of the same metadata (planned, learnt, then issued from the
    learnt plan): each result is local torch's on the mesh's device type, or both raise."""
    generator = torch.Generator().manual_seed(seed)
    device = mesh1.device_type  # a CUDA mesh's kernels are compared with CUDA's here (pow differs by an ulp)
    results = []
    for _ in range(3):
        a = (torch.rand(shape, generator=generator) * 4 + 1).to(dtype)
        b = (torch.rand(shape[-1:], generator=generator) * 4 + 1).to(dtype) if scalar is None else scalar
        expression = f"b {op} a" if left else f"a {op} b"
        try:
            expected = eval(expression, {"a": a.to(device), "b": b.to(device) if scalar is None else b}).cpu()
        except Exception:  # noqa: BLE001 - local torch refuses it: so must the mesh, at the call or the fetch
            with pytest.raises(Exception):  # noqa: B017, PT011 - RemoteException or torch's own
                with mesh1.activate():
                    remote_b = torch.tensor(b) if scalar is None else b
                    inspect(eval(expression, {"a": torch.tensor(a), "b": remote_b}))
            return
        with mesh1.activate():
            remote_b = torch.tensor(b) if scalar is None else b
            got = eval(expression, {"a": torch.tensor(a), "b": remote_b})
        results.append((got, expected))
    for got, expected in results:
        value = inspect(got)
        torch.testing.assert_close(value, expected, rtol=0, atol=0, equal_nan=True)  # dtype and shape too
