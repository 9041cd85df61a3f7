"""The sandbox's judge: the tests run in a process of their own against stand-ins of the solution's
names, and only plain values cross between the two (the wire format, checked by hand), so that a
solution decides nothing but its own answers."""

import importlib.util
import os
import textwrap

import pytest

from grpo_lab.rewards import code_sandbox, run_in_sandbox
from grpo_lab.rewards.code_sandbox import split_tests
from tests.rewards.conftest import ISOLATION_IDS, ISOLATION_OPTIONS

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the code sandbox needs a POSIX system")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(code_sandbox.__file__),
                                                                      f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


child = _load("code_sandbox_child")


def passed(code: str, tests, **options):
    return run_in_sandbox(textwrap.dedent(code), split_tests(tests), **options).passed


def no_handles(value):
    raise AssertionError(f"{value!r} should have gone as a plain value")


def test_plain_values_go_as_json_and_come_back_as_themselves():
    value = [None, True, 3, -0.5, "é", (1, (2,)), {"k": [1, 2], 3: b"\x00\xff"}, {1, 2}, frozenset({"a"}),
             bytearray(b"ab"), 1 + 2j]
    wire = child.to_wire(value, no_handles)
    assert wire == [None, True, 3, -0.5, "é", {"tuple": [1, {"tuple": [2]}]},
                    {"dict": [["k", [1, 2]], [3, {"bytes": "00ff"}]]}, {"set": [1, 2]}, {"frozenset": ["a"]},
                    {"bytearray": "6162"}, {"complex": [1.0, 2.0]}]
    back = child.from_wire(wire, no_handles)
    assert back == value and [type(v) for v in back] == [type(v) for v in value]


def test_subclasses_go_as_their_plain_value_and_named_tuples_keep_their_fields():
    import collections
    import enum

    class Level(enum.IntEnum):
        HIGH = 3

    class Shouting(str):
        def __eq__(self, other):  # what the judge must never run
            return True

        __hash__ = str.__hash__

    assert child.to_wire([Level.HIGH, Shouting("a")], no_handles) == [3, "a"]
    Point = collections.namedtuple("Point", "x y")
    wire = child.to_wire(Point(1, 2), no_handles)
    assert wire == {"namedtuple": ["Point", ["x", "y"], [1, 2]]}
    back = child.from_wire(wire, no_handles)
    assert back == (1, 2) and (back.x, back.y) == (1, 2) and type(back) is not Point
    assert type(child.from_wire(wire, no_handles)) is type(back)  # one type per shape
    stat = child.from_wire(child.to_wire(os.stat_result(range(10)), no_handles), no_handles)
    assert stat.st_size == 6 and len(stat) == 10  # a struct sequence: named fields, then the rest


def test_other_objects_go_by_handle_and_malformed_data_is_refused():
    handles = {}
    wire = child.to_wire([len, {"f": len}], lambda value: handles.setdefault(id(value), len(handles)))
    assert wire == [{"object": 0}, {"dict": [["f", {"object": 0}]]}]
    assert child.from_wire(wire, lambda handle: f"object {handle}") == ["object 0", {"f": "object 0"}]
    for bad in ({"object": "0"}, {"tuple": 3}, {"a": 1, "b": 2}, {"dict": [[1]]}, {"complex": ["1", 2]},
                {"namedtuple": ["P", "xy", [1]]}, {"eval": "1"}):
        with pytest.raises(ValueError, match="wire format"):
            child.from_wire(bad, no_handles)
    nested = [[]]
    for _ in range(child.MAX_DEPTH + 5):
        nested = [nested]
    with pytest.raises(ValueError, match="nested too deeply"):
        child.to_wire(nested, no_handles)


