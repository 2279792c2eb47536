"""The worker interpreter driven directly with protocol messages: no processes, no sockets.

Ports Monarch's seed worker tests (MONARCH_NOTES §5 items 79-83 and 87-91; the Rust
``WorkerActor`` tests of seed 004) onto tdmesh's protocol: a single in-order interpreter
per rank, import-path or pickled functions, ``Ref`` placeholders, ``Poison`` slots for
values whose computation failed, and one ``RemoteFunctionFailed`` per root failure.
"""

from __future__ import annotations

import pickle

import cloudpickle
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_leaves

from tdmesh.engine.future import load_value
from tdmesh.errors import ProtocolViolation
from tdmesh.geometry.shape import Shape
from tdmesh.geometry.slice import Slice
from tdmesh.protocol import messages as m
from tdmesh.worker.interpreter import Interpreter
from tdmesh.worker.mesh import WorkerMesh
from tdmesh.worker.values import Poison

Ref = m.Ref
ONES = "torch.ops.aten.ones.default"
ZEROS = "torch.ops.aten.zeros.default"
SUB_ = "torch.ops.aten.sub_.Scalar"
MISSING = "i.dont.exist"


# ----------------------------------------------------------------------------- helpers
def make(rank: int = 0, device=None):
    """An interpreter and the list that collects what it sends."""
    sent: list = []
    interp = Interpreter(rank, torch.device("cpu") if device is None else device, sent.append)
    return interp, sent


def call(seq, results, function, *args, mutates=(), **kwargs):
    return m.CallFunction(seq, tuple(results), tuple(mutates), function, tuple(args), kwargs)


def send_value(seq, function, *args, mutates=(), **kwargs):
    return m.SendValue(seq, tuple(mutates), function, tuple(args), kwargs)


def fetched(msg):
    """The value of a successful FetchResult."""
    assert isinstance(msg, m.FetchResult), msg
    assert msg.error is None, msg
    assert isinstance(msg.value, (bytes, tuple))  # a tuple: its big tensors' bytes travel beside the pickle
    return load_value(msg.value)  # as the client does: packed tensors become tensors again


def wire_bytes(value) -> int:
    """How many bytes a FetchResult's value puts on the wire."""
    return sum(memoryview(part).nbytes for part in value) if type(value) is tuple else len(value)


def failures(sent):
    return [x for x in sent if isinstance(x, m.RemoteFunctionFailed)]


def mesh_1d(size=2) -> Shape:
    return Shape(("x",), Slice(offset=0, sizes=[size], strides=[1]))


# Remote functions without an import path travel as (cloud)pickled bytes.
def identity(x):
    return x


def returns_none():
    return None


def returns_mesh(mesh):
    return mesh


def returns_generator():
    return (i for i in range(3))


def raises_value_error(x):
    raise ValueError(f"bad value {x}")


def pickled(fn) -> bytes:
    return cloudpickle.dumps(fn)


# ----------------------------------------------------------------------------- dispatch
def test_every_client_message_has_a_handler_named_after_it():
    interp, _ = make()
    for cls in m.CLIENT_TO_WORKER:
        method = getattr(Interpreter, cls.__name__, None)
        assert callable(method), f"Interpreter lacks a handler for {cls.__name__}"
        bound = interp._handlers[cls]
        assert bound.__func__ is method
        assert bound.__self__ is interp
    assert set(interp._handlers) == set(m.CLIENT_TO_WORKER)


@pytest.mark.parametrize("msg", [m.Status(0, 1), m.FetchResult(0, None), m.Ref(3), ("CallFunction", 0), None, 7])
def test_unknown_message_type_is_a_protocol_violation(msg):
    interp, sent = make(rank=5)
    with pytest.raises(ProtocolViolation, match=r"worker 5 got an unknown message " + type(msg).__name__):
        interp.handle(msg)
    assert sent == []
    assert interp.env == {}


def test_a_subclass_of_a_message_is_not_dispatched():
    class Sneaky(m.Exit):
        pass

    interp, _ = make()
    with pytest.raises(ProtocolViolation, match="Sneaky"):
        interp.handle(Sneaky())
    assert interp.exit_request is None


# ----------------------------------------------------------------------------- 79: basic ops
def test_basic_ops_with_mutation():
    interp, sent = make()
    interp.handle(call(0, [0], ONES, [2, 3]))
    interp.handle(call(2, [2], SUB_, Ref(0), 1, mutates=[0]))
    interp.handle(call(3, [3], ZEROS, [2, 3]))
    interp.handle(call(4, [4], "torch.ops.aten.allclose.default", Ref(0), Ref(3)))
    assert sent == []
    assert interp.env[4] is True
    # sub_ mutated r0 in place and returned the same tensor
    assert interp.env[2] is interp.env[0]
    assert torch.equal(interp.env[0], torch.zeros(2, 3))
    assert interp.env[0].shape == (2, 3) and interp.env[0].dtype == torch.float32
    assert interp.caused_error is False


