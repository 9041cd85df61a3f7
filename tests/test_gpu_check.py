"""benchmarks/gpu_check.py, run small on the CPU, so that the one-command device check cannot rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_check_runs_every_check_on_a_cpu(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = report["checks"]
    assert list(checks) == ["environment", "speed_paths_fp32", "speed_paths_default", "lora", "loss_options",
                            "trainer", "evaluation", "trl", "vllm_colocate"]
    assert checks["environment"]["default_precision"] == "fp32" and checks["environment"]["model_parameters"] > 0
    assert checks["speed_paths_fp32"]["sampled_tokens_equal"] is True
    assert checks["speed_paths_fp32"]["logprob_max_abs_diff"] < 1e-3
    for check in ("speed_paths_default", "lora"):
        for path in ("fast", "plain"):
            timed = checks[check][path]
            assert len(timed["step_times_s"]) == 2 and timed["peak_memory_mib"] > 0
    assert checks["loss_options"]["status"] == "ok"
    assert checks["loss_options"]["kl_reused_batch_masks"]["kl"] is not None
    assert checks["trainer"]["checkpoints"] == ["checkpoint-2"] and checks["trainer"]["save_model"] is True
    evaluation = checks["evaluation"]
    assert evaluation["status"] == "ok" and evaluation["evaluations"] == 2
    assert evaluation["history_equal"] and evaluation["weights_max_abs_diff"] == 0.0  # a CPU run repeats exactly
    assert checks["trl"]["status"] == "ok" or checks["trl"]["skipped"] == "trl does not import here"
    assert checks["vllm_colocate"] == {"status": "skipped", "wall_s": checks["vllm_colocate"]["wall_s"],
                                       "skipped": "vLLM colocate is checked on a GPU "
                                                  "(the CPU build runs in its own environment)"}
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| speed_paths_fp32 | ok |" in table and "| lora | ok |" in table
