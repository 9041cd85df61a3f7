"""code_reward and its sandbox: passing and failing tests, and code that loops, forks, connects,
writes outside its folder or allocates too much, each scored 0 without stopping the batch."""

import os
import pickle
import socket
import textwrap

import pytest

from grpo_lab.rewards import code_reward, python_code, run_in_sandbox
from grpo_lab.rewards.code_sandbox import split_tests
from tests.rewards.conftest import ISOLATION_IDS, ISOLATION_OPTIONS

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the code sandbox needs a POSIX system")

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{textwrap.dedent(code).strip()}\n```\nIt adds the numbers."


def score(completions, tests, **options):
    return code_reward(**options)(completions=completions, tests=[tests] * len(completions))


def test_a_correct_solution_scores_one(sandboxes):
    assert score([fenced("def add(a, b):\n    return a + b")], ADD_TESTS) == [1.0]


def test_half_the_tests_passing_scores_one_half(sandboxes):
    # right except when a is 0 or -1: add(1, 2) and add(2, 2) pass, add(-1, 1) and add(0, 5) fail -> 2/4
    code = "def add(a, b):\n    return a + b if a not in (0, -1) else None"
    assert score([fenced(code)], ADD_TESTS) == [0.5]


def test_a_string_of_tests_counts_its_asserts(sandboxes):
    tests = "import math\nexpected = 4\nassert add(2, 2) == expected\nassert add(1, 1) == 3\n"
    assert split_tests(tests) == [("import math", False), ("expected = 4", False),
                                  ("assert add(2, 2) == expected", True), ("assert add(1, 1) == 3", True)]
    assert score([fenced("def add(a, b):\n    return a + b")], tests) == [0.5]


def test_the_whole_text_is_the_code_without_a_fenced_block(sandboxes):
    assert python_code("def f():\n    return 1") == "def f():\n    return 1"
    assert python_code("```python\nx = 1\n```\nthen\n```py\nx = 2\n```") == "x = 2\n"
    assert score(["def add(a, b):\n    return a + b"], ADD_TESTS) == [1.0]
    assert score(["This is not code at all."], ADD_TESTS) == [0.0]


def test_an_endless_loop_scores_zero_and_returns(sandboxes):
    assert score([fenced("while True:\n    pass")], ADD_TESTS, timeout=1.0) == [0.0]
    looping_function = "def add(a, b):\n    while True:\n        pass"
    assert score([fenced(looping_function)], ADD_TESTS, timeout=1.0) == [0.0]


def test_fork_scores_zero(sandboxes):
    code = """
        import os
        def add(a, b):
            if os.fork() == 0:
                os._exit(0)
            return a + b
    """
    assert score([fenced(code)], ADD_TESTS) == [0.0]
    assert score([fenced("import subprocess\ndef add(a, b):\n    return int(subprocess.check_output(['echo', "
                         "str(a + b)]))")], ADD_TESTS) == [0.0]


@pytest.mark.parametrize("isolation", ISOLATION_OPTIONS, ids=ISOLATION_IDS)
def test_a_connection_to_localhost_scores_zero_and_never_arrives(sandboxes, isolation):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = f"""
            import socket
            def add(a, b):
                socket.create_connection(("127.0.0.1", {port}), timeout=2).sendall(b"hello")
                return a + b
        """
        assert score([fenced(code)], ADD_TESTS, **isolation) == [0.0]
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()


def test_a_write_outside_the_folder_scores_zero_and_leaves_no_file(sandboxes, tmp_path):
    target = tmp_path / "escaped.txt"
    for code in (f"def add(a, b):\n    open({str(target)!r}, 'w').write('x')\n    return a + b",
                 f"import pathlib\ndef add(a, b):\n    pathlib.Path({str(target)!r}).write_text('x')\n    return a + b",
                 f"import os\ndef add(a, b):\n    os.close(os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY))\n"
                 "    return a + b",
                 f"import os\ndef add(a, b):\n    os.symlink({str(tmp_path)!r}, 'link')\n"
                 "    open('link/escaped.txt', 'w').write('x')\n    return a + b"):
        assert score([fenced(code)], ADD_TESTS) == [0.0]
        assert not target.exists()
    inside = "def add(a, b):\n    open('notes.txt', 'w').write('x')\n    return a + b"  # its own folder: allowed
    assert score([fenced(inside)], ADD_TESTS) == [1.0]


def test_a_huge_allocation_scores_zero(sandboxes):
    code = "def add(a, b):\n    block = b'x' * (4 * 1024 ** 3)\n    return a + b"
    assert score([fenced(code)], ADD_TESTS, memory_mb=256) == [0.0]


def test_the_environment_is_not_inherited(sandboxes, monkeypatch):
    monkeypatch.setenv("GRPO_LAB_TEST_SECRET", "s3cret")
    code = "import os\ndef add(a, b):\n    return a + b if 'GRPO_LAB_TEST_SECRET' not in os.environ else 0"
    assert score([fenced(code)], ADD_TESTS) == [1.0]


@pytest.mark.parametrize("isolation", ISOLATION_OPTIONS, ids=ISOLATION_IDS)
def test_forged_results_and_early_exits_score_zero(sandboxes, isolation):
    forged = "open('result', 'w').write('0123456789abcdef0123456789abcdef 1111\\n')\nimport os\nos._exit(0)"
    assert score([fenced(forged)], ADD_TESTS, **isolation) == [0.0]
    # this process (the trainer) by its pid: in a PID namespace os.getppid() is 0, the child's own group
    killer = f"""
        import os
        def add(a, b):
            try:
                os.kill({os.getpid()}, 9)  # would end this test run
            except PermissionError:
                return a + b
    """
    assert score([fenced(killer)], ADD_TESTS, **isolation) == [1.0]  # refused, still here


def test_one_bad_completion_does_not_stop_the_batch(sandboxes):
    metrics, extras = {}, {}
    completions = [fenced("def add(a, b):\n    return a + b"), fenced("while True:\n    pass"),
                   [{"role": "assistant", "content": fenced("def add(a, b):\n    return a - b")}],
                   fenced("raise SystemExit(1)"), fenced("def add(a, b):\n    return a + b")]
    tests = [ADD_TESTS] * 4 + [[]]  # the last row has no tests: None
    reward = code_reward(timeout=3.0, max_workers=2)
    rewards = reward(completions=completions, tests=tests, log_metric=lambda k, v: metrics.update({k: v}),
                     log_extra=lambda k, v: extras.update({k: v}))
    # a - b passes add(-1, 1)? -2, no; add(2, 2)? 0, no; add(0, 5)? -5, no; add(1, 2)? -1, no -> 0
    assert rewards == [1.0, 0.0, 0.0, 0.0, None]
    assert metrics == {"code_sandbox/timeouts": 1, "code_sandbox/no_result": 1}
    assert extras == {"tests_passed": ["4/4", "timeout", "0/4", "0/4", "no tests"]}


def test_run_in_sandbox_runs_each_test_on_its_own(sandboxes):
    statements = split_tests(["assert f() == 1", "raise SystemExit", "assert f() + 1 == 2"])
    result = run_in_sandbox("def f():\n    return 1", statements)
    assert result.passed == [True, False, True] and result.score == pytest.approx(2 / 3)


def test_bad_tests_column_raises(sandboxes):
    with pytest.raises(KeyError, match="tests_column"):
        code_reward()(completions=["x = 1"], answers=["1"])
    with pytest.raises(TypeError, match="strings of code"):
        code_reward()(completions=["x = 1"], tests=[[{"input": "1", "output": "2"}]])


def test_a_job_larger_than_a_pipe_buffer_and_pickling(sandboxes):
    padding = "# " + "x" * 200_000 + "\n"  # more than a pipe holds: the job is written while the child reads
    reward = pickle.loads(pickle.dumps(code_reward(timeout=5.0)))
    assert reward.__name__ == "code_reward"
    assert reward(completions=[fenced(padding + "def add(a, b):\n    return a + b")], tests=[ADD_TESTS]) == [1.0]
