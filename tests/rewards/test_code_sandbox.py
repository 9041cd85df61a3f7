"""The sandbox's guards on files outside its folder (through ``_io``, file descriptors and C modules
that write by path), on other processes' environment, and on its own folder, which it removes even
after the code made it unwritable."""

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from grpo_lab.rewards import code_rewards as code_reward_module, code_sandbox, run_in_sandbox
from grpo_lab.rewards.code_sandbox import split_tests
from tests.rewards.conftest import ISOLATION_IDS, ISOLATION_OPTIONS

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guards read Linux's /proc")

REFUSED = textwrap.dedent("""
    import os
    def refused(call, *args):
        try:
            call(*args)
        except PermissionError:
            return True
        return False
""")

# Loads code_sandbox.py on its own (stdlib only, no grpo_lab package import) in a fresh process.
LOAD_SANDBOX = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("code_sandbox", {path!r})
sandbox = sys.modules["code_sandbox"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)
"""


def passed(code: str, tests: list[str], **options) -> list[bool] | None:
    return run_in_sandbox(code, split_tests(tests), **options).passed


@pytest.mark.parametrize("isolation", ISOLATION_OPTIONS, ids=ISOLATION_IDS)
def test_io_level_openers_cannot_write_outside(sandboxes, tmp_path, isolation):
    target = tmp_path / "escaped.txt"
    code = REFUSED + f"import _io, io\nTARGET = {str(target)!r}\n"
    tests = ["assert refused(_io.FileIO, TARGET, 'w')", "assert refused(_io.FileIO, TARGET, 'a')",
             "assert refused(_io.open, TARGET, 'w')", "assert refused(io.FileIO, TARGET, 'x')",
             "assert refused(_io.FileIO, TARGET, 'r+')",
             "_io.FileIO('inside.txt', 'w').write(b'x')"]  # its own folder: allowed
    assert passed(code, tests, **isolation) == [True] * len(tests)
    assert not target.exists()


def test_descriptor_calls_cannot_change_files_outside(sandboxes, tmp_path):
    """The Python-level guards on descriptors (under OS isolation the file is not even there)."""
    target = tmp_path / "outside.txt"
    target.write_text("keep")
    target.chmod(0o644)
    before = target.stat()
    code = REFUSED + textwrap.dedent(f"""
        fd = os.open({str(target)!r}, os.O_RDONLY)
        mine = os.open("mine.txt", os.O_CREAT | os.O_RDWR)
    """)
    tests = ["assert refused(os.fchmod, fd, 0o777)", "assert refused(os.chmod, fd, 0o777)",
             "assert refused(os.fchown, fd, -1, -1)", "assert refused(os.chown, fd, -1, -1)",
             "assert refused(os.utime, fd, (0, 0))", "assert refused(os.ftruncate, fd, 0)",
             "assert refused(os.truncate, fd, 0)", "assert refused(os.setxattr, fd, 'user.k', b'v')",
             "assert refused(os.removexattr, fd, 'user.k')", "assert refused(os.posix_fallocate, fd, 0, 8)",
             "assert refused(os.chmod, os.devnull, 0o666)",  # opened for writing, never changed
             "assert not refused(os.fchmod, mine, 0o600)", "assert not refused(os.ftruncate, mine, 4)",
             "assert not refused(os.utime, mine, (0, 0))", "assert os.stat('mine.txt').st_size == 4"]
    assert passed(code, tests, isolation="python") == [True] * len(tests)
    after = target.stat()
    assert (after.st_mode, after.st_mtime_ns, after.st_size) == (before.st_mode, before.st_mtime_ns, before.st_size)


def test_c_modules_that_write_by_path_cannot_be_imported(sandboxes, tmp_path):
    target = tmp_path / "escaped.db"
    code = textwrap.dedent(f"""
    import importlib
    def blocked(name):
        try:
            importlib.import_module(name)
        except ImportError:
            return True
        return False
    try:
        import sqlite3
        sqlite3.connect({str(target)!r}).execute("create table t (x)")
    except ImportError:
        pass
    """)
    names = ["sqlite3", "_sqlite3", "dbm", "dbm.dumb", "_dbm", "_gdbm", "readline", "ssl", "_ssl",
             "syslog", "_posixshmem", "_tkinter", "_xxsubinterpreters"]
    tests = [f"assert blocked({name!r})" for name in names] + ["import json, zlib, hashlib, multiprocessing"]
    assert passed(code, tests) == [True] * len(tests)
    assert not target.exists()


# Reads the environment and command line of its parent, its parent's parent and the process that
# started the sandbox (TRAINER_PID), every way the standard library opens a file.
READ_ENVIRONMENTS = """
import _io, os
MARK = b"GRPO_LAB_" + b"ENV_MARKER"
READERS = (lambda p: open(p, "rb").read(), lambda p: _io.FileIO(p).read(), lambda p: _io.open_code(p).read(),
           lambda p: os.read(os.open(p, os.O_RDONLY), 1 << 20))
def parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as file:
            return int(file.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0
def seen(pid):
    found = b""
    for name in ("environ", "cmdline", "task/" + str(pid) + "/environ"):
        for read in READERS:
            try:
                found += read(f"/proc/{pid}/{name}")
            except OSError:
                pass
    return found
TRAINER = TRAINER_PID
PIDS = {os.getppid(), parent_of(os.getppid()), TRAINER}
def own_environment():
    return open("/proc/self/environ", "rb").read()
"""

TRAINER = LOAD_SANDBOX + """
import json, os
code, statements, namespace, options = json.loads(sys.argv[1])
if options is not None:  # as where only these namespaces work
    sandbox._namespace_options = lambda: tuple(options)
code = code.replace("TRAINER_PID", str(os.getpid()))
isolation = "os" if namespace == "os" else "python"
result = sandbox.run_in_sandbox(code, [tuple(s) for s in statements], network_namespace=namespace is not False,
                                isolation=isolation)
print(json.dumps([result.passed, result.notes]))
"""


@pytest.mark.parametrize("namespace, options", [(False, None), (True, None), (True, ["--user", "--net"]), ("os", None)],
                         ids=["no namespace", "best namespaces", "network namespace only", "os isolation"])
def test_the_trainers_environment_cannot_be_read_through_proc(tmp_path, monkeypatch, namespace, options):
    if options and not code_sandbox.network_namespace_available():
        pytest.skip("unshare --user --net does not work here")
    # The trainer is a process started with the marker in its environment (and on its command line),
    # as a token is in the environment a training job starts with.
    monkeypatch.setenv("GRPO_LAB_TEST_TOKEN", "GRPO_LAB_" + "ENV_MARKER")
    statements = split_tests(["assert MARK not in b''.join(seen(pid) for pid in PIDS)",
                              "assert own_environment() is not None",  # its own: allowed
                              "assert not os.path.exists(f'/proc/{TRAINER}')"])  # only in a PID namespace
    job = json.dumps([READ_ENVIRONMENTS, statements, namespace, options])
    script = TRAINER.format(path=code_sandbox.__file__)
    done = subprocess.run([sys.executable, "-I", "-c", script, job, "GRPO_LAB_" + "ENV_MARKER"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    results, notes = json.loads(done.stdout)
    hidden = namespace == "os" or namespace and options is None and code_sandbox.pid_namespace_available()
    assert results == [True, True, hidden]
    assert ("pid namespace" in notes) == hidden and ("os isolation" in notes) == (namespace == "os")


@pytest.mark.parametrize("isolation", ISOLATION_OPTIONS, ids=ISOLATION_IDS)
def test_the_folder_itself_cannot_be_locked(sandboxes, isolation):
    code = REFUSED + textwrap.dedent("""
        for name in ("a", "b", "c"):
            open(name, "w").write("x")
        os.mkdir("sub")
        open("sub/d", "w").write("x")
        os.chmod("sub", 0)  # a subfolder may be locked: the sandbox unlocks it to remove it
    """)
    tests = ["assert refused(os.chmod, '.', 0)", "assert refused(os.chmod, os.getcwd(), 0o500)",
             "assert refused(os.fchmod, os.open('.', os.O_RDONLY), 0)", "assert refused(os.chmod, 'sub/..', 0)",
             "assert refused(os.chown, '.', os.getuid(), -1)", "open('e', 'w').write('x')"]
    assert passed(code, tests, **isolation) == [True] * len(tests)


REMOVE = LOAD_SANDBOX + """
sandbox._remove(sys.argv[1])
"""


def test_remove_deletes_a_folder_made_unreadable_and_unwritable(tmp_path):
    """As a user without root's capabilities (root itself runs it in a user namespace of its own,
    where it has none), since root may remove any folder whatever its mode."""
    prefix = []
    if os.geteuid() == 0:
        unshare = shutil.which("unshare")
        if unshare is None or subprocess.run([unshare, "--user", "true"], capture_output=True).returncode:
            pytest.skip("running as root, and no user namespace to drop root's capabilities in")
        prefix = [unshare, "--user"]
    folder = tmp_path / "sandbox"
    (folder / "sub").mkdir(parents=True)
    for name in ("a", "b", "sub/c"):
        (folder / name).write_text("x")
    (folder / "sub").chmod(0)
    folder.chmod(0)
    try:
        script = REMOVE.format(path=code_sandbox.__file__)
        done = subprocess.run([*prefix, sys.executable, "-I", "-c", script, str(folder)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert not folder.exists()
    finally:
        if folder.exists():
            folder.chmod(stat.S_IRWXU)
            (folder / "sub").chmod(stat.S_IRWXU)


def test_an_isolation_that_cannot_run_is_refused_with_the_setting_that_accepts_less(monkeypatch):
    with pytest.raises(ValueError, match=r"isolation must be one of 'os', 'python', got 'container'"):
        run_in_sandbox("x = 1", [], isolation="container")
    with pytest.raises(ValueError, match=r"network_namespace=False takes the namespaces away.*isolation='python'"):
        run_in_sandbox("x = 1", [], network_namespace=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # where util-linux's programs are not installed
    code_sandbox.os_isolation_problem.cache_clear()
    try:
        with pytest.raises(OSError, match=r"cannot isolate the code by the operating system here: unshare and setpriv "
                                          r"and mount \(util-linux\) not installed.*pass isolation='python'"):
            code_reward_module.code_reward()
    finally:
        code_sandbox.os_isolation_problem.cache_clear()