def test_kwargs_are_resolved():
    interp, sent = make()
    interp.handle(call(0, [0], ONES, [3]))
    interp.handle(call(1, [1], "torch.ops.aten.full.default", [3], 4.0))
    interp.handle(call(2, [2], "torch.ops.aten.add.Tensor", Ref(0), other=Ref(1), alpha=2))
    assert sent == []
    assert torch.equal(interp.env[2], torch.full((3,), 9.0))
    interp.handle(call(3, [3], ONES, [2], dtype=torch.int64))
    assert interp.env[3].dtype == torch.int64


# ----------------------------------------------------------------------------- 80-82: errors
def test_aten_op_missing_an_argument_reports_once():
    interp, sent = make()
    interp.handle(call(0, [0], "torch.ops.aten.rand.default"))
    assert len(sent) == 1
    (failure,) = sent
    assert isinstance(failure, m.RemoteFunctionFailed)
    assert failure.seq == 0 and failure.rank == 0
    assert failure.exc_type == "RuntimeError"
    assert "aten::rand() is missing value for argument 'size'" in failure.message
    assert "Traceback" in failure.traceback and "missing value for argument 'size'" in failure.traceback
    poison = interp.env[0]
    assert isinstance(poison, Poison)
    assert poison.seq == 0
    assert "argument 'size'" in poison.message
    assert interp.caused_error is True


def test_failure_reports_the_rank():
    interp, sent = make(rank=3)
    interp.handle(call(9, [1], "torch.ops.aten.rand.default"))
    assert [(f.seq, f.rank) for f in failures(sent)] == [(9, 3)]


def test_unresolvable_function_poisons_results_and_mutates():
    interp, sent = make()
    interp.env[0] = 1
    interp.handle(call(0, [2], MISSING, mutates=[0]))
    assert len(sent) == 1
    assert isinstance(sent[0], m.RemoteFunctionFailed)
    assert sent[0].seq == 0
    assert sent[0].exc_type == "ResolveError"
    assert "failed to resolve function" in sent[0].message
    for ref in (0, 2):
        assert isinstance(interp.env[ref], Poison)
        assert interp.env[ref].seq == 0
        assert "failed to resolve function" in interp.env[ref].message
    assert interp.env[0] is interp.env[2]


def test_a_missing_attribute_on_an_op_namespace_fails_to_resolve():
    interp, sent = make()
    interp.handle(call(4, [0], "torch.ops.aten.no_such_op_anywhere.default"))
    assert [f.seq for f in failures(sent)] == [4]
    assert "failed to resolve function" in sent[0].message
    assert "no_such_op_anywhere" in sent[0].message


@pytest.mark.parametrize("function, needle", [
    ("os.sep", "is not callable"),
    ("nodots", "expected a dotted path"),
    (b"definitely not a pickle", "could not unpickle"),
    (42, "expected an import path or pickled bytes"),
])
def test_bad_function_references(function, needle):
    interp, sent = make()
    interp.handle(call(1, [0], function))
    assert len(sent) == 1
    assert sent[0].seq == 1
    assert "failed to resolve function" in sent[0].message
    assert needle in sent[0].message
    assert isinstance(interp.env[0], Poison) and interp.env[0].seq == 1


def test_using_a_failed_ref_sends_no_second_report():
    interp, sent = make()
    interp.handle(call(0, [0], MISSING))
    interp.handle(call(1, [1], SUB_, Ref(0), 1, mutates=[0]))
    interp.handle(call(2, [2, 3], "os.path.split", Ref(1)))
    assert len(sent) == 1
    assert isinstance(sent[0], m.RemoteFunctionFailed) and sent[0].seq == 0
    root = interp.env[0]
    assert isinstance(root, Poison) and root.seq == 0
    # dependents carry the root's poison, unchanged
    assert interp.env[1] is root
    assert interp.env[2] is root and interp.env[3] is root


def test_poison_hidden_in_nested_args_and_kwargs_propagates():
    interp, sent = make()
    interp.handle(call(0, [0], ONES, [2]))
    interp.handle(call(1, [1], MISSING))
    interp.handle(call(2, [2], "torch.ops.aten.stack.default", [Ref(0), Ref(1)]))
    interp.handle(call(3, [3], "torch.ops.aten.add.Tensor", Ref(0), other=Ref(1)))
    interp.handle(call(4, [4], pickled(identity), {"a": [(Ref(0), Ref(1))]}, mutates=[0]))
    assert [f.seq for f in failures(sent)] == [1]
    assert len(sent) == 1
    for ref in (2, 3, 4):
        assert interp.env[ref] is interp.env[1]
    # the clean input mutated by a dependent op is now poisoned too
    assert interp.env[0] is interp.env[1]


