"""Run untrusted Python (a model's completion) against tests in a child process with limits.

``run_in_sandbox(code, statements, ...)`` starts ``sys.executable -I -B`` (isolated mode: no
``PYTHON*`` variables, no user site-packages, no current folder on ``sys.path``; no bytecode
written) in a new, empty temporary folder as its working directory, with a minimal environment
(the default ``PATH``, ``HOME`` and ``TMPDIR`` set to that folder, a locale, one BLAS thread: none
of this process's variables), leading a new process group, its output discarded.
The child program (``code_sandbox_child.py``) first sets its limits and Python-level guards, then
runs the code and each test statement, and reports per-test results in a result file, on a line
prefixed by a random nonce it received on stdin. This process waits at most ``timeout`` seconds
(wall clock), then kills the child's whole process group, reads the result and removes the folder.

On Linux, where ``unshare`` works without privileges, the child runs in namespaces of its own
(``network_namespace=True``, the default; the first that works of): a user, network and PID
namespace with its own ``/proc`` (``unshare --user --net --pid --fork --mount-proc``); else a user
and network namespace (``unshare --user --net``: where ``/proc`` may not be mounted again, as in
some containers); else none. ``SandboxResult.notes`` names them ("network namespace",
"pid namespace"). These hold even against code that gets around the Python-level guards.

What it protects against (an accident or a careless solution, the usual case in RL on code):

- endless loops and slow code: the wall-clock timeout, and ``RLIMIT_CPU``;
- memory blow-ups: ``RLIMIT_AS`` (``memory_mb``) makes a huge allocation raise MemoryError;
- filling the disk: ``RLIMIT_FSIZE`` (``max_file_mb``) on any one file;
- writes outside the folder: ``open``, ``io.FileIO``/``_io.FileIO``, ``os.open`` with a writing
  flag and the os functions that create, rename, link, change or remove files, by path or by file
  descriptor (``fchmod``, ``fchown``, ``ftruncate``, ``chmod(fd)``, ``utime(fd)``...), refuse files
  that resolve outside it and the folder itself (``chmod('.', 0)``); C modules that write files by
  path themselves (sqlite3, dbm, readline, ssl, POSIX shared memory, tkinter, syslog) cannot be
  imported;
- this process's secrets in environment variables: the child's environment holds none of them.
  The environment this process started with stays readable in ``/proc/<pid>/environ`` (and its
  command line in ``cmdline``) to processes of the same user: in the PID namespace the child sees
  no process outside the sandbox, so no such file of the trainer or any other process; without it,
  only the Python-level guard stops it (opening anything under ``/proc/<pid>/`` of another process
  is refused);
- new processes: os's fork, exec, spawn, system and popen, subprocess and multiprocessing raise,
  ctypes and cffi cannot be imported, ``RLIMIT_NPROC`` is 0 (it counts all of the user's
  processes, so 0 is the only safe value; effective for a user other than root, for whom it also
  stops threads; root is exempt from it), and the process group is killed at the end; in the PID
  namespace, every process the child started ends with it;
- signals to other processes (the trainer): ``os.kill``/``os.killpg`` only reach the child itself
  and its process group (in the PID namespace ``os.getppid()`` is 0, which ``os.kill`` takes for
  that group);
- the network: creating a socket raises; in the network namespace no interface is up;
- forged results: the result line needs the nonce, which the solution is never given.

What it does NOT protect against: it is not a security boundary like a container or a VM. The
guards are Python-level replacements that deliberately malicious code can undo (the originals are
reachable through closures and ``object.__subclasses__()``, C extensions do their own I/O, the
nonce lies in a caller's frame), after which only the resource limits, the timeout, the process
group kill and, where available, the namespaces remain. Reads are NOT restricted beyond
``/proc/<pid>/`` of other processes: the code can read every other file this user can read (a
token saved in ``~/.cache/huggingface/token``, ``~/.netrc``, SSH keys, ``.env`` files, the
project), with or without the namespaces. ``RLIMIT_NPROC`` does nothing for root. Without the
PID namespace, a double-forked process that leaves the process group survives the kill. Solutions
that game their tests (an object whose ``__eq__`` is always true, redefining a name the tests use)
pass. For untrusted models or shared machines, run training inside a container or VM without
credentials, or use a remote sandbox service.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SandboxResult", "network_namespace_available", "pid_namespace_available", "run_in_sandbox", "split_tests"]

_CHILD = Path(__file__).with_name("code_sandbox_child.py")
_RESULT = "result"
_PROBE_TIMEOUT = 10.0


@functools.lru_cache(maxsize=1)
def _child_source() -> str:
    return _CHILD.read_text()


@dataclass
class SandboxResult:
    """How one run ended. ``passed``: one bool per test, None when the run gave no valid result
    (a timeout, a crash, a limit that killed it, the solution ending the process early)."""

    passed: list[bool] | None
    timed_out: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        """Share of the tests passed; 0 without a valid result (or without tests)."""
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


def split_tests(tests) -> list[tuple[str, bool]]:
    """The statements to run after the solution, each with whether it counts as a test.

    ``tests`` is a list of strings, each a test (an ``assert`` statement, or any code: it passes
    when it runs without raising), or one string of code: its top-level ``assert`` statements are
    the tests and its other statements (imports, helpers, set-up) run in order between them, not
    counted; a string without any ``assert`` (or that does not parse) is one test. Empty (None, "",
    []) gives no statements. A string of code must call its own checks: one that only defines
    ``check(candidate)`` passes without testing anything.
    """
    if tests is None:
        return []
    if isinstance(tests, str):
        if not tests.strip():
            return []
        try:
            body = ast.parse(tests).body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return [(tests, True)]
        statements = [(ast.unparse(node), isinstance(node, ast.Assert)) for node in body]
        return statements if any(is_test for _, is_test in statements) else [(tests, True)]
    if isinstance(tests, (list, tuple)):
        if not all(isinstance(test, str) for test in tests):
            kinds = sorted({type(test).__name__ for test in tests})
            raise TypeError(f"tests must be strings of code (e.g. 'assert f(1) == 2'), got items of type {kinds}")
        return [(test, True) for test in tests]
    raise TypeError(f"tests must be a list of strings or one string of code, got {type(tests).__name__}")


def _environment(root: str) -> dict[str, str]:
    """The child's whole environment: nothing of this process's (tokens, keys, proxies)."""
    return {"PATH": os.defpath, "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# The namespaces to run the child in, most isolating first; the first that works here without
# privileges is used. A user namespace lets an unprivileged user create the others; a network
# namespace has no interface up; a PID namespace with its own /proc shows the child no process
# outside it (``--fork``: the child is its first process, and every process in it ends with it).
_NAMESPACES = {("--user", "--net", "--pid", "--fork", "--mount-proc"): "import os; raise SystemExit(os.getpid() != 1)",
               ("--user", "--net"): "pass"}


@functools.lru_cache(maxsize=1)
def _namespace_options() -> tuple[str, ...]:
    """The ``unshare`` options of the first of ``_NAMESPACES`` that works here without privileges
    (tried once per process); () where none does (not Linux, no ``unshare``, user namespaces
    disabled, or a /proc that may not be mounted again, as in some containers)."""
    unshare = shutil.which("unshare")
    if not sys.platform.startswith("linux") or unshare is None:
        return ()
    for options, check in _NAMESPACES.items():
        try:
            done = subprocess.run([unshare, *options, sys.executable, "-I", "-c", check], env=_environment("/"),
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=_PROBE_TIMEOUT)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return options
    return ()


def network_namespace_available() -> bool:
    """Whether the child gets a network namespace here: ``unshare --user --net`` (with or without
    the PID namespace) works without privileges (tried once per process)."""
    return bool(_namespace_options())


def pid_namespace_available() -> bool:
    """Whether the child gets a PID namespace with its own ``/proc`` here: ``unshare --user --net
    --pid --fork --mount-proc`` works without privileges (tried once per process)."""
    return "--pid" in _namespace_options()


def _limits(timeout: float, memory_mb: int, max_file_mb: int) -> dict[str, int]:
    return {"RLIMIT_CPU": math.ceil(timeout) + 1, "RLIMIT_AS": memory_mb * 2**20, "RLIMIT_FSIZE": max_file_mb * 2**20,
            "RLIMIT_NPROC": 0, "RLIMIT_CORE": 0, "RLIMIT_NOFILE": 256}


def _wait_exited(pid: int, deadline: float) -> bool:
    """Wait until process ``pid`` has exited, without reaping it (so that its process group id
    stays reserved for the kill), or until ``deadline``; whether it exited."""
    pause = 0.001
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _read_result(root: str, nonce: str, count: int) -> list[bool] | None:
    try:
        with open(os.path.join(root, _RESULT), "rb") as file:
            data = file.read(1 << 20)
    except OSError:
        return None
    prefix = nonce.encode() + b" "
    lines = [line[len(prefix):] for line in data.split(b"\n") if line.startswith(prefix)]
    if len(lines) != 1 or len(lines[0]) != count or lines[0].strip(b"01"):
        return None
    return [bit == ord("1") for bit in lines[0]]


def _remove(root: str) -> None:
    """Remove the folder even where the code made parts of it (or the folder itself: the child
    refuses that, but its guards can be undone) unreadable or read-only."""
    try:
        os.chmod(root, 0o700)
    except OSError:
        pass
    for folder, subfolders, _ in os.walk(root):
        for name in subfolders:
            try:
                os.chmod(os.path.join(folder, name), 0o700, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass
    shutil.rmtree(root, ignore_errors=True)


def _feed(stream, payload: bytes) -> None:
    """Write the job to the child's stdin and close it; a child that ended first gets nothing."""
    try:
        stream.write(payload)
    except OSError:
        pass
    finally:
        try:
            stream.close()
        except OSError:
            pass


