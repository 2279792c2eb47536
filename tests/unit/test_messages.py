"""The wire records of tdmesh.protocol.messages: field sets, defaults, and pickle round trips."""

from __future__ import annotations

import pickle

import pytest
import torch

from tdmesh import Shape, Slice
from tdmesh.protocol import codec
from tdmesh.protocol import messages as m

# One representative instance per record, with every field set to a distinct, non-default
# value (nested records included) so that a round trip that drops or reorders a field fails.
HG = Shape(("host", "gpu"), Slice.new_row_major([2, 2]))
SAMPLES = {
    m.CallFunction: m.CallFunction(3, (4, None, 5), (6,), "torch.ops.aten.add.Tensor",
                                   (m.Ref(4), 2.5, [m.Ref(6)], m.ProcessGroupArg(9, HG, ("gpu",))),
                                   {"alpha": 2}, stream=1, process_groups=(m.ProcessGroupArg(9, HG, ("gpu",)),),
                                   expect=(((2, 3), "float32", "strided"), None, ((), "int64", "sparse_coo"))),
    m.DefineOp: m.DefineOp(4, "torch.ops.aten.add.Tensor", (m.Slot(0), [m.Slot(1), 2.5]), {"alpha": 2}),
    m.CallOp: m.CallOp(5, 4, (7, None), (3,), (1, 2), stream=1),
    m.SendValue: m.SendValue(7, (8,), b"\x80\x05pickled-callable", (m.Ref(8), m.MeshArg(HG)), {"k": (1, 2)},
                             stream=2, process_groups=()),
    m.Reduce: m.Reduce(8, 20, 4, ((2, 3), "float32"), 3, "sum", True, False, None, stream=1),
    m.ReduceMany: m.ReduceMany(9, (4, 5), (((2, 3), "float32"), ((), "int64")), 3, "avg", stream=1),
    m.SendTensor: m.SendTensor(9, 21, Slice(offset=0, sizes=(2,), strides=(1,)),
                               Slice(offset=2, sizes=(2,), strides=(1,)), 4, ((3,), "int64"), 0, 1),
    m.CreateGroups: m.CreateGroups("remote", 1, HG, ("gpu",), 30, 2),
    m.DropGroups: m.DropGroups(30),
    m.BorrowCreate: m.BorrowCreate(22, 1, 4, 0, 1),
    m.BorrowFirstUse: m.BorrowFirstUse(1),
    m.BorrowLastUse: m.BorrowLastUse(2),
    m.BorrowDrop: m.BorrowDrop(3),
    m.DeleteRefs: m.DeleteRefs((1, 2, 3)),
    m.RequestStatus: m.RequestStatus(11),
    m.DebuggerInput: m.DebuggerInput("p x\n"),
    m.DefineRecording: m.DefineRecording(5, (m.DeleteRefs((9,)),), (1, 2), (3,), 0, 2),
    m.CallRecording: m.CallRecording(15, 5, (10, 11), (12,)),
    m.Supervise: m.Supervise(0.5),
    m.Observe: m.Observe(1.0),
    m.RequestStacks: m.RequestStacks(4),
    m.Detach: m.Detach(),
    m.Heartbeat: m.Heartbeat(3),
    m.Exit: m.Exit("the client hit an error"),
    m.Heal: m.Heal("tdmesh/run/heal1", ((0, 0), (2, 1)), 2),
    m.Hello: m.Hello(2, b"n" * 16, "proof-123", "host-a", 4242, "cuda:1", "/tmp/worker2.log"),
    m.FetchResult: m.FetchResult(12, None, m.DependentError(10)),
    m.RemoteFunctionFailed: m.RemoteFunctionFailed(13, 1, "ValueError", "bad value",
                                                   "Traceback (most recent call last):\n  ...\nValueError: bad value"),
    m.WorkerFailed: m.WorkerFailed(16, 2, "torch.ops.aten.index_select.default", "AcceleratorError",
                                   "CUDA error: device-side assert triggered", "Traceback ..."),
    m.Status: m.Status(1, 14),
    m.TaskDone: m.TaskDone(3, 1, "OSError: disk full\nTraceback ..."),
    m.RelayHello: m.RelayHello(1, 2, 4, b"n" * 16, "proof-1", (m.Hello(2, b"a" * 16, "p2", "host-b", 7, "cpu", None),
                                                             m.Hello(3, b"b" * 16, "p3", "host-b", 8, "cpu", None))),
    m.Challenge: m.Challenge(b"c" * 16),
    m.Welcome: m.Welcome("proof-w"),
    m.DebuggerRead: m.DebuggerRead(1, "> script.py(4)f()\n-> return x\n(Pdb rank 1) "),
    m.DebuggerDone: m.DebuggerDone(1, ""),
    m.RanksLost: m.RanksLost((2, 3), "its connection to host 1's relay closed"),
    m.Sample: m.Sample(1, 1 << 30, 0, 0, ((0, 2, 17, "call_function slow", "script.py:4 in slow", 1.5),),
                       ("INFO tdmesh: ready", "stderr: warning")),
    m.Stacks: m.Stacks(1, 4, "pid 7\nThread 'tdmesh-stream-0':\n  File ..."),
}

