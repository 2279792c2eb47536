"""Every code block of the README and of ``docs/`` runs, so the pages cannot rot.

A ``python`` block runs as a script on CPU workers.  A shell block is a list of commands, each
checked by what it claims: ``python -m pytest ARGS`` collects at least one test with ARGS (the
suite itself is not run twice), ``torchrun ... -m tdmesh.worker SCRIPT`` runs under torchrun
on 2 CPU ranks with a script that checks what the block's comment says, ``pip install`` names
the torch this suite runs on and an extra that ``setup.py`` has, and ``python FILE`` names a
file that exists (the tutorials' own tests run it).  A command of any other form fails the
test: a new kind of block needs a rule here before it can be published.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from paths import REPO

PAGES = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
CPU = dict(os.environ, TDMESH_DEVICE="cpu")


def blocks() -> list[tuple[str, int, str, str]]:
    """(page, line, language, code) of every fenced block."""
    found = []
    for page in PAGES:
        text = open(page).read()
        for mt in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            found.append((os.path.relpath(page, REPO), text[:mt.start()].count("\n") + 1, mt.group(1), mt.group(2)))
    return found


BLOCKS = blocks()
PYTHON = [b for b in BLOCKS if b[2] == "python"]
SHELL = [b for b in BLOCKS if b[2] != "python"]


def test_the_pages_have_blocks_to_check():
    assert PYTHON and SHELL, "the runner found no blocks: the fence pattern no longer matches the pages"


@pytest.mark.parametrize("page,line,lang,code", PYTHON, ids=[f"{b[0]}:{b[1]}" for b in PYTHON])
def test_python_block_runs(page, line, lang, code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=CPU)
    assert out.returncode == 0, f"{page}:{line}\n{out.stderr[-3000:]}"
    if (page, line) == PYTHON[0][:2]:  # the README's tour: what its comments say it prints
        assert "('/a', 'b')" in out.stdout and "not positive-definite" in out.stdout


def commands(code: str) -> list[tuple[dict, list[str], str]]:
    """(environment assignments, argv, trailing comment) per command, ``&&`` chains split."""
    out = []
    for raw in code.splitlines():
        text, _, comment = raw.partition("#")
        if not text.strip():
            continue
        for part in text.split("&&"):
            words = shlex.split(part)
            env = {}
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            out.append((env, words, comment.strip()))
    return out


SHELL_COMMANDS = [(page, line, *c) for page, line, _, code in SHELL for c in commands(code)]


SUITE_FILES = sorted(os.path.relpath(f, REPO) for f in glob.glob(os.path.join(REPO, "tests", "*", "test_*.py")))


def selection(args: list[str]) -> tuple[str | None, list[str]] | None:
    """(marker, paths) that ``python -m pytest ARGS`` selects, or None for an option not read here."""
    marker, paths = None, []
    words = iter(args)
    for word in words:
        if word == "-m":
            marker = next(words)
        elif word.startswith("-"):
            if word not in ("-q", "-v", "-x"):
                return None
        else:
            paths.append(os.path.normpath(word))
    return marker, paths


def collected_here(session, args: list[str]) -> int | None:
    """How many of this session's own tests ``python -m pytest ARGS`` would collect, where this
    session collected the whole suite (``python -m pytest -q`` itself is then running: a second
    collection of ~10 s a command would show nothing new); None where it cannot tell."""
    files = {os.path.relpath(str(item.path), REPO) for item in session.items}
    chosen = selection(args)
    if chosen is None or not set(SUITE_FILES) <= files:
        return None
    marker, paths = chosen
    return sum(1 for item in session.items
               if (marker is None or item.get_closest_marker(marker) is not None)
               and (not paths or any(os.path.relpath(str(item.path), REPO).startswith(p) for p in paths)))


@pytest.fixture(scope="module")
def collections(request):
    """Every page's ``python -m pytest`` command that this session's collection cannot answer,
    collected at once in a subprocess (each collects the whole suite, ~10 s): argv -> its run."""
    started = {}
    for _, _, env, argv, _ in SHELL_COMMANDS:
        if argv[:3] == ["python", "-m", "pytest"] and tuple(argv) not in started \
                and collected_here(request.session, argv[3:]) is None:
            started[tuple(argv)] = subprocess.Popen(
                [sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider", *argv[3:]],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=dict(CPU, **env))
    yield started
    for proc in started.values():
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("page,line,env,argv,comment", SHELL_COMMANDS,
                         ids=[f"{c[0]}:{c[1]}:{' '.join(c[3])[:40]}" for c in SHELL_COMMANDS])
def test_shell_command_does_what_it_says(page, line, env, argv, comment, tmp_path, collections, request):
    where = f"{page}:{line}: {' '.join(argv)}"
    if argv[:3] == ["python", "-m", "pytest"] and tuple(argv) not in collections:
        for path in selection(argv[3:])[1]:  # type: ignore[index]  # not None: collected_here read it
            assert os.path.exists(os.path.join(REPO, path)), f"{where}: no {path}"
        assert collected_here(request.session, argv[3:]), f"{where}: this suite has no test it would run"
    elif argv[:3] == ["python", "-m", "pytest"]:
        proc = collections[tuple(argv)]
        if not hasattr(proc, "output"):  # the same command on two pages is collected once
            proc.output = proc.communicate(timeout=300)[0]
        stdout = proc.output
        assert proc.returncode == 0, f"{where}\n{stdout[-2000:]}"
        assert re.search(r"^[1-9]\d*(/\d+)? tests? collected", stdout, re.M), f"{where}\n{stdout[-2000:]}"
    elif argv[0] == "torchrun":
        assert "-m" in argv and argv[argv.index("-m") + 1] == "tdmesh.worker", where
        script = tmp_path / argv[argv.index("-m") + 2]
        script.write_text("import sys, tdmesh\nmesh = tdmesh.world_mesh()\n"
                          "assert mesh.names == ('host', 'gpu'), mesh.names\n"
                          "print('ARGS', sys.argv[1:], flush=True)\n")
        flags = argv[1:argv.index("-m")]
        flags[flags.index("--nproc_per_node") + 1] = "2"  # 2 CPU ranks here, not the page's 8 GPUs
        rest = argv[argv.index("-m") + 3:]
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", *flags, "-m", "tdmesh.worker",
                              str(script), *rest], capture_output=True, text=True, timeout=300, cwd=REPO,
                             env=dict(CPU, **env))
        assert out.returncode == 0, f"{where}\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
        assert f"ARGS {rest}" in out.stdout, where
    elif argv[:2] == ["pip", "install"]:
        for spec in argv[2:]:
            if spec.startswith("torch=="):
                assert torch.__version__.split("+")[0] == spec.split("==")[1], where
            elif spec.startswith("-e"):
                continue
            else:
                extra = re.fullmatch(r"\.\[(\w+)\]", spec)
                assert extra is not None, f"{where}: an unknown requirement {spec!r}"
                assert f'"{extra.group(1)}"' in open(os.path.join(REPO, "setup.py")).read(), where
    elif argv[0] == "python" and len(argv) == 2 and argv[1].endswith(".py"):
        assert os.path.isfile(os.path.join(REPO, argv[1])), where
    else:
        pytest.fail(f"{where}: a command this runner cannot check; add a rule to tests/fleet/test_docs.py")
