"""The program that ``code_sandbox`` runs in its child process, as ``python -I -B -c <this source>``
in a fresh temporary folder. Standard library only; grpo_lab never imports it.

It reads its job (JSON) from stdin and opens its result file, then, before any code of the job
runs: sets its resource limits; makes process creation, networking, signals to other processes,
raising those limits, writes outside its folder (and changes of the folder's own mode or owner)
and reads of other processes' files in ``/proc`` raise ``PermissionError``; and refuses the
imports of ``REFUSED_IMPORTS``. It runs the solution, then each statement of the tests in turn in
the solution's namespace (a test that fails does not stop the others), and writes one line,
``<nonce> <one 0/1 per test>``, to the result file, then ends at once with ``os._exit`` (no exit
handler or thread of the solution runs after). The nonce comes only through stdin, so the solution
cannot write a result line by guessing it.

These replacements are Python-level: code that goes looking (the originals kept in these
functions' closures, C extensions) can get around them. See ``code_sandbox`` for what holds."""

import builtins
import io
import json
import operator
import os
import sys

WRITE_MODES = "wax+"


def refuse(what: str):
    def refused(*args, **kwargs):
        raise PermissionError(f"{what} is disabled in the sandbox")

    refused.__name__ = what.rpartition(".")[2]
    return refused


def limit(limits: dict) -> None:
    """Set each ``RLIMIT_*`` to its value (soft and hard); then refuse changing them again."""
    import resource

    for name, value in limits.items():
        kind = getattr(resource, name, None)
        if kind is not None:
            try:
                resource.setrlimit(kind, (value, value))
            except (ValueError, OSError):  # not supported here, or above a hard limit already lower
                pass
    resource.setrlimit = refuse("resource.setrlimit")
    if hasattr(resource, "prlimit"):
        resource.prlimit = refuse("resource.prlimit")


