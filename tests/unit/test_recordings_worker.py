"""The worker's recording rules, driven inline through the Interpreter: no processes.

Ports the seed worker's recording tests (MONARCH_NOTES §5 items 93-94; ``stream.rs`` tests)
onto tdmesh's protocol: a recording is defined in chunks by DefineRecording and replayed
by CallRecording with its formals and results renamed and its temporaries deleted after.
"""

from __future__ import annotations

import pytest
import torch

from tdmesh.errors import ProtocolViolation
from tdmesh.protocol import messages as m
from tdmesh.worker.interpreter import Interpreter
from tdmesh.worker.values import Poison

Ref = m.Ref
CLONE = "torch.ops.aten.clone.default"
MUL = "torch.ops.aten.mul.Tensor"
ADD = "torch.ops.aten.add.Tensor"
INDEX = "torch.ops.aten.index.Tensor"


def make():
    sent: list = []
    return Interpreter(0, torch.device("cpu"), sent.append), sent


def call(results, function, *args, mutates=(), seq=0, stream=0):
    return m.CallFunction(seq, tuple(results), tuple(mutates), function, tuple(args), {}, stream)


def define(recording, commands, formals=(), results=(), index=0, total=1):
    return m.DefineRecording(recording, tuple(commands), tuple(formals), tuple(results), index, total)


# f(x, y) = (y, x), with a temporary (x * x) that nobody returns; formals 1, 2 and results 10, 11
SWAP = (
    call([12], MUL, Ref(1), Ref(1)),
    call([10], CLONE, Ref(2)),
    call([11], CLONE, Ref(1)),
)


# ----------------------------------------------------------------------------- definition rules
def test_defining_while_another_recording_is_active():
    interp, sent = make()
    interp.handle(define(1, SWAP[:1], (1, 2), (10, 11), index=0, total=2))
    with pytest.raises(ProtocolViolation, match=r"different recording \(1\) is already active"):
        interp.handle(define(2, SWAP, (1, 2), (10, 11)))
    assert sent == []


def test_redefining_a_recording():
    interp, _ = make()
    interp.handle(define(1, SWAP, (1, 2), (10, 11)))
    with pytest.raises(ProtocolViolation, match="recording 1 is already defined"):
        interp.handle(define(1, SWAP, (1, 2), (10, 11)))


def test_calling_an_unknown_recording():
    interp, _ = make()
    with pytest.raises(ProtocolViolation, match="recording 7 not found"):
        interp.handle(m.CallRecording(0, 7, (), ()))


def test_calling_a_recording_while_it_is_being_defined():
    interp, _ = make()
    interp.handle(define(3, SWAP[:2], (1, 2), (10, 11), index=0, total=2))
    with pytest.raises(ProtocolViolation, match="recording 3 is called while it is still being defined"):
        interp.handle(m.CallRecording(0, 3, (100, 101), (200, 201)))


def test_chunks_must_start_at_zero():
    interp, _ = make()
    with pytest.raises(ProtocolViolation, match="must start at chunk 0, got chunk 1"):
        interp.handle(define(4, SWAP, (1, 2), (10, 11), index=1, total=2))


def test_chunks_must_arrive_in_order():
    interp, _ = make()
    interp.handle(define(5, SWAP[:1], (1, 2), (10, 11), index=0, total=3))
    with pytest.raises(ProtocolViolation, match="expected chunk 1 of 3, got 2 of 3"):
        interp.handle(define(5, SWAP[1:2], (1, 2), (10, 11), index=2, total=3))


def test_chunks_must_agree_on_the_total():
    interp, _ = make()
    interp.handle(define(6, SWAP[:1], (1, 2), (10, 11), index=0, total=3))
    with pytest.raises(ProtocolViolation, match="expected chunk 1 of 3, got 1 of 2"):
        interp.handle(define(6, SWAP[1:2], (1, 2), (10, 11), index=1, total=2))


