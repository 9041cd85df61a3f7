"""The program that ``code_sandbox`` runs in its child process, as ``python -I -B -c <this source>``
in a fresh temporary folder. Standard library only; grpo_lab never imports it.

It reads the first part of its job (JSON on stdin: the solution's code and the limits), leaves
the session keyring it was started with, makes itself undumpable (no process of its user may
read its memory or trace it), and splits in two (``fork``):

- **the solution's process** closes stdin and puts the null device in place of stdout (the
  judge's report), becomes dumpable again for its own sake, then, before any code of the job
  runs: sets its resource limits; makes process creation, networking, signals to other
  processes, raising those limits, writes outside its folder (and changes of the folder's own
  mode or owner) and reads of other processes' files in ``/proc`` raise ``PermissionError``; and
  refuses the imports of ``REFUSED_IMPORTS``. It runs the solution, sends the names it defined,
  and then only answers the judge's requests (``serve``): get an attribute, call, iterate...
- **the judge** (this process; the first of the PID namespace, when there is one) reads the
  rest of the job (the tests, the result's nonce and the judge's program,
  ``code_sandbox_judge.py``: the solution's process never holds them), sets the same limits and
  guards, runs each test statement against stand-ins of the solution's names, and writes one
  line, ``<nonce> <one 0/1 per test>``, to its stdout, a pipe to the trainer, then ends at once
  with ``os._exit``.

Between the two, only JSON (``to_wire``/``from_wire``): plain values, and handles of the
solution's other objects. The solution cannot give the tests an object of its own to compare, nor
reach the nonce or the verdict: the result it can bring about is its answers' being right.

The guards are Python-level: code that goes looking (the originals kept in these functions'
closures, C extensions) can get around them. See ``code_sandbox`` for what holds."""

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
    """No new process, no program replacing this one and no leaving the process group: os's fork,
    exec, spawn, system, popen and setsid/setpgid functions, and subprocess (through
    ``_posixsubprocess.fork_exec``, which multiprocessing uses too); ``refuse_imports`` stops the
    foreign-function interfaces, which could call fork directly."""
    import _posixsubprocess
    import posix

    names = ["fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "fexecve",
             "setsid", "setpgid", "setpgrp"]  # leaving the process group would outlive its kill
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


# How deep a value may nest on the wire (json's own limit is near 1,000).
MAX_DEPTH = 200


def to_wire(value, handle_of, depth: int = 0):
    """``value`` as JSON: None, bool, int, float and str as themselves, lists as lists, and the rest
    as one-key objects: ``{"tuple": [...]}``, ``{"namedtuple": [type name, fields, [...]]}`` (a
    named tuple or a struct sequence such as ``os.stat_result``), ``{"dict": [[key, value], ...]}``,
    ``{"set": [...]}``, ``{"frozenset": [...]}``, ``{"bytes": hex}``, ``{"bytearray": hex}``,
    ``{"complex": [re, im]}``; anything else ``{"object": handle_of(value)}``. Subclasses of the
    plain types (an IntEnum, a numpy float) go as their plain value, numpy values as their
    ``tolist()``."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply to send")
    kind = type(value)
    if kind.__module__ == "numpy" and hasattr(value, "tolist"):
        value = value.tolist()
    if value is None or isinstance(value, bool):
        return value if value is None else bool(value)
    for plain, convert in ((int, int.__index__), (float, float.__float__), (str, str.__str__)):
        if isinstance(value, plain):
            return convert(value)
    inner = depth + 1
    if isinstance(value, list):
        return [to_wire(item, handle_of, inner) for item in value]
    if isinstance(value, dict):
        return {"dict": [[to_wire(k, handle_of, inner), to_wire(v, handle_of, inner)] for k, v in value.items()]}
    fields = getattr(kind, "__match_args__", None)
    if isinstance(value, tuple) and isinstance(fields, tuple):
        items = [to_wire(item, handle_of, inner) for item in value]
        return {"namedtuple": [str(kind.__name__), [str(f) for f in fields], items]}
    for plain in (tuple, frozenset, set):
        if isinstance(value, plain):
            return {plain.__name__: [to_wire(item, handle_of, inner) for item in value]}
    for plain in (bytes, bytearray):
        if isinstance(value, plain):
            return {plain.__name__: bytes(value).hex()}
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    return {"object": handle_of(value)}


def from_wire(data, object_of, depth: int = 0):
    """The value ``to_wire`` sent, built of plain types only (``object_of(handle)`` for an object);
    ValueError for anything that is not of that format. Runs none of the sender's code."""
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    inner = depth + 1
    if kind is list:
        return [from_wire(item, object_of, inner) for item in data]
    if kind is not dict or len(data) != 1:
        raise ValueError("not a value of the sandbox's wire format")
    (tag, content), = data.items()
    items = content if type(content) is list else None
    if tag == "dict" and items is not None and all(type(pair) is list and len(pair) == 2 for pair in items):
        return {from_wire(k, object_of, inner): from_wire(v, object_of, inner) for k, v in items}
    builders = {"tuple": tuple, "set": set, "frozenset": frozenset}
    if tag in builders and items is not None:
        return builders[tag](from_wire(item, object_of, inner) for item in items)
    if tag in ("bytes", "bytearray") and type(content) is str:
        return (bytes if tag == "bytes" else bytearray).fromhex(content)
    if tag == "complex" and items is not None and len(items) == 2 and all(type(x) in (int, float) for x in items):
        return complex(*items)
    if tag == "object" and type(content) is int:
        return object_of(content)
    if tag == "namedtuple" and items is not None and len(items) == 3 and all(type(x) is list for x in items[1:]):
        name, fields, values = items
        return named_tuple_type(str(name), tuple(map(str, fields)), len(values))(
            *(from_wire(item, object_of, inner) for item in values))
    raise ValueError("not a value of the sandbox's wire format")