FIELDS = {
    m.Ref: ("id",),
    m.CallFunction: ("seq", "results", "mutates", "function", "args", "kwargs", "stream", "process_groups", "grad",
                     "expect"),
    m.Slot: ("position",),
    m.DefineOp: ("op", "function", "args", "kwargs", "grad"),
    m.CallOp: ("seq", "op", "results", "mutates", "refs", "stream"),
    m.SendValue: ("seq", "mutates", "function", "args", "kwargs", "stream", "process_groups"),
    m.Reduce: ("seq", "result", "tensor", "factory", "group", "reduction", "scatter", "inplace", "out", "stream"),
    m.ReduceMany: ("seq", "tensors", "factories", "group", "reduction", "stream"),
    m.SendTensor: ("seq", "result", "from_ranks", "to_ranks", "tensor", "factory", "from_stream", "to_stream",
                   "zeros_on"),
    m.CreateGroups: ("kind", "stream", "mesh", "dims", "ref", "to_stream", "id"),
    m.DropGroups: ("ref",),
    m.BorrowCreate: ("result", "borrow", "tensor", "from_stream", "to_stream"),
    m.BorrowFirstUse: ("borrow",),
    m.BorrowLastUse: ("borrow",),
    m.BorrowDrop: ("borrow",),
    m.DeleteRefs: ("refs",),
    m.RequestStatus: ("seq",),
    m.DebuggerInput: ("line",),
    m.DebuggerRead: ("rank", "output"),
    m.DebuggerDone: ("rank", "output"),
    m.Exit: ("error",),
    m.Heal: ("scope", "ranks", "world_size"),
    m.DefineRecording: ("recording", "commands", "formals", "results", "chunk", "total", "mode", "options"),
    m.CallRecording: ("seq", "recording", "actuals", "results"),
    m.Supervise: ("heartbeat_interval",),
    m.Observe: ("interval",),
    m.RequestStacks: ("request",),
    m.Detach: (),
    m.TorchMeshArg: ("mesh",),
    m.Heartbeat: ("rank",),
    m.Hello: ("rank", "nonce", "proof", "hostname", "pid", "device", "log"),
    m.Challenge: ("nonce",),
    m.Welcome: ("proof",),
    m.FetchResult: ("seq", "value", "error", "rank"),
    m.RelayHello: ("host", "first", "end", "nonce", "proof", "hellos"),
    m.RelayConfig: ("heartbeat_interval", "heartbeat_timeout"),
    m.RanksLost: ("ranks", "why"),
    m.Sample: ("rank", "rss", "cuda_allocated", "cuda_reserved", "streams", "logs"),
    m.Stacks: ("rank", "request", "text"),
    m.RemoteFunctionFailed: ("seq", "rank", "exc_type", "message", "traceback"),
    m.WorkerFailed: ("seq", "rank", "function", "exc_type", "message", "traceback"),
    m.Status: ("rank", "first_uncompleted"),
    m.TaskDone: ("task", "rank", "error"),
    m.DependentError: ("seq",),
    m.MeshArg: ("shape",),
    m.ProcessGroupArg: ("ref", "mesh", "dims"),
    m.PackedTensor: ("dtype", "shape", "data"),
    m.TorchGlobal: ("name",),
    m.DeviceName: ("name",),
    m.GeneratorArg: ("key", "device"),
}