@pytest.mark.parametrize("isolation", ISOLATION_OPTIONS, ids=ISOLATION_IDS)
def test_a_solution_cannot_decide_a_comparison_or_redefine_what_the_tests_use(sandboxes, isolation):
    code = """
        import builtins
        class Always:
            def __eq__(self, other):
                return True
            __ne__ = __lt__ = __gt__ = __eq__
        def add(a, b):
            return Always()
        def items():
            return [1]
        builtins.sorted = lambda anything: [3]  # the tests' sorted is not this one
        builtins.AssertionError = type("Harmless", (Exception,), {})
        class Everything:
            def __contains__(self, value):
                return True
            def __iter__(self):
                return iter([1])
        def primes():
            return Everything()
        def is_prime(n):
            raise StopIteration  # would end the tests' map early: all() of nothing is True
        def all(anything):  # a name of its own that is a built-in's: the tests keep Python's
            return True
        class Array:
            __array_interface__ = {"data": (0, False), "shape": (1,), "typestr": "<i8", "version": 3}
        def array():
            return Array()
        def leave_the_group():
            import os
            os.setsid()
    """
    tests = ["assert add(1, 2) == 3", "assert not (add(1, 2) != 3)", "assert sorted(items()) == [3]",
             "assert items() == [1]", "assert str(add(1, 2)).startswith('<')",
             "assert 5 in primes()", "assert 1 in primes()",  # `in` iterates and compares here
             "assert all(map(is_prime, [2, 3, 5]))", "assert all([False])",
             # special names are not the solution's to answer (numpy would read memory at the address given)
             "assert not hasattr(array(), '__array_interface__') and hasattr(array(), '__class__')",
             "try:\n    leave_the_group()\nexcept PermissionError:\n    pass"]  # it would outlive the group's kill
    assert passed(code, tests, **isolation) == [False, False, False, True, True, False, True, False, False, True,
                                                True]


def test_the_solutions_objects_work_from_the_tests(sandboxes):
    code = """
        class Node:
            def __init__(self, value, next=None):
                self.value, self.next = value, next
        def reverse(node):
            previous = None
            while node is not None:
                node.next, previous, node = previous, node, node.next
            return previous
        def squares(n):
            for i in range(n):
                yield i * i
        SHARED = object()
        def shared():
            return SHARED
        def sort_in_place(items, table):
            items.sort()
            table["sorted"] = True
        class Invalid(Exception):
            pass
        def check(x):
            if x < 0:
                raise ValueError("negative")
            raise Invalid("odd")
    """
    tests = [
        "head = reverse(Node(1, Node(2, Node(3))))\nout = []\nwhile head:\n    out.append(head.value)\n"
        "    head = head.next\nassert out == [3, 2, 1]",
        "assert list(squares(4)) == [0, 1, 4, 9] and sum(squares(3)) == 5",
        "assert shared() is shared()",
        "items, table = [3, 1, 2], {}\nsort_in_place(items, table)\n"
        "assert items == [1, 2, 3] and table == {'sorted': True}",
        "try:\n    check(-1)\nexcept ValueError as error:\n    assert str(error) == 'negative'",
        "try:\n    check(1)\nexcept ValueError:\n    pass",  # the solution's own class is no ValueError
        "assert sorted(squares(3), key=lambda x: -x) == [4, 1, 0]",  # the key runs in the tests' process
        "reverse(lambda: 1)",  # a function of the tests cannot be passed: TypeError
        "from solution import Node\nassert Node(5).value == 5",
    ]
    assert passed(code, tests) == [True, True, True, True, True, False, True, False, True]


@pytest.mark.parametrize("isolation", ISOLATION_OPTIONS, ids=ISOLATION_IDS)
def test_a_solution_that_ends_its_process_has_no_verdict_whatever_the_tests_catch(sandboxes, isolation):
    code = """
        import os
        def add(a, b):
            return a + b
        def stop():
            os._exit(0)
    """
    tests = ["assert add(1, 2) == 3", "try:\n    stop()\nexcept BaseException:\n    pass", "assert add(2, 2) == 4"]
    result = run_in_sandbox(textwrap.dedent(code), split_tests(tests), **isolation)
    assert result.passed is None and result.score == 0.0


def test_the_solution_never_holds_the_tests_or_the_nonce(sandboxes):
    code = """
        import gc, sys
        def holding(values, marker):
            texts = [v.decode("latin-1") if isinstance(v, bytes) else v for v in values if isinstance(v, (str, bytes))]
            return [text for text in texts if marker in text]
        def seen(marker):  # every string the solution's process holds with the marker in it
            found = []
            for thing in gc.get_objects():
                values = thing.values() if isinstance(thing, dict) else thing if type(thing) in (list, tuple) else ()
                found += holding(values, marker)
            frame = sys._getframe()
            while frame is not None:
                found += holding(frame.f_locals.values(), marker)
                frame = frame.f_back
            return found
        HELD = "GRPO_LAB_" + "SOLUTION_MARK"
    """
    # Only a copy of this test's source (its comment) or of the judge's program would hold the marks.
    tests = ["found = seen('GRPO_LAB_')\n# GRPO_LAB_TEST_MARK\n"
             "assert any('SOLUTION_MARK' in text for text in found)\n"  # the scan finds what the solution holds
             "assert not any('TEST_MARK' in text for text in found)",
             "assert not any('SolutionEnded' in text for text in seen('Solution'))"]  # a name in the judge's program
    assert passed(code, tests) == [True, True]
