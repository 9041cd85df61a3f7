"""Where the suite's time goes: each test's wall time (setup, call and teardown) and the kind of work
that dominates it, told from what the test started.

    pytest --timing-report timing.json      # also prints the table by kind at the end

The kinds, from the most expensive start-up down (a test counts once, under the first that applies):

- ``vllm``: marked ``vllm`` (a vLLM engine or server starts);
- ``browser``: it started JupyterLab or Chromium, or uses the fixture that did;
- ``kernel``: it started a Jupyter kernel (a notebook executed by nbclient, a kernel restart);
- ``multi-process``: it started an ``accelerate launch`` or ``torchrun`` of several processes;
- ``subprocess``: it started another Python interpreter (a script, the CLI, an exported run);
- ``engine``: in-process, and it built a trainer core (``grpo_lab.core.engine.Engine``) or more;
- ``no model``: in-process, no engine built (tensors, configs, parsing, hand-derived numbers).

CPU seconds count the test's own process and the processes it started and waited for (not a kernel
that a shared JupyterLab server started). Works with and without ``pytest-xdist``: a worker records
what each test started in the report's ``user_properties``, which the controller reads.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

KINDS = ("vllm", "browser", "kernel", "multi-process", "subprocess", "engine", "no model")

_started: list[str] = []  # what the running test started: one word per process, see _process_kind
_engines = [0]  # engines built by the running test
_cpu_at_start = [0.0]  # CPU seconds of this process and its ended children when the running test started


def _cpu_seconds() -> float:
    """CPU time of this process and of the children it has waited for (user and system)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _process_kind(args) -> str:
    words = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    text = " ".join(words)
    if "jupyter" in text and " lab" in f" {text}" or "chrom" in os.path.basename(words[0]) or "playwright" in text:
        return "browser"
    if "ipykernel" in text:
        return "kernel"
    if "accelerate.commands.launch" in text or "torchrun" in text or "torch.distributed.run" in text:
        return "multi-process"
    return "subprocess" if "python" in os.path.basename(words[0]) or words[0].endswith(".py") else "other"


def _install_recorders() -> None:
    """Wrap ``subprocess.Popen`` (which asyncio, nbclient's kernel manager and Playwright also use) and
    ``Engine.__init__`` to note, per test, what it starts and builds."""
    original_init = subprocess.Popen.__init__

    def recording_init(self, args, *rest, **kwargs):
        _started.append(_process_kind(args))
        original_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = recording_init

    from grpo_lab.core.engine import Engine

    original_engine = Engine.__init__

    def counting_engine(self, *args, **kwargs):
        _engines[0] += 1
        original_engine(self, *args, **kwargs)

    Engine.__init__ = counting_engine


SHARED_FIXTURE_KINDS = {"jupyter": "browser", "chromium": "browser", "fsdp_runs": "multi-process",
                        "zero2_runs": "multi-process", "zero3_runs": "multi-process"}
"""Fixtures that start processes once for several tests: a test using one counts as that kind."""


def test_kind(marked_vllm: bool, started: list[str], engines: int, fixtures=()) -> str:
    if marked_vllm:
        return "vllm"
    started = [*started, *(SHARED_FIXTURE_KINDS[name] for name in fixtures if name in SHARED_FIXTURE_KINDS)]
    for kind in ("browser", "kernel", "multi-process", "subprocess"):
        if kind in started:
            return kind
    return "engine" if engines else "no model"


def pytest_addoption(parser) -> None:
    parser.addoption("--timing-report", metavar="PATH", default=None,
                     help="write each test's wall time and kind of work as JSON to PATH, and print time by kind")


_recording = [False]
_tests: dict[str, dict] = defaultdict(lambda: {"seconds": 0.0, "cpu_seconds": 0.0, "kind": None})


def pytest_configure(config) -> None:
    xdist_controller = bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")
    if config.getoption("--timing-report") and not xdist_controller:  # where tests run
        _install_recorders()
        _recording[0] = True


def pytest_runtest_setup(item) -> None:
    _started.clear()
    _engines[0] = 0
    _cpu_at_start[0] = _cpu_seconds()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item, call) -> None:
    if call.when == "teardown" and _recording[0]:  # before the report is made, which copies user_properties
        item.user_properties.append(("timing_kind", test_kind(item.get_closest_marker("vllm") is not None,
                                                              list(_started), _engines[0], item.fixturenames)))
        item.user_properties.append(("cpu_seconds", _cpu_seconds() - _cpu_at_start[0]))


def pytest_runtest_logreport(report) -> None:
    entry = _tests[report.nodeid]
    entry["seconds"] += report.duration
    for name, value in report.user_properties:
        if name == "timing_kind":
            entry["kind"] = value
        elif name == "cpu_seconds":
            entry["cpu_seconds"] = value


def pytest_terminal_summary(terminalreporter, config) -> None:
    path = config.getoption("--timing-report")
    if not path:
        return
    tests = {nodeid: dict(entry) for nodeid, entry in _tests.items()}
    Path(path).write_text(json.dumps(tests, indent=1) + "\n")
    terminalreporter.write_sep("=", "time by kind of work (--timing-report)")
    for line in kind_table(tests):
        terminalreporter.write_line(line)


def kind_table(tests: dict[str, dict]) -> list[str]:
    """Markdown rows: kind, tests, wall seconds and their share, CPU seconds (the test's process and the
    processes it started and waited for) and their share."""
    seconds, cpu, counts = defaultdict(float), defaultdict(float), defaultdict(int)
    for entry in tests.values():
        seconds[entry["kind"]] += entry["seconds"]
        cpu[entry["kind"]] += entry.get("cpu_seconds", 0.0)
        counts[entry["kind"]] += 1
    total, total_cpu = sum(seconds.values()) or 1.0, sum(cpu.values()) or 1.0
    rows = ["| kind | tests | wall s | share | CPU s | share |", "|---|---|---|---|---|---|"]
    for kind in [*KINDS, *sorted({k for k in seconds if k not in KINDS}, key=str)]:
        if counts[kind]:
            rows.append(f"| {kind} | {counts[kind]} | {seconds[kind]:.0f} | {seconds[kind] / total:.0%} "
                        f"| {cpu[kind]:.0f} | {cpu[kind] / total_cpu:.0%} |")
    rows.append(f"| all | {sum(counts.values())} | {total:.0f} | 100% | {total_cpu:.0f} | 100% |")
    return rows