DEFAULTS = {
    m.CallFunction: {"stream": 0, "process_groups": (), "grad": True, "expect": ()},
    m.DefineOp: {"grad": True},
    m.CallOp: {"stream": 0},
    m.SendValue: {"stream": 0, "process_groups": ()},
    m.Reduce: {"stream": 0},
    m.ReduceMany: {"stream": 0},
    m.CreateGroups: {"mesh": None, "dims": (), "ref": None, "to_stream": None, "id": 0},
    m.Exit: {"error": None},
    m.DefineRecording: {"mode": "program", "options": ()},
    m.FetchResult: {"error": None, "rank": -1},
    m.TaskDone: {"error": None},
    m.SendTensor: {"zeros_on": None},
}


def test_direction_tables_are_exactly_the_documented_records():
    assert m.CLIENT_TO_WORKER == (m.CallFunction, m.DefineOp, m.CallOp, m.SendValue, m.Reduce, m.ReduceMany,
                                  m.SendTensor, m.CreateGroups, m.DropGroups, m.DefineRecording, m.CallRecording,
                                  m.BorrowCreate, m.BorrowFirstUse, m.BorrowLastUse, m.BorrowDrop, m.DeleteRefs,
                                  m.RequestStatus, m.DebuggerInput, m.Supervise, m.Observe, m.RequestStacks,
                                  m.Detach, m.Exit, m.Heal)
    assert m.WORKER_TO_CLIENT == (m.Hello, m.Heartbeat, m.FetchResult, m.RemoteFunctionFailed, m.WorkerFailed,
                                  m.Status, m.TaskDone, m.DebuggerRead, m.DebuggerDone, m.RelayHello, m.RanksLost,
                                  m.Sample, m.Stacks)
    assert m.RELAY_CONTROL == (m.RelayConfig,)
    assert m.HANDSHAKE == (m.Challenge, m.Welcome)
    assert set(m.CLIENT_TO_WORKER).isdisjoint(m.WORKER_TO_CLIENT)
    assert set(SAMPLES) == set(m.CLIENT_TO_WORKER) | set(m.WORKER_TO_CLIENT) | set(m.HANDSHAKE)


@pytest.mark.parametrize("cls", list(FIELDS), ids=lambda c: c.__name__)
def test_field_names_and_defaults(cls):
    assert cls._fields == FIELDS[cls]
    assert cls._field_defaults == DEFAULTS.get(cls, {})
    assert issubclass(cls, tuple)


@pytest.mark.parametrize("cls", list(m.CLIENT_TO_WORKER) + list(m.WORKER_TO_CLIENT), ids=lambda c: c.__name__)
@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_every_wire_record_pickles_round_trip(cls, protocol):
    msg = SAMPLES[cls]
    assert type(msg) is cls
    back = pickle.loads(pickle.dumps(msg, protocol=protocol))
    assert type(back) is cls
    assert back == msg
    assert back._asdict() == msg._asdict()
    for name in cls._fields:
        assert type(getattr(back, name)) is type(getattr(msg, name)), name


def test_every_record_class_is_covered():
    modules = (m.__name__, "tdmesh.protocol.arguments")  # the messages, and the values they carry
    records = {v for v in vars(m).values()
               if isinstance(v, type) and issubclass(v, tuple) and v.__module__ in modules}
    assert records == set(FIELDS)


