"""Golden runs (tests/golden): the same three training runs give the recorded history, bit for bit,
and the recorded final weights. They guard changes meant to leave behaviour alone."""

import json
import math

import pytest
import torch

from tests.golden import runs


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@pytest.mark.parametrize("name", runs.NAMES)
def test_golden_run_reproduces_its_record(name, tmp_path, request):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as recorded (a test worker's), also in a process with more
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    recorded = runs.recorded(name)
    if recorded is None:
        pytest.skip(f"recorded on {[record['machine'] for record in runs.records(name)]}, this machine is "
                    f"{runs.machine()}: floating-point results differ between these; record this machine's with "
                    "`python -m tests.golden.runs record` to compare here")
    result = json.loads(json.dumps(runs.run(name, str(tmp_path))))  # the record's own JSON round trip
    assert len(result["history"]) == len(recorded["history"])
    for step, (got, want) in enumerate(zip(result["history"], recorded["history"], strict=True), start=1):
        assert got.keys() == want.keys(), f"step {step}: columns differ"
        different = {k: (got[k], want[k]) for k in want if not _same(got[k], want[k])}
        assert different == {}, f"step {step} differs from the record: {different}"
    assert result["weights_sha256"] == recorded["weights_sha256"]