NAMED_TUPLE_TYPES = {}


def named_tuple_type(name: str, fields: tuple, length: int):
    """A named tuple type of this process's own with ``fields`` naming the first items (the rest,
    and any field name that is not an identifier, renamed ``_<index>``); one type per shape, so
    that results of one function share their type."""
    import collections

    key = (name, fields, length)
    if key not in NAMED_TUPLE_TYPES:
        names = (list(fields) + ["_"] * length)[:length]
        typename = name if name.isidentifier() else "named_tuple"
        NAMED_TUPLE_TYPES[key] = collections.namedtuple(typename, names, rename=True)
    return NAMED_TUPLE_TYPES[key]


class Objects:
    """The solution's objects the judge holds handles to; each keeps its handle (and stays alive,
    so that no other object takes its id) until the process ends."""

    def __init__(self):
        self._by_handle, self._handles = [], {}

    def handle_of(self, value) -> int:
        key = id(value)
        if key not in self._handles:
            self._handles[key] = len(self._by_handle)
            self._by_handle.append(value)
        return self._handles[key]

    def object_of(self, handle: int):
        if not 0 <= handle < len(self._by_handle):
            raise ValueError(f"no object has the handle {handle}")
        return self._by_handle[handle]

    def send(self, value):
        """``value`` on the wire; an object whose plain value cannot be sent (a list that holds
        itself) as a handle."""
        try:
            return to_wire(value, self.handle_of)
        except (ValueError, RecursionError):
            return {"object": self.handle_of(value)}


ANSWERS = {
    "getattr": lambda target, name: getattr(target, name),
    "setattr": lambda target, name, value: setattr(target, name, value),
    "delattr": lambda target, name: delattr(target, name),
    "getitem": lambda target, key: target[key],
    "setitem": lambda target, key, value: target.__setitem__(key, value),
    "delitem": lambda target, key: target.__delitem__(key),
    "len": len, "bool": bool, "iter": iter, "next": next, "repr": repr, "str": str,
}
"""What the judge may ask of one of the solution's objects (``call`` aside), by the request's name."""


def answer(request, objects: Objects) -> dict:
    """The reply to one request ``[operation, handle, *operands]``: ``{"value": ...}``, with
    ``"arguments"`` after a call (the state of each list, dict, set or bytearray argument)."""
    operation, handle, *operands = request
    target = objects.object_of(handle)
    if operation == "call":
        positional, named = operands
        args = [from_wire(a, objects.object_of) for a in positional]
        kwargs = {str(k): from_wire(v, objects.object_of) for k, v in named.items()}
        value = target(*args, **kwargs)
        changed = [objects.send(a) if isinstance(a, (list, dict, set, bytearray)) else None for a in args]
        return {"value": objects.send(value), "arguments": changed}
    names = [operands[0]] if operation in ("getattr", "setattr", "delattr") else []
    values = [from_wire(o, objects.object_of) for o in operands[len(names):]]
    return {"value": objects.send(ANSWERS[operation](target, *names, *values))}


def describe(error: BaseException) -> list:
    try:
        return [type(error).__name__, str(error)[:1000]]
    except BaseException:  # an exception whose str() raises
        return [type(error).__name__, ""]


