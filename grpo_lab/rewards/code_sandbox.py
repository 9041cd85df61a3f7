"""Run untrusted Python (a model's completion) against tests in a child process with limits.

``run_in_sandbox(code, statements, ...)`` starts ``sys.executable -I -B`` (isolated mode: no
``PYTHON*`` variables, no user site-packages, no current folder on ``sys.path``; no bytecode
written) in a new, empty temporary folder as its working directory, with a minimal environment
(the default ``PATH``, ``HOME`` and ``TMPDIR`` set to that folder, a locale, one BLAS thread: none
of this process's variables), leading a new process group, its error output discarded.
The child program (``code_sandbox_child.py``) splits in two before any of the code runs: the
solution's process sets its limits and Python-level guards, runs the code and then only answers
requests; the judge (``code_sandbox_judge.py``), a process of its own under the same limits and
guards, runs each test statement against stand-ins of the solution's names (a plain value as a
copy, any other object as a handle whose uses are requests to the solution's process: only JSON
crosses) and reports per-test results on its standard output, a pipe to this process that the
solution's process does not hold, on a line prefixed by a random nonce it alone received on
stdin. This process waits at most ``timeout`` seconds (wall clock), then kills the child's whole
process group, reads the result and removes the folder.

What the tests can do with the solution's objects: call them, read and set their attributes and
items, take their length, truth, ``str`` and ``repr``, iterate over them; what they can pass: plain
values (None, bool, int, float, complex, str, bytes, and tuples, lists, dicts and sets of them; a
list, dict or set passed positionally that the call changed in place is changed on the tests' side
too) and the solution's
own objects. Not a function or an object of the tests' own (a lambda as an argument fails that
test with TypeError), and no comparison of one of the solution's objects other than a plain
value (``==`` on it fails the test: the solution's ``__eq__`` would decide it).

**OS isolation** (``isolation="os"``, the default) is what holds against code written to get out:
the child runs in mount, network, PID, IPC and UTS namespaces of its own (and a user namespace
when the trainer is not root), in a root of its own built on a 1 MB read-only tmpfs, which holds
the sandbox folder (a tmpfs of its own, ``4 * max_file_mb`` MB: the limit of all it writes, with no
link to this machine's files), the system's programs and libraries
and the interpreter's installation (bound read-only), a ``/proc`` of the PID namespace and the
null, zero and random devices: no home folder, no ``/etc``, no ``/tmp``, no project, no other
process, no shared memory or message queue of the machine's. It runs with every capability
dropped (``setpriv --bounding-set=-all --no-new-privs``) and, when the trainer is root, as
``nobody`` (65534), so that ``RLIMIT_NPROC`` binds and no file of root's is writable. Where this
cannot run (not Linux, no user namespaces for an unprivileged user, no ``unshare``/``setpriv``
from util-linux), ``run_in_sandbox`` and ``code_reward`` refuse at once, naming the setting that
accepts the weaker guard, ``isolation="python"``.

With ``isolation="python"`` the child runs in the namespaces that work here without privileges
(``network_namespace=True``; the first that works of): a user, network and PID namespace with its
own ``/proc`` (``unshare --user --net --pid --fork --mount-proc``); else a user and network
namespace (``unshare --user --net``: where ``/proc`` may not be mounted again, as in some
containers); else none; ``network_namespace=False`` uses none. ``SandboxResult.notes`` names them
("os isolation", "network namespace", "pid namespace").

The Python-level guards below run under both; under ``isolation="python"`` they are most of the
protection.

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
- forged results: the tests and the nonce of the result line are only ever in the judge's
  process, which the solution's cannot read or trace (the judge is undumpable from before the
  split: no process of its user may open its memory or ``/proc`` files, or attach to it; in the
  PID namespace it is the namespace's first process, which no signal from inside ends), and the
  result goes over the judge's stdout, which the solution's process does not hold; a value whose
  ``__eq__`` is always true, or a built-in the solution redefines or shadows with a name of its
  own, stays in the solution's process: the tests compare plain values with their own built-ins;
- the session keyring: the child joins a new, empty one before the split, so keys the trainer's
  session holds are not the child's to read (on the machines in ``KEYCTL`` of the child
  program: x86-64, ARM, RISC-V, POWER, s390x; where the kernel refuses the call to the child, a
  seccomp filter, it refuses the solution's too).

What remains possible under OS isolation: a solution that fits its answers to the arguments
it is called with (weak tests are still weak; it never sees the tests themselves). The child can read what the
read-only paths hold (the system's and the interpreter's files, which hold no secrets on a usual
machine: a token kept inside the Python installation would be readable) and use the CPU and
memory its limits allow. It shares the kernel: a kernel exploit is not stopped (a VM stops that).

Under ``isolation="python"``, also: the guards are Python-level replacements that deliberately
malicious code can undo (a fresh copy of a built-in module such as ``posix`` holds the original
functions; the originals are reachable through closures), after which only the resource limits,
the timeout, the process group kill and, where available, the namespaces remain. Reads are not
restricted beyond ``/proc/<pid>/`` of other processes: the code can read every other file this
user can read (a token saved in ``~/.cache/huggingface/token``, ``~/.netrc``, SSH keys, ``.env``
files, the project). ``RLIMIT_NPROC`` does nothing for root. Without the PID namespace, a
double-forked process that leaves the process group survives the kill.
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

__all__ = ["ISOLATIONS", "SandboxResult", "check_isolation", "network_namespace_available", "os_isolation_problem",
           "pid_namespace_available", "run_in_sandbox", "split_tests"]

_CHILD = Path(__file__).with_name("code_sandbox_child.py")
_JUDGE = Path(__file__).with_name("code_sandbox_judge.py")
_PROBE_TIMEOUT = 10.0


@functools.lru_cache(maxsize=1)
def _child_source() -> str:
    return _CHILD.read_text()


@functools.lru_cache(maxsize=1)
def _judge_source() -> str:
    return _JUDGE.read_text()


def _job(code: str, statements: list[tuple[str, bool]], nonce: str, limits: dict[str, int]) -> bytes:
    """The child's stdin: a line with the sizes of its two parts, then the part read before it
    splits (the solution's code, the limits), then the judge's alone (the tests, the nonce, the
    judge's program)."""
    launch = json.dumps({"code": code, "limits": limits}).encode()
    judge = json.dumps({"nonce": nonce, "statements": statements, "judge": _judge_source()}).encode()
    return f"{len(launch)} {len(judge)}\n".encode() + launch + judge


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


ISOLATIONS = ("os", "python")

UNPRIVILEGED_ID = 65534
"""The uid and gid (``nobody``) the child runs as when the trainer is root, under OS isolation."""

# Run by ``sh`` as the first process of new mount, network, PID, IPC and UTS namespaces (and a user
# namespace where the trainer is not root): builds a root of its own on a small tmpfs, the system's
# programs and libraries and the interpreter's installation bound read-only, the sandbox folder a
# tmpfs of its own (its size the limit of all the code writes), a /proc of the PID namespace (where the
# kernel allows one) and four
# device files; then enters it and runs the command there. Arguments: the mount and unshare
# programs, the root's folder, the sandbox folder, its size in MB, the owner options of its tmpfs,
# then pairs (bind PATH | link PATH), then --, then the command.
_BUILD_ROOT = r"""
set -e
umask 022
mount=$1; unshare=$2; fs=$3; work=$4; size=$5; owner=$6; shift 6
"$mount" -t tmpfs -o size=1m,mode=755 grpo_lab_sandbox "$fs"
while [ "$1" != "--" ]; do
  if [ "$1" = link ]; then
    mkdir -p "$fs$(dirname "$2")"; ln -s "$(readlink "$2")" "$fs$2"
  else
    mkdir -p "$fs$2"; "$mount" --bind -o ro "$2" "$fs$2"
  fi
  shift 2
done
shift
mkdir -p "$fs/dev" "$fs/proc" "$fs$work"
for device in null zero random urandom; do
  touch "$fs/dev/$device"; "$mount" --bind "/dev/$device" "$fs/dev/$device"
done
"$mount" -t tmpfs -o "size=${size}m,mode=700$owner" grpo_lab_sandbox_folder "$fs$work"
"$mount" -t proc proc "$fs/proc" 2>/dev/null || true
"$mount" -o remount,bind,ro "$fs"
exec "$unshare" --root="$fs" --wd="$work" "$@"
"""


def _system_paths() -> list[tuple[str, str]]:
    """What the child sees of this machine under OS isolation, each ("bind", path) (read-only) or
    ("link", path) (the same symbolic link): the system's programs and libraries, and the
    interpreter's installation and virtual environment. Not /etc, /home, /root, /tmp, the project."""
    entries, bound = [], []
    for path in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", sys.base_prefix, sys.prefix):
        if os.path.islink(path) and os.path.dirname(path) == "/":
            entries.append(("link", path))
        elif os.path.isdir(path):
            real = os.path.realpath(path)
            if not any(real == b or real.startswith(b + os.sep) for b in bound):
                bound.append(real)
                entries.append(("bind", real))
    return entries


def _os_isolation_command(root: str, fs: str, command: list[str], folder_mb: int) -> list[str]:
    """``command`` run inside its own root (see ``_BUILD_ROOT``) with a sandbox folder of
    ``folder_mb``, every capability dropped and, when the trainer is root, as ``nobody``: nothing
    outside the folder is writable, nothing but the system's programs and libraries and the
    interpreter is visible."""
    programs = {name: shutil.which(name) for name in ("unshare", "setpriv", "mount")}
    missing = [name for name, path in programs.items() if path is None]
    if missing:
        raise OSError(f"{' and '.join(missing)} (util-linux) not installed")
    namespaces = ["--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
    drop = [programs["setpriv"], "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    owner = ""
    if os.geteuid() == 0:
        drop += [f"--reuid={UNPRIVILEGED_ID}", f"--regid={UNPRIVILEGED_ID}", "--clear-groups"]
        owner = f",uid={UNPRIVILEGED_ID},gid={UNPRIVILEGED_ID}"
    else:  # an unprivileged user builds the root in a user namespace of its own, where it has the capabilities
        namespaces = ["--user", "--map-root-user", *namespaces]
    paths = [part for kind, path in _system_paths() for part in (kind, path)]
    return [programs["unshare"], *namespaces, "/bin/sh", "-c", _BUILD_ROOT, "sh", programs["mount"],
            programs["unshare"], fs, root, str(folder_mb), owner, *paths, "--", *drop, *command]


@functools.lru_cache(maxsize=1)
def os_isolation_problem() -> str | None:
    """Why OS isolation cannot run here (tried once per process), or None where it can: the check
    runs a child as the sandbox does and asks that /etc and /home be out of its sight and the
    interpreter's installation read-only."""
    if not sys.platform.startswith("linux"):
        return f"it needs Linux's namespaces, and this is {sys.platform}"
    try:
        root, fs = _make_folders()
    except OSError as error:
        return f"no temporary folder could be made ({error})"
    try:
        command = _os_isolation_command(root, fs, [sys.executable, "-I", "-c", _ISOLATION_CHECK], folder_mb=1)
        done = subprocess.run(command, env=_environment(root), stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=_PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"building the sandbox's own root took over {_PROBE_TIMEOUT:.0f} s"
    except OSError as error:
        return str(error)
    finally:
        _remove_folders(root, fs)
    if done.returncode != 0:
        said = " ".join((done.stderr or "").split())[-300:]
        return f"building the sandbox's own root failed ({said or f'exit status {done.returncode}'})"
    return None


_ISOLATION_CHECK = """
import errno, os, sys
try:
    os.close(os.open(os.path.join(sys.prefix, ".grpo_lab_check"), os.O_WRONLY | os.O_CREAT))
    raise SystemExit("the interpreter's installation is writable")
except OSError as error:
    if error.errno not in (errno.EROFS, errno.EACCES):
        raise
if os.path.exists("/etc") or os.path.exists("/home"):
    raise SystemExit("/etc or /home is in sight")
"""


def _make_folders() -> tuple[str, str]:
    """A new sandbox folder (handed to the user the child runs as: ``nobody`` when the trainer is
    root) and the folder its own root is mounted on."""
    root = os.path.realpath(tempfile.mkdtemp(prefix="grpo_lab_sandbox_"))
    try:
        fs = os.path.realpath(tempfile.mkdtemp(prefix="grpo_lab_sandbox_root_"))
        if os.geteuid() == 0:
            os.chown(root, UNPRIVILEGED_ID, UNPRIVILEGED_ID)
    except OSError:
        _remove(root)
        raise
    return root, fs


def _remove_folders(root: str, fs: str | None) -> None:
    _remove(root)
    if fs is not None:
        os.rmdir(fs)  # the tmpfs was mounted in the child's namespace alone: here it is an empty folder


def check_isolation(isolation: str, network_namespace: bool) -> None:
    """Refuse an isolation that is unknown or cannot run here, naming the setting that accepts less."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {', '.join(map(repr, ISOLATIONS))}, got {isolation!r}.")
    if isolation == "python":
        return
    if not network_namespace:
        raise ValueError("network_namespace=False takes the namespaces away, which isolation='os' is built on: "
                         "pass isolation='python' with it.")
    problem = os_isolation_problem()
    if problem is not None:
        raise OSError(
            f"The code sandbox cannot isolate the code by the operating system here: {problem}. It needs Linux where "
            "this user may make user namespaces (as root: mount namespaces), and unshare, setpriv and mount from "
            "util-linux. Run training where they are, or pass isolation='python' to accept the weaker guards "
            "(Python-level, which deliberately malicious code can undo; see grpo_lab.rewards.code_sandbox)."
        )


def folder_mb(max_file_mb: int) -> int:
    """The size of the sandbox folder under OS isolation: room for four files of the largest size."""
    return 4 * max_file_mb


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


def _read_result(output: bytes, nonce: str, count: int) -> list[bool] | None:
    """The per-test results in the judge's ``output`` (its one line prefixed by the nonce), or None."""
    prefix = nonce.encode() + b" "
    lines = [line[len(prefix):] for line in output.split(b"\n") if line.startswith(prefix)]
    if len(lines) != 1 or len(lines[0]) != count or lines[0].strip(b"01"):
        return None
    return [bit == ord("1") for bit in lines[0]]


def _read_available(stream) -> bytes:
    """What the judge wrote to its output pipe, without waiting: a process that kept the pipe's other
    end open (none should) must not hang the trainer."""
    os.set_blocking(stream.fileno(), False)
    try:
        return os.read(stream.fileno(), 1 << 20) or b""
    except (BlockingIOError, OSError):
        return b""
    finally:
        stream.close()


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


def _run_child(command: list[str], root: str, payload: bytes, timeout: float) -> tuple[bool, bytes]:
    """Start the child, give it its job (from a thread: a job larger than the pipe's buffer must not
    block past the deadline), wait; kill its process group in any case. Whether it exited within
    ``timeout``, and what the judge wrote on its output."""
    process = subprocess.Popen(command, cwd=root, env=_environment(root), stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
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
        output = _read_available(process.stdout)
    return exited, output


def run_in_sandbox(code: str, statements: list[tuple[str, bool]], *, timeout: float = 5.0, memory_mb: int = 512,
                   max_file_mb: int = 16, network_namespace: bool = True, isolation: str = "os") -> SandboxResult:
    """Run ``code``, then ``statements`` (from ``split_tests``), in a sandboxed child process (see
    the module docstring for what that does and does not protect against). Each statement runs on
    its own, so a failing test does not stop the others. Never raises for anything the code does;
    a run that ends without a valid result has ``passed=None``. ``isolation="os"`` (the default)
    refuses to run where the operating system cannot isolate the child; ``"python"`` runs it with
    the Python-level guards and the namespaces that work here, none with ``network_namespace=False``."""
    if os.name != "posix":
        raise OSError("the code sandbox needs a POSIX system (resource limits, process groups)")
    check_isolation(isolation, network_namespace)
    count = sum(is_test for _, is_test in statements)
    nonce = secrets.token_hex(16)
    job = _job(code, statements, nonce, _limits(timeout, memory_mb, max_file_mb))
    command = [sys.executable, "-I", "-B", "-c", _child_source()]
    if isolation == "os":
        root, fs = _make_folders()
        notes = ["os isolation", "network namespace", "pid namespace"]
    else:
        root, fs = os.path.realpath(tempfile.mkdtemp(prefix="grpo_lab_sandbox_")), None
        options = _namespace_options() if network_namespace else ()
        if options:
            command = [shutil.which("unshare") or "unshare", *options, *command]
        notes = (["network namespace"] if options else []) + (["pid namespace"] if "--pid" in options else [])
    start = time.monotonic()
    try:
        if fs is not None:
            command = _os_isolation_command(root, fs, command, folder_mb=folder_mb(max_file_mb))
        exited, output = _run_child(command, root, job, timeout)
        passed = _read_result(output, nonce, count) if exited else None
    finally:
        _remove_folders(root, fs)
    return SandboxResult(passed, timed_out=not exited, seconds=time.monotonic() - start, notes=notes)
