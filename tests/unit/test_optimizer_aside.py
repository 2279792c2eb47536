"""``tdmesh/engine/optimizers.py`` on torch's classes, in a fresh interpreter (it patches them once per
process): an optimizer class torch already wrapped in its profiling hooks (an optimizer made before the
first activation) and one it had not both run their step with the given mode set aside, keep torch's
hooks outside it, and behave as before outside that mode."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch
    from torch.overrides import TorchFunctionMode
    from tdmesh.engine.optimizers import set_aside_for_torchs_optimizers

    class Counting(TorchFunctionMode):
        calls = 0
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if "record_function" not in getattr(func, "__name__", "").lower():
                Counting.calls += 1
            return func(*args, **(kwargs or {}))

    def params():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]

    def two_steps(make, mode):
        ps = params()
        opt = make(ps)
        hooked = []
        opt.register_step_pre_hook(lambda *_: hooked.append(Counting.calls))
        for _ in range(2):
            with mode():
                for p in ps:
                    p.grad = p.detach() * 2
                before = Counting.calls
                opt.step()
                opt.zero_grad()
                during = Counting.calls - before
        return [p.detach().clone() for p in ps], during, hooked

    made_before = torch.optim.SGD(params(), lr=0.1)  # torch wraps SGD.step in its hooks now
    assert getattr(torch.optim.SGD.step, "hooked", False) and not getattr(torch.optim.Adam.step, "hooked", False)
    plain = {n: two_steps(m, Counting)[0] for n, m in
             {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
              "adam": lambda ps: torch.optim.Adam(ps, lr=0.1)}.items()}
    set_aside_for_torchs_optimizers(Counting)
    set_aside_for_torchs_optimizers(Counting)  # once per process
    for name, make in {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                       "adam": lambda ps: torch.optim.Adam(ps, lr=0.1)}.items():
        after, during, hooked = two_steps(make, Counting)
        assert during == 0, (name, during)  # no call reached the mode in step or zero_grad
        assert hooked, name  # torch's hooks still run (the step stayed inside its profiling wrapper)
        assert all(torch.equal(a, b) for a, b in zip(after, plain[name])), name
    step = torch.optim.SGD.step
    assert getattr(step, "hooked", False) and getattr(step, "__tdmesh_functions_mode_aside__", False)
    assert not getattr(step.__wrapped__, "hooked", False)  # one profiling wrapper, not two
    # outside the mode, and with a closure, the mode is not involved / kept
    ps = params()
    opt = torch.optim.SGD(ps, lr=0.1)
    with Counting():
        before = Counting.calls
        opt.step(lambda: sum((p * p).sum() for p in ps))
        assert Counting.calls > before
    print("OK")
""")


def test_set_aside_wraps_hooked_and_unhooked_optimizer_classes_once():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK")