def test_a_dependent_failure_does_not_set_caused_error():
    interp, sent = make()
    interp.env[7] = Poison(3, "RuntimeError: on another rank")
    interp.handle(call(4, [8], SUB_, Ref(7), 1))
    assert sent == []
    assert interp.env[8] is interp.env[7]
    assert interp.caused_error is False


def test_a_python_exception_is_reported_with_its_type_and_message():
    interp, sent = make()
    interp.handle(call(6, [0, 1], pickled(raises_value_error), 17, mutates=[5]))
    (failure,) = sent
    assert failure.seq == 6 and failure.exc_type == "ValueError"
    assert failure.message == "bad value 17"
    assert "raises_value_error" in failure.traceback
    assert interp.env[0].message == "ValueError: bad value 17"
    assert interp.env[0] is interp.env[1] is interp.env[5]


def test_wrong_number_of_returns_poisons_results_and_reports_once():
    interp, sent = make()
    interp.env[9] = "kept?"
    interp.handle(call(0, [1, 2, 3], "os.path.split", "/a/b", mutates=[9]))
    (failure,) = sent
    assert failure.seq == 0 and failure.exc_type == "TypeError"
    assert "returned 2 values where the client expected 3" in failure.message
    for ref in (1, 2, 3, 9):
        assert isinstance(interp.env[ref], Poison) and interp.env[ref].seq == 0
    # a single tensor for two result slots is also a mismatch
    interp.handle(call(1, [4, 5], ONES, [2]))
    assert [f.seq for f in failures(sent)] == [0, 1]
    assert "returned 1 values where the client expected 2" in sent[1].message
    assert isinstance(interp.env[4], Poison) and interp.env[4].seq == 1
    # and using the poisoned results reports nothing more
    interp.handle(call(2, [6], "builtins.len", Ref(1)))
    assert len(sent) == 2
    assert interp.env[6] is interp.env[1]


def test_no_result_slots_discards_the_value():
    interp, sent = make()
    interp.handle(call(0, [], "os.path.split", "/a/b"))
    interp.handle(call(1, [], ONES, [2]))
    assert sent == [] and interp.env == {}


_leaf = st.one_of(st.builds(lambda n: torch.full((1,), float(n)), st.integers(0, 99)), st.none(),
                  st.integers(0, 5), st.builds(lambda n: torch.tensor(n), st.integers(0, 9)))
_returned = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
    st.tuples(inner, inner).map(lambda p: torch.return_types.max(p))), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(_returned, st.integers(-1, 1), st.data())
def test_results_bind_the_leaves_of_what_a_function_returns(value, miscount, data):
    """Differential: whatever an op or function returns (a tensor, a flat tuple or list of tensors,
    nested containers, Nones, a torch.return_types value), its refs bind the value's pytree leaves
    in order, None slots bind nothing, and a count that differs is a TypeError."""
    leaves = tree_leaves(value)
    count = max(0, len(leaves) + miscount) if leaves else len(leaves)
    results = tuple(data.draw(st.one_of(st.none(), st.just(100 + i))) for i in range(count))
    env: dict = {}
    single = len(results) == 1 and isinstance(value, torch.Tensor)
    if results and not single and count != len(leaves):
        with pytest.raises(TypeError, match=f"returned {len(leaves)} values where the client expected {count}"):
            Interpreter._bind(env, results, value)
        return
    Interpreter._bind(env, results, value)
    expected = {} if not results else (
        {results[0]: value} if single and results[0] is not None else
        {} if single else {r: leaf for r, leaf in zip(results, leaves) if r is not None})
    assert env.keys() == expected.keys()
    assert all(env[r] is expected[r] for r in expected)


# ----------------------------------------------------------------------------- 87-88: Python functions
def test_python_function_results_are_split_across_refs():
    interp, sent = make()
    interp.handle(call(0, [1, 2], "os.path.split", "/fbs/fbc/foo/bar"))
    interp.handle(call(2, [4, None, None, None, None], "builtins.sorted", [65, 34, 79, 1, 5]))
    assert sent == []
    assert interp.env[1] == "/fbs/fbc/foo"
    assert interp.env[2] == "bar"
    assert interp.env[4] == 1
    # None slots are dropped, not bound anywhere
    assert sorted(interp.env) == [1, 2, 4]