def _run_child(command: list[str], root: str, payload: bytes, timeout: float) -> bool:
    """Start the child, give it its job (from a thread: a job larger than the pipe's buffer must not
    block past the deadline), wait; kill its process group in any case. Whether it exited within
    ``timeout``."""
    process = subprocess.Popen(command, cwd=root, env=_environment(root), stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                               start_new_session=True)
    deadline = time.monotonic() + timeout
    feeder = threading.Thread(target=_feed, args=(process.stdin, payload), daemon=True)
    try:
        feeder.start()
        exited = _wait_exited(process.pid, deadline)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the child is not reaped yet: its group id is still its own
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()
        feeder.join(timeout=1.0)
    return exited


def run_in_sandbox(code: str, statements: list[tuple[str, bool]], *, timeout: float = 5.0, memory_mb: int = 512,
                   max_file_mb: int = 16, network_namespace: bool = True) -> SandboxResult:
    """Run ``code``, then ``statements`` (from ``split_tests``), in a sandboxed child process (see
    the module docstring for what that does and does not protect against). Each statement runs on
    its own, so a failing test does not stop the others. Never raises for anything the code does;
    a run that ends without a valid result has ``passed=None``. ``network_namespace=False`` runs it
    in no namespace at all (neither the network nor the PID one)."""
    if os.name != "posix":
        raise OSError("the code sandbox needs a POSIX system (resource limits, process groups)")
    count = sum(is_test for _, is_test in statements)
    root = os.path.realpath(tempfile.mkdtemp(prefix="grpo_lab_sandbox_"))
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "code": code, "statements": statements, "result": _RESULT,
           "limits": _limits(timeout, memory_mb, max_file_mb)}
    command = [sys.executable, "-I", "-B", "-c", _child_source()]
    options = _namespace_options() if network_namespace else ()
    if options:
        command = [shutil.which("unshare") or "unshare", *options, *command]
    start = time.monotonic()
    try:
        exited = _run_child(command, root, json.dumps(job).encode(), timeout)
        passed = _read_result(root, nonce, count) if exited else None
    finally:
        _remove(root)
    notes = (["network namespace"] if options else []) + (["pid namespace"] if "--pid" in options else [])
    return SandboxResult(passed, timed_out=not exited, seconds=time.monotonic() - start, notes=notes)