@pytest.mark.parametrize("command", [
    m.SendValue(0, (), None, (Ref(1),), {}),
    m.RequestStatus(0),
    m.CreateGroups("dims", 0),
    m.DropGroups(3),
    define(9, ()),
    m.CallRecording(0, 9, (), ()),
], ids=lambda c: type(c).__name__)
def test_messages_not_allowed_inside_a_recording(command):
    interp, sent = make()
    with pytest.raises(ProtocolViolation, match=f"{type(command).__name__} is not allowed inside a recording"):
        interp.handle(define(1, SWAP[:1] + (command,), (1, 2), (10, 11)))
    assert sent == []


def test_a_borrow_created_inside_must_be_dropped_inside():
    interp, _ = make()
    commands = (m.BorrowCreate(20, 30, 1, 0, 1), m.BorrowFirstUse(30), call([21], CLONE, Ref(20), stream=1),
                m.BorrowLastUse(30))
    with pytest.raises(ProtocolViolation, match=r"all borrows created within recording must be dropped within "
                                                r"recording \(borrows \[30\] are not\)"):
        interp.handle(define(1, commands, (1,), (21,)))


def test_a_chunked_definition_is_usable_once_complete():
    interp, _ = make()
    for i, command in enumerate(SWAP):
        interp.handle(define(8, (command,), (1, 2), (10, 11), index=i, total=len(SWAP)))
    interp.env[100] = torch.tensor([1, 2, 3])
    interp.env[101] = torch.tensor([4, 5])
    interp.handle(m.CallRecording(0, 8, (100, 101), (200, 201)))
    assert torch.equal(interp.env[200], torch.tensor([4, 5]))
    assert torch.equal(interp.env[201], torch.tensor([1, 2, 3]))


# ----------------------------------------------------------------------------- calls
def test_swap_outputs_and_no_temporaries_survive():
    interp, sent = make()
    interp.handle(define(1, SWAP, (1, 2), (10, 11)))
    interp.env[100] = torch.tensor([1, 2, 3])
    interp.env[101] = torch.tensor([4, 5])
    interp.handle(m.CallRecording(5, 1, (100, 101), (200, 201)))
    assert torch.equal(interp.env[200], torch.tensor([4, 5]))
    assert torch.equal(interp.env[201], torch.tensor([1, 2, 3]))
    # the inputs are untouched; the recording's own refs and its temporaries are not bound
    assert torch.equal(interp.env[100], torch.tensor([1, 2, 3])) and torch.equal(interp.env[101], torch.tensor([4, 5]))
    assert set(interp.env) == {100, 101, 200, 201}
    assert not any(ref < 0 for ref in interp.env)

    interp.env[102] = torch.tensor([7.0])
    interp.env[103] = torch.tensor([8.0, 9.0])
    interp.handle(m.CallRecording(6, 1, (102, 103), (202, 203)))  # the same recording, new refs
    assert torch.equal(interp.env[202], torch.tensor([8.0, 9.0])) and torch.equal(interp.env[203], torch.tensor([7.0]))
    assert set(interp.env) == {100, 101, 102, 103, 200, 201, 202, 203}
    assert sent == []


def test_captured_refs_are_read_where_they_are():
    interp, _ = make()
    interp.env[50] = torch.tensor([10.0])  # defined outside the recording: a capture
    interp.handle(define(1, (call([10], ADD, Ref(1), Ref(50)),), (1,), (10,)))
    interp.env[100] = torch.tensor([1.0])
    interp.handle(m.CallRecording(0, 1, (100,), (200,)))
    interp.env[50] = torch.tensor([20.0])
    interp.handle(m.CallRecording(1, 1, (100,), (201,)))
    assert float(interp.env[200]) == 11.0 and float(interp.env[201]) == 21.0
    assert set(interp.env) == {50, 100, 200, 201}