def test_nested_records_keep_their_types():
    back = pickle.loads(pickle.dumps(SAMPLES[m.CallFunction]))
    assert type(back.process_groups[0]) is m.ProcessGroupArg and back.process_groups[0].mesh == HG
    assert type(back.args[3]) is m.ProcessGroupArg
    back = pickle.loads(pickle.dumps(SAMPLES[m.CreateGroups]))
    assert back.mesh == HG and back.mesh.labels == ("host", "gpu")
    back = pickle.loads(pickle.dumps(SAMPLES[m.SendTensor]))
    assert back.from_ranks == Slice(offset=0, sizes=(2,), strides=(1,))
    assert back.to_ranks == Slice(offset=2, sizes=(2,), strides=(1,))
    back = pickle.loads(pickle.dumps(SAMPLES[m.CallFunction]))
    assert type(back.args[0]) is m.Ref and back.args[0].id == 4
    assert type(back.args[2][0]) is m.Ref
    back = pickle.loads(pickle.dumps(SAMPLES[m.FetchResult]))
    assert type(back.error) is m.DependentError and back.error.seq == 10


def test_a_call_op_travels_as_a_bare_tuple_of_builtins():
    """The eager hot path's message: its wire form is the plain tuple (no class to pickle)."""
    msg = SAMPLES[m.CallOp]
    payload = pickle.dumps(tuple(msg), protocol=pickle.HIGHEST_PROTOCOL)
    assert b"tdmesh" not in payload
    assert m.CallOp._make(pickle.loads(payload)) == msg
    assert len(payload) < len(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def test_defaults_apply_when_omitted():
    assert m.Exit() == (None,)
    assert m.Exit().error is None
    assert m.FetchResult(1, b"x").error is None
    assert m.CallFunction(0, (1,), (), "f", (), {}).stream == 0
    assert m.SendValue(0, (), None, (m.Ref(1),), {}).stream == 0
    assert m.CreateGroups("dims", 0) == ("dims", 0, None, (), None, None, 0)
    assert m.Reduce(0, None, 1, ((2,), "float32"), 1, "sum", False, True, None).stream == 0
    with pytest.raises(TypeError):
        m.Status(0)  # both fields are required


def test_ref_and_mesh_arg_round_trip():
    assert pickle.loads(pickle.dumps(m.Ref(17))) == m.Ref(17)
    assert pickle.loads(pickle.dumps(m.MeshArg(("host", 2)))) == m.MeshArg(("host", 2))
    # records are tuples: equal to a plain tuple of the same fields, but the type survives pickling
    assert m.Ref(17) == (17,)
    assert type(pickle.loads(pickle.dumps(m.Ref(17)))) is m.Ref


# ----------------------------------------------------------------- PackedTensor
@pytest.mark.parametrize("t", [
    torch.arange(6, dtype=torch.float32).reshape(2, 3),
    torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),      # non-contiguous: packed contiguous
    torch.tensor([True, False, True]),
    torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
    torch.tensor(3.0, dtype=torch.float64),                      # 0-d
    torch.empty(0, 4, dtype=torch.float16),                      # no bytes at all
    torch.tensor([1 + 2j], dtype=torch.complex64),
], ids=["f32", "int64-transposed", "bool", "bf16", "scalar", "empty", "complex"])
def test_pack_tensor_round_trips_values_dtype_and_shape(t):
    packed = codec.pack_tensor(t)
    assert type(packed) is m.PackedTensor
    assert packed.dtype == str(t.dtype).split(".")[1]
    assert packed.shape == tuple(t.shape)
    assert memoryview(packed.data).nbytes == t.numel() * t.element_size()
    wire = pickle.loads(pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL))
    assert type(wire.data) is bytearray                     # written straight from the tensor's memory
    back = codec.unpack_tensor(wire)
    if wire.data:                                           # and the tensor is made over it, not a copy
        import ctypes
        assert back.data_ptr() == ctypes.addressof(ctypes.c_char.from_buffer(wire.data))
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back, t)
    assert back.is_contiguous()
    back.zero_()                                 # writable: it owns its memory
    assert not back.any() and torch.equal(codec.unpack_tensor(packed), t)


