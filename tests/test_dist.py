"""The accelerate glue: what a launch on a machine without a GPU becomes, said out loud."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from grpo_lab.dist import check_savable

BUILD = "from grpo_lab.dist import make_accelerator; print(make_accelerator('fp32', use_cpu=True).distributed_type)"


def test_an_fsdp_launch_on_cpu_warns_that_it_runs_unsharded():
    env = {key: value for key, value in os.environ.items() if not key.startswith("ACCELERATE_USE_")}
    fsdp = subprocess.run([sys.executable, "-c", BUILD], env={**env, "ACCELERATE_USE_FSDP": "true"},
                          capture_output=True, text=True, check=True)
    assert "accelerate launch asked for FSDP, which shards the model over GPUs" in fsdp.stderr
    assert fsdp.stdout.strip() == "DistributedType.NO"  # one process here; MULTI_CPU under a 2-process launch
    plain = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, check=True)
    assert "shards the model" not in plain.stderr


def test_a_deepspeed_zero_run_is_refused_up_front_as_its_checkpoints_would_hold_one_process_part():
    # deepspeed is not installed here: a stand-in for the accelerator a DeepSpeed launch builds
    def launched(stage):
        return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                               state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage)))

    for stage in (1, 2, 3):
        with pytest.raises(NotImplementedError, match="cannot yet write checkpoints under DeepSpeed ZeRO.*FSDP"):
            check_savable(launched(stage))
    check_savable(launched(0))  # stage 0 partitions nothing
    check_savable(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU))


def test_an_fsdp_1_run_is_refused_up_front_as_only_fsdp_2_shards_are_gathered():
    with pytest.raises(NotImplementedError, match="FSDP 2 only.*fsdp_version: 2"):
        check_savable(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False))
    check_savable(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True))