def test_mutating_a_formal_writes_the_actual():
    interp, _ = make()
    interp.handle(define(1, (call([], "torch.ops.aten.add_.Tensor", Ref(1), Ref(2), mutates=(1,)),), (1, 2), ()))
    interp.env[100] = torch.zeros(2)
    interp.env[101] = torch.ones(2)
    for seq in range(3):
        interp.handle(m.CallRecording(seq, 1, (100, 101), ()))
    assert torch.equal(interp.env[100], torch.full((2,), 3.0))


def test_wrong_number_of_actuals_or_results():
    interp, _ = make()
    interp.handle(define(1, SWAP, (1, 2), (10, 11)))
    interp.env[100] = torch.ones(1)
    with pytest.raises(ProtocolViolation, match="takes 2 inputs and 2 outputs, called with 1 and 2"):
        interp.handle(m.CallRecording(0, 1, (100,), (200, 201)))


def test_a_failure_inside_is_reported_once_against_the_call():
    interp, sent = make()
    commands = (call([12], INDEX, Ref(1), [Ref(2)]),   # fails: index out of bounds
                call([10], MUL, Ref(12), Ref(12)),     # depends on it: poisoned silently
                call([11], CLONE, Ref(1)))             # independent: computed
    interp.handle(define(1, commands, (1, 2), (10, 11)))
    interp.env[100] = torch.ones(3)
    interp.env[101] = torch.tensor([5])
    interp.handle(m.CallRecording(42, 1, (100, 101), (200, 201)))
    failures = [x for x in sent if isinstance(x, m.RemoteFunctionFailed)]
    assert len(failures) == 1 and len(sent) == 1
    assert failures[0].seq == 42 and "out of bounds" in failures[0].message
    assert isinstance(interp.env[200], Poison) and interp.env[200].seq == 42
    assert torch.equal(interp.env[201], torch.ones(3))
    assert not any(ref < 0 for ref in interp.env)


def test_a_borrow_inside_gets_a_fresh_id_per_call():
    interp, sent = make()
    commands = (m.BorrowCreate(20, 30, 1, 0, 1), m.BorrowFirstUse(30),
                call([21], MUL, Ref(20), Ref(20), stream=1), m.BorrowLastUse(30), m.BorrowDrop(30))
    interp.handle(define(1, commands, (1,), (21,)))
    interp.env[100] = torch.tensor([3.0])
    interp.handle(m.CallRecording(0, 1, (100,), (200,)))
    interp.handle(m.CallRecording(1, 1, (100,), (201,)))  # the same borrow id again: renamed, no clash
    side = interp.stream(1).env
    assert float(side[200]) == 9.0 and float(side[201]) == 9.0
    assert interp.borrows == {}
    assert not any(ref < 0 for s in interp.streams.values() for ref in s.env)
    assert sent == []


def test_call_ops_in_a_recording_are_renamed_like_call_functions():
    """A recording holds the CallOps of eager dispatch; their refs are renamed per call."""
    interp, sent = make()
    interp.handle(m.DefineOp(1, MUL, (m.Slot(0), m.Slot(1)), {}))
    interp.handle(m.DefineOp(2, CLONE, (m.Slot(0),), {}))
    swap = (m.CallOp(0, 1, (12,), (), (1, 1)), m.CallOp(0, 2, (10,), (), (2,)), m.CallOp(0, 2, (11,), (), (12,)))
    interp.handle(define(1, swap, (1, 2), (10, 11)))
    interp.env[100] = torch.full((2,), 3.0)
    interp.env[101] = torch.ones(2)
    interp.handle(m.CallRecording(7, 1, (100, 101), (200, 201)))
    assert sent == []
    assert torch.equal(interp.env[200], torch.ones(2)) and torch.equal(interp.env[201], torch.full((2,), 9.0))
    assert set(interp.env) == {100, 101, 200, 201}  # the temporary (12's rename) was deleted


def test_a_define_op_is_not_allowed_inside_a_recording():
    interp, _ = make()
    with pytest.raises(ProtocolViolation, match="DefineOp is not allowed inside a recording"):
        interp.handle(define(1, (m.DefineOp(1, MUL, (m.Slot(0),), {}),)))