def block_processes() -> None:
    """No new process and no program replacing this one: os's fork, exec, spawn, system and
    popen functions, and subprocess (through ``_posixsubprocess.fork_exec``, which multiprocessing
    uses too); ``refuse_imports`` stops the foreign-function interfaces, which could call fork
    directly."""
    import _posixsubprocess
    import posix

    names = ["fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "fexecve"]
    names += [f"exec{s}" for s in ("l", "le", "lp", "lpe", "v", "ve", "vp", "vpe")]
    names += [f"spawn{s}" for s in ("l", "le", "lp", "lpe", "v", "ve", "vp", "vpe")]
    for name in names:
        for module in (os, posix):
            if hasattr(module, name):
                setattr(module, name, refuse(f"os.{name}"))
    _posixsubprocess.fork_exec = refuse("subprocess")
    if "subprocess" in sys.modules:
        sys.modules["subprocess"]._fork_exec = _posixsubprocess.fork_exec


# Modules whose import is refused: foreign-function interfaces (fork, write or undo the guards from
# C); C modules that write files by path themselves (databases, readline's history file, ssl's key
# log, POSIX shared memory, Tcl's file commands) or send to the system log; and subinterpreters,
# which import fresh, unguarded copies of os and io.
REFUSED_IMPORTS = ("ctypes", "_ctypes", "cffi", "_cffi_backend", "sqlite3", "_sqlite3", "dbm", "_dbm", "_gdbm",
                   "readline", "_ssl", "_posixshmem", "_tkinter", "syslog", "_xxsubinterpreters", "_testcapi",
                   "_testinternalcapi")


def refuse_imports() -> None:
    """Importing any of ``REFUSED_IMPORTS``, or a module that imports one (ssl; shelve when it opens
    a database), raises ImportError."""
    for name in REFUSED_IMPORTS:
        sys.modules[name] = None


def block_network() -> None:
    """Creating a socket raises (``socket.socket``, ``socketpair``, ``fromfd`` and the ``_socket``
    originals), so connect, bind and everything above them (http, asyncio) fail."""
    import _socket
    import socket

    class NoSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            raise PermissionError("network access is disabled in the sandbox")

    for module in (socket, _socket):
        module.socket = module.SocketType = NoSocket
        module.socketpair = refuse("socket.socketpair")
    socket.fromfd = refuse("socket.fromfd")


def block_signals() -> None:
    """Signals only to this process (and its own group): never to the trainer that started it."""
    import posix
    import signal

    own, index = os.getpid(), operator.index
    kill, killpg = posix.kill, posix.killpg

    def guarded_kill(pid, sig):
        pid = index(pid)
        if pid not in (own, 0):
            raise PermissionError("signals to other processes are disabled in the sandbox")
        return kill(pid, sig)

    def guarded_killpg(pgid, sig):
        pgid = index(pgid)
        if pgid not in (own, 0):
            raise PermissionError("signals to other processes are disabled in the sandbox")
        return killpg(pgid, sig)

    os.kill = posix.kill = guarded_kill
    os.killpg = posix.killpg = guarded_killpg
    if hasattr(signal, "pidfd_send_signal"):
        signal.pidfd_send_signal = refuse("signal.pidfd_send_signal")


def make_checks(root: str):
    """Two functions that return a path (str, bytes, path object) as a plain str, or a file
    descriptor as an int, to use in its place (so that a path object cannot name one file when
    checked and another when used), after raising PermissionError when it is refused:

    ``writable(path, what, opening=False, folder=True)``: where it resolves (symbolic links,
    ``..``; for a descriptor, the file it is open on, read from ``/proc/self/fd``) outside
    ``root``, or to ``root`` itself with ``folder=False``. With ``opening=True`` (open, os.open),
    descriptors pass as they are (one opened for reading cannot be written through) and so does
    the null device.

    ``readable(path, what)``: where its absolute or resolved form lies under ``/proc/<pid>/`` of
    another process (its environ, cmdline, memory, open files). Descriptors pass."""
    realpath, abspath, index, decode, sep = os.path.realpath, os.path.abspath, operator.index, os.fsdecode, os.sep
    inside, null, own = root + sep, os.devnull, str(os.getpid())

    def writable(path, what: str, opening: bool = False, folder: bool = True):
        if isinstance(path, int):
            if opening:
                return index(path)
            name = index(path)
            resolved = realpath(f"/proc/self/fd/{name}")
        else:
            name = decode(path)
            resolved = realpath(name)
        if resolved == root and not folder:
            raise PermissionError(f"{what}: changing the sandbox folder itself is refused: {name!r}")
        if resolved != root and not resolved.startswith(inside) and not (opening and resolved == null):
            raise PermissionError(f"{what}: writing outside the sandbox folder is refused: {name!r}")
        return name

    def readable(path, what: str):
        if isinstance(path, int):
            return index(path)
        name = decode(path)
        for full in (abspath(name), realpath(name)):
            parts = full.split(sep, 3)  # "", "proc", pid, rest
            if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != own:
                raise PermissionError(f"{what}: reading another process's files in /proc is refused: {name!r}")
        return name

    return writable, readable


def guard_path_writers(writable) -> None:
    """os functions that create, change or remove files take only paths inside the folder and
    descriptors of files inside it (for those that change a mode, owner or flags, not the folder
    itself: its owner could no longer remove it), and no ``dir_fd`` (a directory opened
    elsewhere)."""
    import posix

    paths_at = {"remove": (0,), "unlink": (0,), "rmdir": (0,), "mkdir": (0,), "chmod": (0,), "chown": (0,),
                "lchown": (0,), "lchmod": (0,), "truncate": (0,), "utime": (0,), "mkfifo": (0,), "mknod": (0,),
                "setxattr": (0,), "removexattr": (0,), "chflags": (0,), "lchflags": (0,), "rename": (0, 1),
                "replace": (0, 1), "link": (0, 1), "symlink": (1,), "fchmod": (0,), "fchown": (0,),
                "ftruncate": (0,), "posix_fallocate": (0,)}
    locking = {"chmod", "lchmod", "fchmod", "chown", "lchown", "fchown", "chflags", "lchflags"}
    for name, positions in paths_at.items():
        original = getattr(posix, name, None)
        if original is None:
            continue

        def guarded(*args, _name=name, _positions=positions, _original=original, _folder=name not in locking,
                    **kwargs):
            if any(kwargs.get(k) is not None for k in ("dir_fd", "src_dir_fd", "dst_dir_fd")):
                raise PermissionError(f"os.{_name} with a dir_fd is disabled in the sandbox")
            args = list(args)
            for position in _positions:
                if position < len(args):
                    args[position] = writable(args[position], f"os.{_name}", folder=_folder)
            for key in ("path", "src", "dst", "fd"):
                if key in kwargs:
                    kwargs[key] = writable(kwargs[key], f"os.{_name}", folder=_folder)
            return _original(*args, **kwargs)

        setattr(os, name, guarded)
        setattr(posix, name, guarded)


def guard_files(root: str) -> None:
    """Writes only inside ``root``, and no reads of other processes' files in ``/proc``: ``open``
    (builtins, io, _io; pathlib goes through io.open), ``io.FileIO`` and ``_io.FileIO``,
    ``io.open_code`` (imports read through it), ``os.open`` (never with a ``dir_fd``), and the os
    functions that change files by path or descriptor."""
    import _io
    import posix

    writable, readable = make_checks(root)
    real_open, real_os_open, real_open_code, index = _io.open, posix.open, _io.open_code, operator.index
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def checked(file, mode: str, what: str):
        if any(c in mode for c in WRITE_MODES):
            return writable(file, what, opening=True)
        return readable(file, what)

    def guarded_open(file, mode="r", *args, **kwargs):
        mode = str(mode)
        return real_open(checked(file, mode, "open"), mode, *args, **kwargs)

    def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
        flags = index(flags)
        if dir_fd is not None:
            raise PermissionError("os.open with a dir_fd is disabled in the sandbox")
        path = writable(path, "os.open", opening=True) if flags & writing else readable(path, "os.open")
        return real_os_open(path, flags, mode)

    def guarded_open_code(path):
        return real_open_code(readable(path, "io.open_code"))

    class GuardedFileIO(_io.FileIO):
        def __init__(self, file, mode="r", *args, **kwargs):
            mode = str(mode)
            super().__init__(checked(file, mode, "io.FileIO"), mode, *args, **kwargs)

    builtins.open = io.open = _io.open = guarded_open
    io.open_code = _io.open_code = guarded_open_code
    os.open = posix.open = guarded_os_open
    io.FileIO = _io.FileIO = GuardedFileIO
    guard_path_writers(writable)


def run(job: dict) -> list:
    """Run the solution, then each statement of the tests; True/False per test statement."""
    import types

    run_code, compile_code = builtins.exec, builtins.compile
    module = types.ModuleType("solution")  # tests may also `from solution import f`
    sys.modules["solution"] = module
    namespace = module.__dict__
    try:
        run_code(compile_code(job["code"], "<solution>", "exec"), namespace)
    except BaseException:  # whatever the solution raises, its tests still run
        pass
    passed = []
    for index, (source, is_test) in enumerate(job["statements"]):
        try:
            run_code(compile_code(source, f"<test {index}>", "exec"), namespace)
            ok = True
        except BaseException:  # SystemExit and KeyboardInterrupt fail the test too
            ok = False
        if is_test:
            passed.append(ok)
    return passed


def main() -> None:
    job = json.loads(sys.stdin.read())
    nonce = job.pop("nonce")
    write, leave, encode = os.write, os._exit, str.encode
    root = os.path.realpath(os.getcwd())
    result_fd = os.open(job["result"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    limit(job["limits"])
    block_processes()
    block_network()
    block_signals()
    refuse_imports()
    guard_files(root)
    try:
        passed = run(job)
        write(result_fd, encode(nonce + " " + "".join("1" if ok else "0" for ok in passed) + "\n"))
    finally:
        leave(0)


if __name__ == "__main__":
    main()
