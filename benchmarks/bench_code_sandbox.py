"""Time of one ``run_in_sandbox`` call (a correct one-line solution and one test) under each
isolation: the operating system's (mount, network and PID namespaces, a root of its own, every
capability dropped) and the Python-level guards in the namespaces that work here. The repetitions
alternate the two, so that both see the same machine.

    python benchmarks/bench_code_sandbox.py [--runs 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="sandbox runs per repetition and isolation")
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()

    from grpo_lab.rewards.code_sandbox import run_in_sandbox, split_tests

    statements = split_tests(["assert add(1, 2) == 3"])
    code = "def add(a, b):\n    return a + b"
    seconds: dict[str, list[float]] = {"os": [], "python": []}
    for _ in range(options.repeats):
        for isolation in seconds:
            start = time.perf_counter()
            for _ in range(options.runs):
                result = run_in_sandbox(code, statements, isolation=isolation)
                if result.passed != [True]:
                    raise SystemExit(f"the correct solution did not pass under isolation={isolation!r}: {result}")
            seconds[isolation].append((time.perf_counter() - start) / options.runs)
    medians = {isolation: statistics.median(values) for isolation, values in seconds.items()}
    print(json.dumps({"seconds_per_run": medians, "per_repeat": seconds,
                      "os_over_python": medians["os"] / medians["python"]}, indent=2))


if __name__ == "__main__":
    main()
