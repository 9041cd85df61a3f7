"""Code written to get out of the sandbox, run under OS isolation by a trainer that is root and by
one that is an unprivileged user: it undoes the Python-level guards first (a fresh copy of the
built-in ``posix`` module holds the original functions, the socket guard's base classes the
original socket type, ctypes imported again), then tries to write outside its folder, read a
token in the trainer's home folder, another process's environment or a key in the trainer's
session keyring, reach the network and fork. Each must be stopped by the operating system. And
a wrong solution that goes looking for the result's nonce (in its frames and objects, in the
judge's memory, by tracing the judge, through the judge's report pipe) and writes result lines
must still score 0."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from grpo_lab.rewards import code_sandbox

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"),
                                                  reason="OS isolation is built on Linux's namespaces")]

MARK = "GRPO_LAB_" + "RED_TEAM_MARK"
KEY_NAME = b"grpo_lab_red_team"

UNGUARDED = """
import _imp, importlib.machinery
def fresh(name):  # a built-in module's own functions, not the guards that replace them
    return _imp.create_builtin(importlib.machinery.BuiltinImporter.find_spec(name))
import _socket
posix = fresh("posix")
raw_socket = next(kind for kind in _socket.socket.__mro__ if kind.__module__ == "_socket")
def stopped(attack):
    try:
        attack()
    except OSError:
        return True
    return False
def read(path):
    try:
        fd = posix.open(path, 0)
        return posix.read(fd, 1 << 20)
    except OSError:
        return b""
def fork():
    if posix.fork() == 0:
        posix._exit(0)
WRITE = 0o1 | 0o100  # O_WRONLY | O_CREAT
import sys
for name in ("ctypes", "_ctypes"):  # the import refusal undone
    sys.modules.pop(name, None)
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
KEYCTL = {"x86_64": 250, "aarch64": 219}[__import__("os").uname().machine]
def session_key(serial):
    found = libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(10), ctypes.c_long(-3), b"user", KEY_NAME, 0)  # search
    buffer = ctypes.create_string_buffer(256)
    libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(11), ctypes.c_long(serial), buffer, ctypes.c_long(256))  # read
    return found, buffer.raw