@pytest.mark.parametrize("rank", [0, 1])
def test_mesh_rank_of_a_mesh_argument(rank):
    interp, sent = make(rank=rank)
    interp.handle(call(3, [6], "tdmesh.worker.builtins.mesh_rank", m.MeshArg(mesh_1d()), "x"))
    interp.handle(call(4, [7], "tdmesh.worker.builtins.process_idx", m.MeshArg(mesh_1d())))
    assert sent == []
    value = interp.env[6]
    assert isinstance(value, torch.Tensor) and value.dtype == torch.int64 and value.ndim == 0
    assert value.item() == rank
    assert interp.env[7].item() == rank


def test_mesh_argument_becomes_this_workers_view():
    shape = Shape(("x", "y"), Slice.new_row_major([2, 3]))
    interp, sent = make(rank=4)
    interp.handle(call(0, [0], pickled(returns_mesh), m.MeshArg(shape)))
    for i, dims in enumerate(["x", "y", ("x", "y")], start=1):
        interp.handle(call(i, [i], "tdmesh.worker.builtins.mesh_rank", m.MeshArg(shape), dims))
    assert sent == []
    mesh = interp.env[0]
    assert isinstance(mesh, WorkerMesh)
    assert mesh.shape == shape and mesh.global_rank == 4 and mesh.device == torch.device("cpu")
    assert mesh.names == ("x", "y")
    assert mesh.members("y") == [3, 4, 5]
    assert [interp.env[i].item() for i in (1, 2, 3)] == [1, 1, 4]


@pytest.mark.parametrize("value", [
    torch.float32, torch.bfloat16, torch.int64,
    torch.strided, torch.sparse_coo,
    torch.contiguous_format, torch.channels_last, torch.preserve_format,
    None, "x", torch.device("cpu"),
], ids=repr)
def test_special_arguments_round_trip(value):
    interp, sent = make()
    interp.handle(call(0, [1], pickled(identity), value))
    assert sent == []
    assert interp.env[1] == value
    assert type(interp.env[1]) is type(value)
    if not isinstance(value, torch.device):
        assert interp.env[1] is value


def test_list_and_tuple_arguments_keep_their_type():
    interp, sent = make()
    interp.env[0] = 5
    interp.handle(call(1, [2, 3, None, 4], pickled(lambda a, b: (a, b)), [Ref(0), 2], (3, Ref(0))))
    assert sent == []
    # the result ([5, 2], (3, 5)) flattens to its leaves, in order
    assert (interp.env[2], interp.env[3], interp.env[4]) == (5, 2, 5)
    interp.handle(call(2, [4, 5], pickled(lambda a, b: (type(a).__name__, type(b).__name__)), [Ref(0)], (Ref(0),)))
    assert sent == []
    assert (interp.env[4], interp.env[5]) == ("list", "tuple")


def test_accelerator_device_arguments_become_the_workers_device():
    interp, sent = make(device=torch.device("cuda", 3))
    interp.handle(call(0, [1], pickled(identity), torch.device("cuda:1")))
    interp.handle(call(1, [2], pickled(identity), torch.device("cpu")))
    assert sent == []
    assert interp.env[1] == torch.device("cuda", 3)
    assert interp.env[2] == torch.device("cpu")
    # on a CPU worker an accelerator device argument means the CPU
    cpu, sent = make()
    cpu.handle(call(0, [1], pickled(identity), torch.device("cuda:1")))
    assert cpu.env[1] == torch.device("cpu")


def test_none_returning_function_with_a_none_slot_is_fine():
    interp, sent = make()
    interp.handle(call(7, [None], pickled(returns_none)))
    interp.handle(call(8, [3], pickled(returns_none)))
    assert sent == []
    assert interp.env == {3: None}


def test_function_by_import_path_and_by_value_agree():
    interp, sent = make()
    scale = 3

    def local(x):  # a closure: cloudpickle must ship it by value
        return x * scale

    interp.handle(call(0, [0], "builtins.abs", -4))
    interp.handle(call(1, [1], pickled(local), Ref(0)))
    interp.handle(call(2, [2], "operator.mul", Ref(0), 3))
    assert sent == []
    assert interp.env[1] == interp.env[2] == 12


def test_stack_accepts_a_list_of_refs():
    interp, sent = make()
    interp.handle(call(10, [12], ONES, [2, 3]))
    interp.handle(call(11, [13], "torch.ops.aten.stack.default", [Ref(12), Ref(12)]))
    assert sent == []
    assert torch.equal(interp.env[13], torch.ones(2, 2, 3))


# ----------------------------------------------------------------------------- 89: DeleteRefs
def test_delete_refs_removes_only_the_named_refs():
    interp, sent = make()
    interp.env.update({2: False, 3: True, 4: 0})
    interp.handle(m.DeleteRefs((2, 4)))
    assert interp.env == {3: True}
    interp.handle(send_value(1, None, Ref(3)))
    assert fetched(sent[0]) is True
    # deleting an unknown or already-deleted ref is harmless
    interp.handle(m.DeleteRefs((2, 99)))
    assert interp.env == {3: True}
    assert len(sent) == 1


