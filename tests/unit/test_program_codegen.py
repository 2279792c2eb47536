"""Recordings as generated programs (``tdmesh.worker.programs``), driven inline through the
Interpreter: the program gives exactly what message-by-message replay gives (values, poison,
errors, the ref table after the call), for hand-written cases and for random recordings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tdmesh.protocol import messages as m
from tdmesh.worker.interpreter import Interpreter
from tdmesh.worker.values import Poison

Ref, S = m.Ref, m.Slot
ADD = "torch.ops.aten.add.Tensor"
MUL = "torch.ops.aten.mul.Tensor"
DIV = "torch.ops.aten.div.Tensor"
ADD_ = "torch.ops.aten.add_.Tensor"
SPLIT = "torch.ops.aten.split.Tensor"
MM = "torch.ops.aten.mm.default"
NEG = "torch.neg"  # a function, not an aten OpOverload: a step between two inductor graphs
OPS = [m.DefineOp(1, ADD, (S(0), S(1)), {}), m.DefineOp(2, MUL, (S(0), S(1)), {}),
       m.DefineOp(3, DIV, (S(0), S(1)), {"rounding_mode": "floor"}), m.DefineOp(4, ADD_, (S(0), S(1)), {}),
       m.DefineOp(5, SPLIT, (S(0), 1), {}), m.DefineOp(6, MM, (S(0), S(1)), {})]


def make():
    sent: list = []
    interp = Interpreter(0, torch.device("cpu"), sent.append)
    for op in OPS:
        interp.handle(op)
    return interp, sent


def op(results, number, *refs, mutates=()):
    return m.CallOp(0, number, tuple(results), tuple(mutates), tuple(refs), 0)


def define(interp, commands, formals, results, mode):
    interp.handle(m.DefineRecording(1, tuple(commands), tuple(formals), tuple(results), 0, 1, mode))


def run(commands, formals, results, inputs: dict, mode: str, calls: int = 1):
    """Define the recording, bind ``inputs`` (ref -> value), call it ``calls`` times (actuals are
    the formals themselves; results 1000+) and return (ref table, messages sent, recording)."""
    interp, sent = make()
    interp.env.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})
    define(interp, commands, formals, results, mode)
    for i in range(calls):
        interp.handle(m.CallRecording(50 + i, 1, tuple(formals), tuple(1000 + 10 * i + j for j in range(len(results)))))
    return interp.env, sent, interp.recordings.get(1)


def same(a, b) -> bool:
    if type(a) is Poison or type(b) is Poison:
        return type(a) is type(b) and a.seq == b.seq
    return torch.equal(a, b)


def both(commands, formals, results, inputs, calls=1):
    """Run with a program and message by message; they must leave the same ref tables and send
    the same failures (tracebacks aside)."""
    env_p, sent_p, rec_p = run(commands, formals, results, inputs, "program", calls)
    env_m, sent_m, rec_m = run(commands, formals, results, inputs, "messages", calls)
    assert rec_p.program is not None, rec_p.unsupported
    assert rec_m.program is None and rec_m.unsupported == "compiled with backend='messages'"
    assert sorted(env_p) == sorted(env_m)
    for k in env_p:
        assert same(env_p[k], env_m[k]), k
    strip = [(type(x).__name__, getattr(x, "seq", None), getattr(x, "message", None)) for x in sent_p]
    assert strip == [(type(x).__name__, getattr(x, "seq", None), getattr(x, "message", None)) for x in sent_m]
    return env_p, sent_p


# f(x, w) = (x @ w + x, split(x, 1)[1]) with temporaries; formals 1, 2, capture 3
STEP = (op([10], 6, 1, 2), op([11], 1, 10, 1), op([12, 13], 5, 1), op([14], 2, 11, 3))


def test_a_program_computes_what_the_messages_compute_and_keeps_temporaries_local():
    inputs = {1: torch.arange(4.0).view(2, 2), 2: torch.eye(2) * 3, 3: torch.tensor(2.0)}
    env, sent = both(STEP, (1, 2), (14, 13), inputs, calls=2)
    assert sent == []
    x, w = inputs[1], inputs[2]
    assert torch.equal(env[1000], (x @ w + x) * 2) and torch.equal(env[1001], x[1:])
    assert sorted(env) == [1, 2, 3, 1000, 1001, 1010, 1011]  # no temporary left behind


def test_an_op_that_raises_fails_its_results_and_the_rest_runs_message_by_message():
    # 11 = mm of mismatched shapes raises; 12 depends on it (poisoned silently); 13 does not (runs)
    commands = (op([10], 1, 1, 1), op([11], 6, 10, 2), op([12], 1, 11, 1), op([13], 2, 10, 1))
    inputs = {1: torch.ones(2, 3), 2: torch.ones(2, 2)}
    env, sent = both(commands, (1, 2), (12, 13), inputs)
    [failure] = sent
    assert type(failure) is m.RemoteFunctionFailed and failure.seq == 50 and "mat1 and mat2" in failure.message
    assert type(env[1000]) is Poison and env[1000].seq == 50
    assert torch.equal(env[1001], torch.full((2, 3), 2.0))


def test_a_poisoned_input_runs_message_by_message_and_poisons_only_what_depends_on_it():
    commands = (op([10], 1, 1, 1), op([11], 2, 2, 2))
    env, sent = both(commands, (1, 2), (10, 11), {1: Poison(7, "earlier"), 2: torch.ones(2)})
    assert sent == [] and env[1000].seq == 7 and torch.equal(env[1001], torch.ones(2))


def test_in_place_ops_write_through_to_inputs():
    commands = (op([10], 4, 1, 2, mutates=(1,)), op([11], 2, 1, 2))
    env, _ = both(commands, (1, 2), (11,), {1: torch.ones(2), 2: torch.full((2,), 3.0)}, calls=2)
    assert torch.equal(env[1], torch.full((2,), 7.0)) and torch.equal(env[1010], torch.full((2,), 21.0))


def test_aten_calls_sent_whole_and_deletes_of_temporaries_are_part_of_the_program():
    commands = (m.CallFunction(0, (10,), (), MUL, (Ref(1), 3), {}), m.DeleteRefs(()),
                op([11], 1, 10, 10), m.DeleteRefs((10,)), m.CallFunction(0, (12,), (), ADD, (Ref(11), Ref(1)), {}))
    env, _ = both(commands, (1,), (12,), {1: torch.ones(2)})
    assert torch.equal(env[1000], torch.full((2,), 7.0))


@pytest.mark.parametrize("commands, reason", [
    ((m.BorrowCreate(20, 30, 1, 0, 1), m.BorrowDrop(30)), "BorrowCreate in the recording"),
    ((op([10], 1, 1, 1), m.CallOp(0, 2, (11,), (), (1, 1), 1)), "uses 2 streams"),
    ((m.CallFunction(0, (10,), (), ADD, b"sealed", {}),), "sealed arguments"),
    ((op([10], 1, 1, 1), m.DeleteRefs((1,))), "deletes ref 1, which it did not define"),
    ((op([10], 99, 1, 1),), "op 99 is not defined"),
])
def test_what_a_program_cannot_express_replays_message_by_message(commands, reason):
    interp, _ = make()
    define(interp, commands, (1,), (), "program")
    rec = interp.recordings.get(1)
    assert interp.recordings.program(m.CallRecording(1, 1, (1,), ()), interp) is None
    assert reason in rec.unsupported


# ------------------------------------------------------------------------ random recordings
@st.composite
def recordings(draw, kinds=("add", "mul", "div", "add_", "delete"), steps: int = 12):
    """A random straight-line recording over formals 1, 2 and capture 3: binary ops on earlier
    values (some raising: floor division of a float by an int tensor of another shape), an
    in-place add, deletes of dead temporaries, a plain function (``NEG``: no aten op), and any
    earlier values as results; ``kinds`` says which of these it draws from."""
    values = [1, 2, 3]
    commands = []
    next_ref = 10
    for _ in range(draw(st.integers(1, steps))):
        kind = draw(st.sampled_from(kinds))
        a, b = draw(st.sampled_from(values)), draw(st.sampled_from(values))
        if kind == "delete":
            temps = [v for v in values if v >= 10]
            if temps:
                dead = draw(st.sampled_from(temps))
                values.remove(dead)
                commands.append(m.DeleteRefs((dead,)))
            continue
        if kind == "function":
            commands.append(m.CallFunction(0, (next_ref,), (), NEG, (Ref(a),), {}))
        elif kind == "add_":
            commands.append(op([next_ref], 4, a, b, mutates=(a,)))
        else:
            commands.append(op([next_ref], {"add": 1, "mul": 2, "div": 3}[kind], a, b))
        values.append(next_ref)
        next_ref += 1
    temps = [v for v in values if v >= 10]
    results = draw(st.lists(st.sampled_from(temps), unique=True, max_size=3)) if temps else []
    return commands, results


@settings(max_examples=60, deadline=None)
@given(recordings(), st.booleans())
def test_random_recordings_give_the_same_values_poison_and_errors_either_way(recording, poison_capture):
    commands, results = recording
    assume(any(type(c) is m.CallOp for c in commands))  # a recording of only deletes has no stream to run on
    inputs = {1: torch.arange(1.0, 5.0), 2: torch.full((4,), 2.0),
              3: Poison(3, "captured failure") if poison_capture else torch.tensor([1, 2], dtype=torch.int64)}
    both(commands, (1, 2), results, inputs, calls=2)


# ------------------------------------------------------------- inductor: graphs between other steps


def graphs_run_as_fx_runs_them(monkeypatch) -> None:
    """Each inductor graph runs as FX's own interpreter runs it (hypothesis draws hundreds of
    recordings; inductor's compile of each would take seconds): this checks which steps become
    graphs and what flows in and out of them.  Inductor itself compiles such graphs in
    tests/fleet/test_programs.py and bench/compile_time.py."""
    from tdmesh.worker.inductor import CompiledGraph
    monkeypatch.setattr(CompiledGraph, "__call__", lambda self, *args: self.module(*args))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recordings(kinds=("add", "mul", "add_", "delete", "function"), steps=14))  # nothing raises; graph breaks
def test_inductor_graphs_and_the_steps_between_them_compute_what_the_messages_compute(monkeypatch, recording):
    graphs_run_as_fx_runs_them(monkeypatch)
    commands, results = recording
    assume(any(type(c) in (m.CallOp, m.CallFunction) for c in commands))
    inputs = {1: torch.arange(1.0, 5.0), 2: torch.full((4,), 2.0), 3: torch.tensor([1.0, 2.0, 3.0, 4.0])}
    env_i, sent_i, rec_i = run(commands, (1, 2), results, inputs, "inductor", calls=2)
    env_m, sent_m, _ = run(commands, (1, 2), results, inputs, "messages", calls=2)
    assert rec_i.program is not None, rec_i.unsupported
    assert sent_i == sent_m == []
    assert sorted(env_i) == sorted(env_m)
    for k in env_i:
        assert torch.equal(env_i[k], env_m[k]), k


def test_aten_ops_between_other_steps_become_graphs_and_temporaries_stay_inside_them(monkeypatch):
    graphs_run_as_fx_runs_them(monkeypatch)
    # 10 = 1 + 2 and 11 = 10 * 3 (a graph; 10 lives inside it), 12 = neg(11) (a function),
    # 2 += 12 in place and 13 = split(12) (the second graph, writing to its input 2), and a delete of 11
    commands = (op([10], 1, 1, 2), op([11], 2, 10, 3), m.DeleteRefs((10,)),
                m.CallFunction(0, (12,), (), NEG, (Ref(11),), {}), m.DeleteRefs((11,)),
                op([14], 4, 2, 12, mutates=(2,)), op([15, 16], 5, 12))
    inputs = {1: torch.arange(4.0).view(2, 2), 2: torch.ones(2, 2), 3: torch.tensor(2.0)}
    env, _, rec = run(commands, (1, 2), (14, 16), inputs, "inductor", calls=2)
    graphs = [v for v in rec.program.consts.values() if type(v).__name__ == "CompiledGraph"]
    assert len(graphs) == 2  # the function between them runs as it is
    assert len(graphs[0].module.graph.find_nodes(op="placeholder")) == 3  # 1, 2, the capture 3
    assert len(list(graphs[0].module.graph.find_nodes(op="output")[0].args[0])) == 1  # 11 only: 10 stays inside
    x, w = inputs[1], inputs[2].clone()
    for _ in range(2):  # the two calls, eagerly
        neg = -((x + w) * inputs[3])
        w.add_(neg)
    assert torch.equal(env[2], w)  # the second graph's in-place add wrote through to the input, twice
    assert env[1010] is env[2] and torch.equal(env[1011], neg[1:])  # add_'s result is its input
