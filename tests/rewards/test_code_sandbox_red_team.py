"""Code written to get out of the sandbox, run under OS isolation by a trainer that is root and by
one that is an unprivileged user: it undoes the Python-level guards first (a fresh copy of the
built-in ``posix`` module holds the original functions, the socket guard's base classes the
original socket type), then tries to write
outside its folder, read a token in the trainer's home folder, read another process's
environment, reach the network and fork. Each must be stopped by the operating system."""

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
}

TRAINER = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("code_sandbox", sys.argv[1])
sandbox = sys.modules["code_sandbox"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)
code, tests, isolation = json.loads(sys.argv[2])
result = sandbox.run_in_sandbox(code, sandbox.split_tests(tests), timeout=20, isolation=isolation)
correct = sandbox.run_in_sandbox("def add(a, b):\\n    return a + b", sandbox.split_tests(["assert add(1, 2) == 3"]))
print(json.dumps([result.passed, result.notes, correct.passed]))
"""


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
        code = UNGUARDED + "".join(f"{name} = {value!r}\n" for name, value in names.items())
        done = subprocess.run(
            [*prefix, python, "-I", "-c", TRAINER, code_sandbox.__file__,
             json.dumps([code, list(attacks.values()), isolation])],
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
    passed, notes, correct = json.loads(done.stdout)
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
