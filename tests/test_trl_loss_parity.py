"""grpo_lab's loss stage against TRL 1.16's ``_compute_loss`` on identical tensors: the loss, the
gradients and every metric both log, for every loss type x importance-sampling level, with beta
(and its bias correction), delta, epsilon_high, top_entropy_quantile, mask_truncated_completions,
the entropy bonus, off-policy masking, the four vLLM correction modes, one and two micro-batches
(:mod:`tests.trl_loss_parity`), and on two processes."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from accelerate import Accelerator

from tests.conftest import launch_two
from tests.trl_loss_parity import LOSS_TYPES, compare, settings

pytest.importorskip("trl")  # a test-only dependency: the reference implementation


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_gradients_and_metrics_equal_trl_on_one_process(loss_type):
    accelerator = Accelerator(cpu=True)
    cases = [case for case in settings() if case[0] == loss_type]
    assert len(cases) >= 20  # both levels, one and two micro-batches, the options this loss type accepts
    found = {str(case): problems for case in cases if (problems := compare(*case, accelerator, seed=7))}
    assert found == {}


@pytest.mark.slow
def test_loss_gradients_and_metrics_equal_trl_on_each_of_two_processes(tmp_path):
    root = Path(__file__).resolve().parents[1]
    launch = launch_two("--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no")
    done = subprocess.run([*launch, str(root / "tests" / "trl_loss_parity.py"), str(tmp_path / "report")],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"report-{rank}.json").read_text()) == {}