"""

ATTACKS = {
    # the control: the guard refuses to change the folder itself, the original function does not
    "the guards are undone": "assert not stopped(lambda: posix.chmod('.', 0o700))",
    "write outside its folder": "assert stopped(lambda: posix.write(posix.open(OUTSIDE, WRITE, 0o644), b'x'))",
    "write into a system folder": "assert stopped(lambda: posix.open(SYSTEM, WRITE, 0o644))",
    "write into the interpreter's folder": "assert stopped(lambda: posix.open(INTERPRETER, WRITE, 0o644))",
    "write into the virtual environment": "assert stopped(lambda: posix.open(ENVIRONMENT, WRITE, 0o644))",
    "fill the disk": "assert stopped(lambda: [posix.write(posix.open(f'fill{i}', WRITE, 0o600), bytes(15 << 20)) "
                     "for i in range(6)])",
    "put a FIFO in place of the result": "assert stopped(lambda: posix.unlink('result'))",
    "read a token in the trainer's home folder": "assert read(TOKEN) == b'' and stopped(lambda: posix.listdir(HOME))",
    "read another process's environment": "assert all(MARK.encode() not in read(f'/proc/{p}/environ') "
                                          "for p in posix.listdir('/proc') if p.isdigit())",
    "read the project and /etc": "assert read(PROJECT_FILE) == b'' and stopped(lambda: posix.listdir('/etc'))",
    "reach the network": "assert stopped(lambda: raw_socket().connect(('127.0.0.1', PORT)))",
    "fork": "assert stopped(fork)",
    "read a key in the trainer's session keyring": "found, read = session_key(KEY_SERIAL)\n"
                                                   "    assert found == -1 and MARK.encode() not in read",
}

# The trainer holds a key with the mark in a session keyring of its own (as a login's keyring may
# hold credentials), checks that it can read it, then runs the attacks.
TRAINER = """
import ctypes, importlib.util, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
KEYCTL, ADD_KEY = {"x86_64": (250, 248), "aarch64": (219, 217)}[os.uname().machine]
assert libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(1), None) > 0  # a session keyring of this run's own
mark = os.environ["GRPO_LAB_TEST_TOKEN"].encode()
serial = libc.syscall(ctypes.c_long(ADD_KEY), b"user", KEY_NAME, mark, ctypes.c_size_t(len(mark)), ctypes.c_long(-3))
buffer = ctypes.create_string_buffer(256)
libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(11), ctypes.c_long(serial), buffer, ctypes.c_long(256))
held = mark in buffer.raw
spec = importlib.util.spec_from_file_location("code_sandbox", sys.argv[1])
sandbox = sys.modules["code_sandbox"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)
code, tests, isolation = json.loads(sys.argv[2])
code = code.replace("KEY_SERIAL", str(serial))
result = sandbox.run_in_sandbox(code, sandbox.split_tests(tests), timeout=20, isolation=isolation)
correct = sandbox.run_in_sandbox("def add(a, b):\\n    return a + b", sandbox.split_tests(["assert add(1, 2) == 3"]))
print(json.dumps([result.passed, result.notes, correct.passed, held]))
""".replace("KEY_NAME", repr(KEY_NAME))


def _attack_as(prefix: list[str], python: str, folder: Path, isolation: str = "os", attacks: dict = ATTACKS) -> list:
    """Run the attacks in a sandbox started by ``python`` (behind ``prefix``), the trainer's
    environment holding the mark and its home folder a token; the attacks' results, its notes and
    whether a correct solution still passes."""
    home = folder / "home"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    token = home / ".cache" / "huggingface" / "token"
    token.write_text("hf_" + "R3dTeamT0ken" * 3)
    outside = folder / "escaped.txt"
    for path in (folder, home, home / ".cache", home / ".cache" / "huggingface"):
        path.chmod(0o755)
    token.chmod(0o644)  # readable by the trainer whatever its user
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        names = {"OUTSIDE": str(outside), "SYSTEM": "/usr/grpo_lab_escape", "TOKEN": str(token), "HOME": str(home),
                 "INTERPRETER": os.path.join(sys.base_prefix, "grpo_lab_escape"), "MARK": MARK,
                 "ENVIRONMENT": os.path.join(sys.prefix, "grpo_lab_escape"),
                 "PROJECT_FILE": str(Path(__file__).resolve()), "PORT": listener.getsockname()[1]}
        code = "".join(f"{name} = {value!r}\n" for name, value in {**names, "KEY_NAME": KEY_NAME}.items()) + UNGUARDED
        # Each attack a function of the solution's, for it runs in the solution's process; the tests call them.
        code += "".join(f"def attack_{i}():\n    {attack}\n" for i, attack in enumerate(attacks.values()))
        tests = [f"attack_{i}()" for i in range(len(attacks))]
        done = subprocess.run(
            [*prefix, python, "-I", "-c", TRAINER, code_sandbox.__file__, json.dumps([code, tests, isolation])],
            capture_output=True, text=True, timeout=120, cwd="/",
            env={"PATH": os.environ["PATH"], "HOME": str(home), "GRPO_LAB_TEST_TOKEN": MARK},
        )
        listener.settimeout(0.2)
        arrived = True
        try:
            listener.accept()[0].close()
        except socket.timeout:
            arrived = False
    assert done.returncode == 0, done.stderr[-3000:]
    written = [name for name in ("OUTSIDE", "SYSTEM", "INTERPRETER", "ENVIRONMENT") if os.path.exists(names[name])]
    for name in written:  # what an attack left (the control run without OS isolation)
        os.remove(names[name])
    passed, notes, correct, held = json.loads(done.stdout)
    assert held  # the trainer itself reads its key
    return [passed, notes, correct, written, arrived]


def _check(results) -> None:
    passed, notes, correct, written, arrived = results
    assert dict(zip(ATTACKS, passed)) == dict.fromkeys(ATTACKS, True)
    assert written == [] and not arrived and correct == [True]
    assert notes == ["os isolation", "network namespace", "pid namespace"]


def test_a_root_trainers_sandbox_stops_every_escape(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the trainer here is not root, and a test cannot become root")
    _check(_attack_as([], sys.executable, tmp_path))


def test_without_os_isolation_the_same_attacks_land(tmp_path):
    """The control: the Python-level guards alone (in the namespaces that work here) stop what the
    namespaces stop (the network, other processes' environment) and nothing of what needs the
    guards undone."""
    attacks = {name: attack for name, attack in ATTACKS.items() if "result" not in name}  # that one loses all
    passed, notes, correct, written, arrived = _attack_as([], sys.executable, tmp_path, "python", attacks)
    results = dict(zip(attacks, passed))
    assert results.pop("the guards are undone")  # the control holds here too
    landed = [name for name, stopped in results.items() if not stopped]
    assert {"write outside its folder", "read a token in the trainer's home folder", "read the project and /etc",
            "fill the disk"} <= set(landed), landed
    assert "OUTSIDE" in written and correct == [True]
    if os.geteuid() == 0:  # root's writes land anywhere, and RLIMIT_NPROC does not bind root
        assert {"write into a system folder", "fork"} <= set(landed) and "SYSTEM" in written


def test_an_unprivileged_trainers_sandbox_stops_every_escape(tmp_path):
    if os.geteuid() != 0:  # the trainer is an unprivileged user already
        _check(_attack_as([], sys.executable, tmp_path))
        return
    # Become nobody, with the interpreter's installation bound where nobody can reach it (it may lie in
    # root's home folder, as pyenv puts it) in a mount namespace of this run's own.
    # Its folders in the system's temporary folder, which other users can reach (pytest's are root's alone).
    folder = Path(tempfile.mkdtemp(prefix="grpo_lab_red_team_"))
    try:
        python_home = folder / "python"
        python_home.mkdir(mode=0o755)
        folder.chmod(0o755)
        executable = Path(os.path.realpath(sys.executable)).relative_to(sys.base_prefix)
        become_nobody = [shutil.which("unshare"), "--mount", "sh", "-c",
                         'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", sys.base_prefix, str(python_home),
                         shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups"]
        (folder / "trainer").mkdir()
        _check(_attack_as(become_nobody, str(python_home / executable), folder / "trainer"))
    finally:
        shutil.rmtree(folder)


# A wrong solution (its add returns an object equal to everything) that also goes looking for the
# result's nonce: every 32-hex-digit string its process holds (a planted one shows the search
# works), the judge's memory and environment in /proc, tracing the judge; it writes a result
# line for each string it found.
FORGER = UNGUARDED + """
import gc, re, secrets
PLANTED = secrets.token_hex(16)
def reachable_hex_strings():
    texts = []
    for thing in gc.get_objects():
        values = thing.values() if isinstance(thing, dict) else thing if isinstance(thing, (list, tuple)) else ()
        texts += [v.decode("latin-1") if isinstance(v, bytes) else v for v in values if isinstance(v, (str, bytes))]
    frame = sys._getframe()
    while frame is not None:
        texts += [v for v in frame.f_locals.values() if isinstance(v, str)]
        frame = frame.f_back
    return {found for text in texts for found in re.findall("[0-9a-f]{32}", text)}
FOUND = reachable_hex_strings()
JUDGE = __import__("os").getppid()
def denied(path):
    return read(path) == b""
MEMORY_DENIED = all(denied(f"/proc/{JUDGE}/{name}") for name in ("maps", "mem", "environ"))
MEMORY_DENIED = MEMORY_DENIED and not denied("/proc/self/maps")  # its own: readable
TRACE_DENIED = libc.ptrace(ctypes.c_long(16), ctypes.c_long(JUDGE), None, None) == -1  # PTRACE_ATTACH
if not TRACE_DENIED:
    libc.ptrace(ctypes.c_long(17), ctypes.c_long(JUDGE), None, None)  # PTRACE_DETACH
REPORT_DENIED = stopped(lambda: posix.open(f"/proc/{JUDGE}/fd/1", 0o1))  # the judge's report pipe, for writing
for nonce in FOUND:  # a result line for each: on its own stdout, and in a file named as the old result file
    for fd in (1, posix.open("result", 0o1 | 0o100 | 0o2000, 0o600)):  # O_WRONLY | O_CREAT | O_APPEND
        posix.write(fd, f"{nonce} 11111\\n".encode())
class Always:
    def __eq__(self, other):
        return True
def add(a, b):
    return Always()
def looked_everywhere():
    return PLANTED in FOUND and MEMORY_DENIED and TRACE_DENIED and REPORT_DENIED
"""


@pytest.mark.parametrize("isolation", ["os", "python"])
def test_a_wrong_solution_cannot_forge_its_result(sandboxes, isolation):
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4", "assert add(0, 5) == 5",
             "assert looked_everywhere()"]
    result = code_sandbox.run_in_sandbox(FORGER, code_sandbox.split_tests(tests),
                                         isolation=isolation)
    assert result.passed == [False, False, False, False, True] and result.score == 0.2