def test_packed_bytes_keep_a_temporary_tensor_alive():
    """A non-contiguous tensor is packed from a contiguous copy that nothing else holds: the
    packed buffer keeps it, so pickling later still reads its values."""
    import gc
    packed = codec.pack_tensor(torch.arange(12, dtype=torch.float64).reshape(3, 4).t())
    gc.collect()
    junk = [torch.full((3, 4), -1.0, dtype=torch.float64) for _ in range(50)]  # reuse freed memory, if any was
    back = codec.unpack_tensor(pickle.loads(pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL)))
    assert torch.equal(back, torch.arange(12, dtype=torch.float64).reshape(3, 4).t()) and junk


def test_pack_tensor_leaves_what_bytes_cannot_carry():
    g = torch.ones(2, requires_grad=True)
    assert codec.pack_tensor(g) is g
    s = torch.ones(2, 2).to_sparse()
    assert codec.pack_tensor(s) is s


def test_unpacked_tensor_does_not_alias_the_packed_bytes():
    t = torch.arange(4, dtype=torch.int32)
    packed = codec.pack_tensor(t)
    a, b = codec.unpack_tensor(packed), codec.unpack_tensor(packed)
    a[0] = 99
    assert b[0].item() == 0 and t[0].item() == 0


def test_ref_fields_name_real_fields_of_client_messages():
    kinds = {"def", "defs", "use", "uses", "args", "borrow"}
    assert set(m.REF_FIELDS) <= set(m.CLIENT_TO_WORKER)
    for cls, fields in m.REF_FIELDS.items():
        assert set(fields) <= set(cls._fields), cls
        assert set(fields.values()) <= kinds, cls
    # every message that names a tensor by ref is in the table (a new message must be added to it)
    holds_refs = {cls for cls in m.CLIENT_TO_WORKER
                  if any(f in cls._fields for f in ("results", "result", "tensor", "tensors", "refs", "actuals",
                                                    "borrow", "mutates"))}
    assert holds_refs == set(m.REF_FIELDS)


# ----------------------------------------------------------------- torch values by name
@pytest.mark.parametrize("value", [torch.preserve_format, torch.channels_last, torch.strided, torch.sparse_csr,
                                   torch.device("cpu"), torch.device("cuda", 1)], ids=str)
def test_torch_values_travel_by_name_and_arrive_as_themselves(value):
    from tdmesh.engine.wire import to_wire
    sent = to_wire({"v": value})["v"]
    assert type(sent) in (m.TorchGlobal, m.DeviceName)
    arrived = pickle.loads(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))
    assert arrived == value and type(arrived) is type(value)
    if not isinstance(value, torch.device):
        assert arrived is value  # the singleton itself


def test_a_clients_generator_travels_as_a_key_and_arrives_as_the_processes_one_copy_of_it():
    """``engine/generators.py``: torch hands each op a new Python object for one generator; all of them
    travel as the same key, which arrives as one generator of this process per key (the worker's copy)."""
    from tdmesh.engine.wire import to_wire
    g, other = torch.Generator(), torch.Generator()
    sent = [to_wire({"generator": g})["generator"] for _ in range(2)]
    assert all(type(s) is m.GeneratorArg for s in sent) and sent[0] == sent[1]
    assert to_wire([other])[0].key != sent[0].key
    arrived = [pickle.loads(pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL)) for s in sent]
    assert type(arrived[0]) is torch.Generator and arrived[0] is arrived[1] and arrived[0] is not g
    assert pickle.loads(pickle.dumps(to_wire(other))) is not arrived[0]