def test_delete_refs_drops_poison_too():
    interp, sent = make()
    interp.handle(call(0, [0], MISSING))
    interp.handle(m.DeleteRefs((0,)))
    assert interp.env == {}


def test_using_a_deleted_ref_is_a_protocol_violation():
    interp, sent = make()
    interp.handle(call(0, [0], ONES, [2]))
    interp.handle(m.DeleteRefs((0,)))
    with pytest.raises(ProtocolViolation, match="ref 0 is not defined on stream 0 of worker 0"):
        interp.handle(call(1, [1], "torch.ops.aten.neg.default", Ref(0), mutates=[5]))
    with pytest.raises(ProtocolViolation, match="ref 0 is not defined"):
        interp.handle(send_value(2, None, Ref(0)))
    with pytest.raises(ProtocolViolation, match="ref 0 is not defined"):
        interp.handle(send_value(3, "torch.ops.aten.neg.default", [Ref(0)], mutates=[6]))
    # a broken message is not a user failure: nothing is reported, bound or poisoned
    assert sent == []
    assert interp.env == {}
    assert interp.caused_error is False


def test_a_ref_that_was_never_created_is_a_protocol_violation():
    interp, sent = make(rank=2)
    with pytest.raises(ProtocolViolation, match="ref 41 is not defined on stream 0 of worker 2"):
        interp.handle(call(0, [1], "builtins.len", {"k": [Ref(41)]}))
    assert sent == [] and interp.env == {}


def test_send_value_without_a_function_takes_exactly_one_argument():
    interp, sent = make()
    interp.env[0] = 1
    with pytest.raises(ProtocolViolation, match="exactly one argument"):
        interp.handle(send_value(1, None, Ref(0), Ref(0)))
    with pytest.raises(ProtocolViolation, match="exactly one argument"):
        interp.handle(send_value(2, None, Ref(0), extra=1))
    with pytest.raises(ProtocolViolation, match="exactly one argument"):
        interp.handle(send_value(3, None))
    assert sent == []


# ----------------------------------------------------------------------------- 90: RequestStatus
def test_request_status_after_one_hundred_ops():
    interp, sent = make()
    for i in range(100):
        interp.handle(m.CallFunction(i, (i + 2,), (), ONES, ([2, 3],), {}, stream=i % 2))
    interp.handle(m.RequestStatus(100))
    assert sent == [m.Status(0, 101)]
    # each stream owns the refs it defined
    assert sorted(interp.streams[0].env) == list(range(2, 102, 2))
    assert sorted(interp.streams[1].env) == list(range(3, 102, 2))
    assert all(torch.equal(v, torch.ones(2, 3)) for s in (0, 1) for v in interp.streams[s].env.values())


def test_request_status_names_the_rank_and_follows_failures():
    interp, sent = make(rank=6)
    interp.handle(call(0, [0], MISSING))
    interp.handle(m.RequestStatus(0))
    interp.handle(m.RequestStatus(0))
    assert len(sent) == 3
    assert isinstance(sent[0], m.RemoteFunctionFailed)
    assert sent[1:] == [m.Status(6, 1), m.Status(6, 1)]


# ----------------------------------------------------------------------------- 91: SendValue
def test_send_value_returns_the_value_and_var_mean_a_pair():
    interp, sent = make()
    interp.handle(call(0, [0], ONES, [2, 3]))
    interp.handle(send_value(1, None, Ref(0)))
    interp.handle(send_value(2, "torch.ops.aten.var_mean.default", Ref(0)))
    assert [type(x) for x in sent] == [m.FetchResult, m.FetchResult]
    assert [x.seq for x in sent] == [1, 2]
    value = fetched(sent[0])
    assert isinstance(value, torch.Tensor) and torch.equal(value, torch.ones(2, 3))
    pair = fetched(sent[1])
    assert isinstance(pair, tuple)
    leaves = tree_leaves(pair)
    assert len(leaves) == 2
    var, mean = leaves
    assert var.item() == 0.0 and mean.item() == 1.0


def test_send_value_of_plain_python_values_and_kwargs():
    interp, sent = make()
    interp.handle(call(0, [0, 1], "os.path.split", "/x/y"))
    interp.handle(call(1, [2], "torch.ops.aten.arange.default", 6))
    interp.handle(send_value(3, None, Ref(1)))
    interp.handle(send_value(4, "torch.ops.aten.sum.dim_IntList", Ref(2), [0], keepdim=True))
    interp.handle(send_value(5, pickled(lambda a, b: {"a": a, "b": [b, b]}), Ref(0), Ref(1)))
    assert [x.seq for x in sent] == [3, 4, 5]
    assert fetched(sent[0]) == "y"
    s = fetched(sent[1])
    assert s.shape == (1,) and s.item() == 15
    assert fetched(sent[2]) == {"a": "/x", "b": ["y", "y"]}