def serve(code: str, requests_fd: int, replies_fd: int) -> None:
    """Run the solution as the module ``solution``, send its names, then answer requests until the
    judge closes its end."""
    import types

    run_code, compile_code, loads, dumps = builtins.exec, builtins.compile, json.loads, json.dumps
    requests = os.fdopen(requests_fd, "r", encoding="utf-8", newline="\n")
    replies = os.fdopen(replies_fd, "w", encoding="utf-8", newline="\n")
    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    try:
        run_code(compile_code(code, "<solution>", "exec"), module.__dict__)
    except BaseException:  # whatever the solution raises, its tests still run
        pass
    objects = Objects()
    names = {name: objects.send(value) for name, value in list(module.__dict__.items())
             if not (name.startswith("__") and name.endswith("__"))}
    replies.write(dumps({"names": names}) + "\n")
    replies.flush()
    for line in requests:
        try:
            reply = answer(loads(line), objects)
        except BaseException as error:  # the solution's exception, for the test to see
            reply = {"raised": describe(error)}
        try:
            text = dumps(reply)
        except (ValueError, RecursionError) as error:
            text = dumps({"raised": describe(error)})
        replies.write(text + "\n")
        replies.flush()


# The keyctl system call's number by machine (Linux's syscall tables); libc has no wrapper for it.
KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "i386": 288, "i686": 288, "armv7l": 311, "armv8l": 311,
          "ppc64le": 271, "ppc64": 271, "s390x": 280}
KEYCTL_JOIN_SESSION_KEYRING, PR_SET_DUMPABLE = 1, 4


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def leave_session_keyring_and_become_undumpable() -> None:
    """Join a new, empty session keyring: the keys the trainer's session holds (read by anyone
    holding that keyring, whatever the user) are out of reach; where the kernel refuses the call to
    this process (a seccomp filter), it refuses the solution's too. Then make this process
    undumpable: no process of its user may read its memory or its files in ``/proc``, or trace it.
    (ctypes is held in no frame the solution's code runs under.)"""
    import errno

    ctypes, libc = _libc()
    number = KEYCTL.get(os.uname().machine)
    if number is not None:  # a machine outside the table: said in code_sandbox's docstring
        if libc.syscall(ctypes.c_long(number), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None) < 0:
            code = ctypes.get_errno()
            if code not in (errno.ENOSYS, errno.EPERM, errno.EACCES):
                raise OSError(code, "the code sandbox could not leave the session keyring")
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "the code sandbox could not make its judge undumpable")


def become_dumpable() -> None:
    """The solution's process, split from the undumpable judge, reads its own ``/proc/self`` again."""
    ctypes, libc = _libc()
    if libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "the code sandbox could not set up the solution's process")


def guard(root: str, limits: dict) -> None:
    """The limits and Python-level guards, in the order that leaves each one able to be set."""
    limit(limits)
    block_processes()
    block_network()
    block_signals()
    refuse_imports()
    guard_files(root)


def read_exactly(fd: int, count: int) -> bytes:
    """``count`` bytes of ``fd`` and not one more (what follows is the judge's alone)."""
    parts, left = [], count
    while left > 0:
        part = os.read(fd, left)
        if not part:
            raise EOFError("the job ended early")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def read_line(fd: int) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            raise EOFError("the job ended early")
        line += byte
    return line


def main() -> None:
    launch_size, judge_size = (int(size) for size in read_line(0).split())
    launch = json.loads(read_exactly(0, launch_size))
    root = os.path.realpath(os.getcwd())
    # Before the split: the judge is never readable or traceable, not even between the fork and its first line.
    leave_session_keyring_and_become_undumpable()
    requests_read, requests_write = os.pipe()
    replies_read, replies_write = os.pipe()
    if os.fork() == 0:
        try:
            # stdin holds the judge's part of the job, stdout is the judge's report: neither is the solution's
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            for fd in (0, null, requests_write, replies_read):
                os.close(fd)
            become_dumpable()  # its own /proc/self, as any process has
            guard(root, launch["limits"])
            serve(launch["code"], requests_read, replies_write)
        finally:
            os._exit(0)
    write, leave, encode = os.write, os._exit, str.encode
    try:
        os.close(requests_read)
        os.close(replies_write)
        job = json.loads(read_exactly(0, judge_size))
        guard(root, launch["limits"])
        program = {"__name__": "code_sandbox_judge"}
        exec(compile(job["judge"], "code_sandbox_judge.py", "exec"), program)
        passed = program["judge"](job["statements"], requests_write, replies_read, to_wire, from_wire)
        if passed is not None:
            write(1, encode(job["nonce"] + " " + "".join("1" if ok else "0" for ok in passed) + "\n"))
    finally:
        leave(0)


if __name__ == "__main__":
    main()
