"""Reward for code: the share of a row's tests that the completion's Python passes, run in the
sandbox of ``grpo_lab.rewards.code_sandbox`` (read its docstring before training on untrusted
models: it limits accidents, it is not a security boundary like a container)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from grpo_lab.rewards.code_sandbox import SandboxResult, check_isolation, run_in_sandbox, split_tests
from grpo_lab.rewards.extraction import completion_text

__all__ = ["code_reward", "python_code"]

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)


def python_code(text: str) -> str:
    """The Python of a completion: the content of its last fenced block marked ``python`` (or
    ``py``, ``python3``), else the whole text."""
    blocks = _FENCE.findall(text or "")
    return blocks[-1] if blocks else (text or "")


class CodeReward:
    """The reward function ``code_reward`` returns. A class rather than a closure, so that it
    pickles (a spawned worker process can receive it)."""

    __name__ = "code_reward"

    def __init__(self, timeout: float, memory_mb: int, tests_column: str, max_workers: int | None,
                 max_file_mb: int, network_namespace: bool, isolation: str):
        if not 0 < timeout < float("inf") or memory_mb < 16 or max_file_mb < 1:  # inf: no deadline to wait for
            raise ValueError(f"need a finite timeout > 0 (seconds), memory_mb >= 16 and max_file_mb >= 1; got "
                             f"timeout={timeout}, memory_mb={memory_mb}, max_file_mb={max_file_mb}")
        if os.name != "posix":
            raise OSError("code_reward needs a POSIX system (resource limits, process groups)")
        self.timeout, self.memory_mb, self.max_file_mb = timeout, memory_mb, max_file_mb
        check_isolation(isolation, network_namespace)  # now, not at the first reward call
        self.tests_column, self.max_workers, self.network_namespace = tests_column, max_workers, network_namespace
        self.isolation = isolation

    def _run(self, job: tuple[str, list]) -> SandboxResult | None:
        code, statements = job
        if not any(is_test for _, is_test in statements):
            return None
        try:
            return run_in_sandbox(code, statements, timeout=self.timeout, memory_mb=self.memory_mb,
                                  max_file_mb=self.max_file_mb, network_namespace=self.network_namespace,
                                  isolation=self.isolation)
        except Exception as error:  # the sandbox itself failed (no process could start...): 0, and go on
            return SandboxResult(None, notes=[f"{type(error).__name__}: {error}"])

    def _workers(self, count: int) -> int:
        cap = os.cpu_count() or 1
        return max(1, min(count, cap, self.max_workers or cap))

    def __call__(self, completions: list, log_extra: Callable[[str, list], None] | None = None,
                 log_metric: Callable[[str, float], None] | None = None, **kwargs) -> list[float | None]:
        if self.tests_column not in kwargs:
            raise KeyError(f"code_reward reads the tests from the dataset column {self.tests_column!r}, which this "
                           f"call lacks (it has: {sorted(kwargs)}); name the column with code_reward(tests_column=...)")
        tests_B = kwargs[self.tests_column]
        jobs = [(python_code(completion_text(c)), split_tests(t)) for c, t in zip(completions, tests_B, strict=True)]
        if not jobs:
            return []
        with ThreadPoolExecutor(max_workers=self._workers(len(jobs)), thread_name_prefix="code_reward") as pool:
            results = list(pool.map(self._run, jobs))
        rewards = [None if result is None else result.score for result in results]
        if log_extra is not None:
            log_extra("tests_passed", [_shown(result) for result in results])
        if log_metric is not None:
            log_metric("code_sandbox/timeouts", sum(r is not None and r.timed_out for r in results))
            log_metric("code_sandbox/no_result", sum(r is not None and r.passed is None for r in results))
        return rewards


def _shown(result: SandboxResult | None) -> str:
    if result is None:
        return "no tests"
    if result.timed_out:
        return "timeout"
    if result.passed is None:
        return "no result"
    return f"{sum(result.passed)}/{len(result.passed)}"


def code_reward(timeout: float = 5.0, memory_mb: int = 512, tests_column: str = "tests", max_workers: int | None = None,
                max_file_mb: int = 16, network_namespace: bool = True, isolation: str = "os") -> CodeReward:
    """A reward function that runs each completion's Python against its row's tests in a sandboxed
    child process, and returns the share of the tests it passes.

    Formula: r = (tests passed) / (tests), per completion; 0 when the run ends without a result
    (it timed out after ``timeout`` seconds of wall clock, exceeded ``memory_mb`` of address space
    or a file of ``max_file_mb``, crashed, or ended the process itself); None for a row without
    tests. The code is ``python_code(completion)``: the last fenced ``python`` block, else the
    whole text. The tests come from the dataset column ``tests_column`` (default ``tests``): a list
    of strings, each one test (an ``assert``; passes when it runs without raising), or one string
    of code whose top-level ``assert`` statements are the tests (see ``code_sandbox.split_tests``).
    Each test runs on its own, after the solution, against the solution's names, in a judge
    process beside the solution's (only plain values cross: a test passes the solution plain
    values or objects it returned, and compares plain values); one child per completion;
    completions run in parallel on up to ``max_workers`` threads (default and cap: the CPU count).

    The sandbox (``grpo_lab.rewards.code_sandbox``, whose docstring lists what it does and does not
    stop): isolated interpreter in a fresh temporary folder removed afterwards, no inherited
    environment variables, resource limits, Python-level guards against forks, subprocesses,
    sockets and writes outside the folder, the process group killed at the end; and, with
    ``isolation="os"`` (the default), the operating system's own isolation, which holds against
    code that undoes those guards: a root of its own (the folder writable, the system's programs
    and libraries and the interpreter read-only, nothing else: no home folder, /etc, /tmp or
    project), mount, network and PID namespaces, every capability dropped, and ``nobody`` as its
    user when the trainer runs as root (so the process limit binds). Where that cannot run (not
    Linux, no user namespaces, no ``unshare``/``setpriv``) this refuses at once, naming
    ``isolation="python"``, which accepts the Python-level guards with the namespaces that work
    (``network_namespace=False``: none). Needs a POSIX system.

    Logs: the column ``tests_passed`` ("3/4", "timeout", "no result", "no tests") and the metrics
    ``code_sandbox/timeouts`` and ``code_sandbox/no_result`` (counts per call).

    Source: the execution-based test-pass reward of code RL (e.g. CodeRL, Le et al. 2022,
    arXiv:2207.01780; DeepSeek-R1's rule-based code rewards); grpo_lab's own implementation.
    """
    return CodeReward(timeout, memory_mb, tests_column, max_workers, max_file_mb, network_namespace, isolation)