def test_send_value_does_not_disturb_mutates_on_success():
    interp, sent = make()
    interp.handle(call(0, [0], ONES, [2]))
    interp.handle(send_value(1, "torch.ops.aten.add_.Scalar", Ref(0), 1, mutates=[0]))
    assert torch.equal(fetched(sent[0]), torch.full((2,), 2.0))
    assert torch.equal(interp.env[0], torch.full((2,), 2.0))


def test_fetched_tensors_are_detached():
    interp, sent = make()
    interp.env[0] = torch.ones(3, requires_grad=True) * 2
    interp.handle(send_value(1, None, Ref(0)))
    value = fetched(sent[0])
    assert value.requires_grad is False and value.grad_fn is None
    assert torch.equal(value, torch.full((3,), 2.0))


def test_a_fetched_view_carries_only_its_own_elements():
    n = 1_000_000
    interp, sent = make()
    interp.handle(call(0, [0], "torch.ops.aten.arange.default", n, dtype=torch.float32))
    interp.handle(call(1, [1], "torch.ops.aten.slice.Tensor", Ref(0), 0, 10, 20))
    interp.handle(call(2, [2], "torch.ops.aten.slice.Tensor", Ref(0), 0, 0, n, 100_000))
    interp.handle(send_value(3, None, Ref(1)))
    interp.handle(send_value(4, None, Ref(2)))
    interp.handle(send_value(5, None, Ref(0)))
    base_bytes = interp.env[0].untyped_storage().nbytes()
    assert base_bytes == 4 * n
    # the worker-side views still alias the base: only the fetched copy is compacted
    assert interp.env[1].untyped_storage().data_ptr() == interp.env[0].untyped_storage().data_ptr()
    contiguous, strided, whole = sent
    for msg in (contiguous, strided):
        assert wire_bytes(msg.value) < 10_000 < base_bytes
    assert torch.equal(fetched(contiguous), torch.arange(10, 20, dtype=torch.float32))
    strided_value = fetched(strided)
    assert torch.equal(strided_value, torch.arange(0, n, 100_000, dtype=torch.float32))
    assert strided_value.untyped_storage().nbytes() == 10 * 4
    assert wire_bytes(whole.value) >= base_bytes
    assert torch.equal(fetched(whole), torch.arange(n, dtype=torch.float32))


def test_fetching_views_inside_a_pytree_compacts_each_leaf():
    interp, sent = make()
    interp.env[0] = torch.zeros(500_000)
    interp.handle(send_value(1, pickled(lambda t: {"head": t[:4], "tail": [t[-2:]]}), Ref(0)))
    (msg,) = sent
    assert len(msg.value) < 10_000
    value = fetched(msg)
    assert value["head"].shape == (4,) and value["tail"][0].shape == (2,)


# ----------------------------------------------------------------------------- 83: SendValue errors
def test_send_value_error_results():
    interp, sent = make()
    interp.env[2] = False
    interp.handle(send_value(1, "non.existent.function", mutates=[2]))
    assert len(sent) == 2
    failure, result = sent
    assert isinstance(failure, m.RemoteFunctionFailed) and failure.seq == 1
    assert "failed to resolve function" in failure.message
    assert result == m.FetchResult(1, None, m.DependentError(1), 0)
    poison = interp.env[2]
    assert isinstance(poison, Poison) and poison.seq == 1
    assert "failed to resolve function" in poison.message
    # a later fetch of the poisoned ref: an error result, but no second report
    interp.handle(send_value(2, None, Ref(2)))
    assert len(sent) == 3
    assert sent[2] == m.FetchResult(2, None, m.DependentError(1), 0)
    assert len(failures(sent)) == 1


def test_send_value_with_a_failing_function():
    interp, sent = make()
    interp.handle(send_value(4, "torch.ops.aten.rand.default", mutates=[7]))
    failure, result = sent
    assert failure.seq == 4 and "argument 'size'" in failure.message
    assert result == m.FetchResult(4, None, m.DependentError(4), 0)
    assert isinstance(interp.env[7], Poison) and interp.env[7].seq == 4
    assert interp.caused_error is True


def test_send_value_of_an_unpicklable_value_is_a_root_failure():
    interp, sent = make()
    interp.handle(send_value(3, pickled(returns_generator)))
    failure, result = sent
    assert isinstance(failure, m.RemoteFunctionFailed) and failure.seq == 3
    assert "generator" in failure.message
    assert result == m.FetchResult(3, None, m.DependentError(3), 0)


