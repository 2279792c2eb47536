"""Callables shipped by value keep the file of their code (cloudpickle >= 3.1 renames it)."""

import types

import cloudpickle

from tdmesh.protocol.codec import load_callable, with_source


def _as_cloudpickle_3_1_ships_it(fn):
    """``fn`` with every code object named ``<dynamic-code>``, as cloudpickle >= 3.1 rebuilds it."""
    def rename(code):
        consts = tuple(rename(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
        return code.replace(co_filename="<dynamic-code>", co_consts=consts)
    fn.__code__ = rename(fn.__code__)
    return fn


def test_a_function_and_the_functions_it_defines_get_their_file_back():
    def outer(x):
        def inner(y):
            return y + 1
        return inner(x)

    payload = with_source(cloudpickle.dumps(_as_cloudpickle_3_1_ships_it(outer)), "/home/me/train.py")
    back = load_callable(payload)
    assert back(1) == 2
    assert back.__code__.co_filename == "/home/me/train.py"
    nested = [c for c in back.__code__.co_consts if isinstance(c, types.CodeType)]
    assert nested and all(c.co_filename == "/home/me/train.py" for c in nested)


def test_a_class_gets_its_methods_files_back():
    class Loader:
        def next(self):
            return 1

        @staticmethod
        def make():
            return Loader()

        @property
        def size(self):
            return 3

    for fn in (Loader.next, Loader.__dict__["make"].__func__, Loader.size.fget):
        _as_cloudpickle_3_1_ships_it(fn)
    back = load_callable(with_source(cloudpickle.dumps(Loader), "/home/me/train.py"))
    assert back.make().next() == 1 and back().size == 3
    assert {back.next.__code__.co_filename, back.__dict__["make"].__func__.__code__.co_filename,
            back.size.fget.__code__.co_filename} == {"/home/me/train.py"}


def test_without_a_file_the_payload_is_plain_cloudpickle():
    payload = cloudpickle.dumps(len)
    assert with_source(payload, None) is payload and load_callable(payload) is len