def test_dependent_send_value_poisons_its_mutates_with_the_root():
    interp, sent = make()
    interp.handle(call(0, [0], MISSING))
    interp.env[1] = torch.ones(2)
    interp.handle(send_value(5, "torch.ops.aten.add_.Tensor", Ref(1), Ref(0), mutates=[1]))
    assert len(sent) == 2
    assert sent[1] == m.FetchResult(5, None, m.DependentError(0), 0)
    assert interp.env[1] is interp.env[0]


# ----------------------------------------------------------------------------- message order / Exit
def test_messages_run_in_order():
    interp, sent = make()
    for msg in (call(0, [0], ONES, [2, 3]), send_value(1, None, Ref(0)), call(2, [2], SUB_, Ref(0), 1, mutates=[0]),
                send_value(3, None, Ref(0)), m.RequestStatus(3), call(4, [4], MISSING), m.RequestStatus(4)):
        interp.handle(msg)
    assert [type(x).__name__ for x in sent] == ["FetchResult", "FetchResult", "Status",
                                                 "RemoteFunctionFailed", "Status"]
    assert torch.equal(fetched(sent[0]), torch.ones(2, 3))
    assert torch.equal(fetched(sent[1]), torch.zeros(2, 3))
    assert sent[2] == m.Status(0, 4)
    assert sent[3].seq == 4
    assert sent[4] == m.Status(0, 5)


def test_a_worker_to_client_message_is_a_protocol_violation():
    interp, sent = make()
    interp.handle(call(0, [0], ONES, [1]))
    with pytest.raises(ProtocolViolation):
        interp.handle(m.Status(0, 0))
    assert sorted(interp.env) == [0]
    assert sent == []


def test_exit_sets_exit_request():
    interp, sent = make()
    assert interp.exit_request is None
    interp.handle(m.Exit())
    assert interp.exit_request == m.Exit(None)
    interp2, sent2 = make()
    interp2.handle(call(0, [0], ONES, [1]))
    interp2.handle(m.Exit("client failed"))
    assert interp2.exit_request == m.Exit("client failed")
    assert interp2.exit_request.error == "client failed"
    assert sent == [] and sent2 == []
    assert interp2.caused_error is False


def test_messages_pickle_round_trip_through_the_interpreter():
    """What the transport does: the interpreter must accept unpickled copies of every message."""
    msgs = [
        call(0, [0], ONES, [2]),
        call(1, [1, 2], pickled(divmod), 7, 2),
        send_value(2, None, Ref(0)),
        m.DeleteRefs((0,)),
        m.RequestStatus(2),
        m.Exit(None),
    ]
    interp, sent = make()
    for msg in msgs:
        interp.handle(pickle.loads(pickle.dumps(msg)))
    assert torch.equal(fetched(sent[0]), torch.ones(2))
    assert sent[1] == m.Status(0, 3)
    assert interp.env == {1: 3, 2: 1}
    assert interp.exit_request == m.Exit(None)


# ----------------------------------------------------------------------------- property: report once
@st.composite
def programs(draw):
    """A random dataflow program: each op reads some earlier refs and may fail at its root."""
    n = draw(st.integers(1, 12))
    ops = []
    for i in range(n):
        inputs = draw(st.lists(st.integers(0, i - 1), max_size=3)) if i else []
        mutates = draw(st.lists(st.integers(0, i - 1), max_size=1, unique=True)) if i else []
        ops.append((inputs, mutates, draw(st.booleans())))
    return ops


@settings(max_examples=60, deadline=None)
@given(programs())
def test_each_root_failure_is_reported_exactly_once(ops):
    """Op ``i`` defines ref ``i`` as ``1 + sum(inputs)`` or raises.
    Model: an op reading poison takes the first poisoned input's poison (argument order)
    without running; a root failure is reported once; mutates share the op's poison."""
    interp, sent = make()
    model: dict[int, object] = {}  # ref -> int value or ("poison", root seq)
    expected_reports = []
    add = pickled(lambda *xs: 1 + sum(xs))
    boom = pickled(raises_value_error)
    for seq, (inputs, mutates, fails) in enumerate(ops):
        args = [Ref(r) for r in inputs] if not fails else [[Ref(r) for r in inputs]]
        interp.handle(call(seq, [seq], boom if fails else add, *args, mutates=mutates))
        poisoned = [model[r] for r in inputs if isinstance(model[r], tuple)]
        if poisoned:
            outcome = poisoned[0]
        elif fails:
            outcome = ("poison", seq)
            expected_reports.append(seq)
        else:
            outcome = 1 + sum(model[r] for r in inputs)
        model[seq] = outcome
        if isinstance(outcome, tuple):
            for r in mutates:
                model[r] = outcome
    assert [f.seq for f in sent] == expected_reports
    assert all(isinstance(f, m.RemoteFunctionFailed) for f in sent)
    for ref, want in model.items():
        got = interp.env[ref]
        if isinstance(want, tuple):
            assert isinstance(got, Poison) and got.seq == want[1]
        else:
            assert got == want
    assert interp.caused_error is bool(expected_reports)


# ----------------------------------------------------------------------------- defined ops (DefineOp / CallOp)
ADD = "torch.ops.aten.add.Tensor"
S = m.Slot


def test_a_defined_op_runs_with_its_refs_in_the_slots_and_constants_bound():
    interp, sent = make()
    interp.handle(call(0, [0], ONES, [3]))
    interp.handle(call(1, [1], "torch.ops.aten.full.default", [3], 4.0))
    interp.handle(m.DefineOp(1, ADD, (S(0),), {"other": S(1), "alpha": 2}))
    interp.handle(m.CallOp(2, 1, (2,), (), (0, 1)))
    interp.handle(tuple(m.CallOp(3, 1, (3,), (), (1, 0))))  # the wire form: a bare tuple
    assert sent == []
    assert torch.equal(interp.env[2], torch.full((3,), 9.0))
    assert torch.equal(interp.env[3], torch.full((3,), 6.0))


def test_a_defined_op_takes_lists_of_slots_and_writes_in_place():
    interp, sent = make()
    for ref in (0, 1):
        interp.handle(call(ref, [ref], ONES, [2]))
    interp.handle(m.DefineOp(1, "torch.ops.aten.stack.default", ([S(0), S(1), S(0)],), {}))
    interp.handle(m.CallOp(2, 1, (2,), (), (0, 1)))
    assert interp.env[2].shape == (3, 2)
    interp.handle(m.DefineOp(2, "torch.ops.aten._foreach_add_.Scalar", ([S(0), S(1)], 2.0), {}))
    interp.handle(m.CallOp(3, 2, (), (0, 1), (0, 1)))
    assert sent == []
    assert torch.equal(interp.env[0], torch.full((2,), 3.0)) and torch.equal(interp.env[1], torch.full((2,), 3.0))


def test_a_defined_op_with_a_device_constant_uses_the_workers_device():
    interp, sent = make(device=torch.device("cuda", 3))
    interp.handle(m.DefineOp(1, pickled(identity), ((torch.device("cuda:0"), S(0)),), {}))
    interp.env[5] = 7
    interp.handle(m.CallOp(0, 1, (6, 7), (), (5,)))
    assert sent == [] and interp.env[6] == torch.device("cuda", 3) and interp.env[7] == 7
    cpu, sent = make()  # inside constant keyword arguments too; on a CPU worker "meta"/"cuda" mean the CPU
    cpu.handle(m.DefineOp(1, "torch.ops.aten.empty.memory_format", ([2],), {"device": torch.device("meta")}))
    cpu.handle(m.CallOp(0, 1, (1,), (), ()))
    assert sent == [] and cpu.env[1].device == torch.device("cpu")


def test_a_defined_op_poisons_like_a_call_function():
    interp, sent = make()
    interp.handle(call(0, [0], MISSING))
    interp.env[1] = torch.ones(2)
    interp.handle(m.DefineOp(1, ADD, (S(0), S(1)), {}))
    interp.handle(m.CallOp(1, 1, (2,), (1,), (1, 0)))  # depends on the failed ref 0: no second report
    assert [f.seq for f in failures(sent)] == [0]
    assert interp.env[2] is interp.env[0] and interp.env[1] is interp.env[0]
    interp.handle(m.DefineOp(2, MISSING, (S(0),), {}))  # an unresolvable op fails each call, reported once each
    interp.env[3] = torch.ones(2)
    interp.handle(m.CallOp(2, 2, (4,), (), (3,)))
    assert [f.seq for f in failures(sent)] == [0, 2] and "failed to resolve function" in sent[-1].message
    assert isinstance(interp.env[4], Poison)


@pytest.mark.parametrize("msg, needle", [
    (m.CallOp(0, 9, (1,), (), (0,)), "op 9 is not defined"),
    (m.CallOp(0, 1, (1,), (), (0, 0)), "takes 1 refs, got 2"),
    (m.CallOp(0, 1, (1,), (), (5,)), "ref 5 is not defined"),
])
def test_a_broken_call_op_is_a_protocol_violation(msg, needle):
    interp, _ = make()
    interp.env[0] = torch.ones(1)
    interp.handle(m.DefineOp(1, ADD, (S(0), S(0)), {}))
    with pytest.raises(ProtocolViolation, match=needle):
        interp.handle(msg)
