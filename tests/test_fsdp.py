"""Training and checkpoints of a model sharded by FSDP: two CPU processes, accelerate's FSDP path with
the shipped config (see fsdp_on_cpu.py for how it runs without GPUs), torch's ``fully_shard``
sharding."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import launch_two

ROOT = Path(__file__).resolve().parents[1]


def _fsdp_command(*args) -> list[str]:
    return [*launch_two("--config_file", str(ROOT / "examples" / "accelerate_configs" / "fsdp.yaml")),
            str(ROOT / "tests" / "fsdp_on_cpu.py"), *map(str, args)]


def _launch(*args):
    done = subprocess.run(_fsdp_command(*args), cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)  # a collective missed hangs
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


def _weights(directory: Path) -> dict:
    (file,) = [f for f in ("model.safetensors", "adapter_model.safetensors") if (directory / f).exists()]
    return load_file(directory / file)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_an_fsdp_run_checkpoints_the_whole_model_and_a_resumed_run_finishes_identically(task, tmp_path, lora):
    flags = ["--lora"] if lora else []
    log = _launch("train", tmp_path / "whole", *flags)
    assert "compact forward pass cannot run this model" in log and "parameters are sharded (FSDP" in log
    whole = json.loads((tmp_path / "whole" / "result.json").read_text())
    assert whole["distributed_type"] == "DistributedType.FSDP" and whole["parameter_types"] == ["DTensor"]
    assert whole["reference_types"] == ([] if lora else ["DTensor"])  # the KL reference is sharded too
    assert whole["row"]["step"] == 4 and (tmp_path / "whole" / "checkpoint-2" / "COMPLETE").exists()
    if lora:  # beta 0: a first micro-batch zero on both processes skips its backward pass on both, or a
        # backward pass gathering shards on one process alone would hang the other
        losses = [json.loads((tmp_path / "whole" / f"losses-{rank}.json").read_text()) for rank in (0, 1)]
        for (skipped, zero), (other_skipped, other_zero) in zip(*losses, strict=True):
            assert skipped == other_skipped == int(zero[0] and other_zero[0])
        assert any(step[0] for step in losses[0])

    # every tensor whole (each process holds half of each), as the unsharded model has them
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(task.model).state_dict()
    saved = _weights(tmp_path / "whole" / "checkpoint-2" / "model")
    if lora:  # the adapter alone: rank 8 on the 128-wide query and value projections of 4 layers
        assert len(saved) == 16 and all(
            t.shape == ((8, 128) if ".lora_A." in name else (128, 8)) for name, t in saved.items()
        )
    else:
        assert {name: tuple(t.shape) for name, t in saved.items()} == {
            name: tuple(t.shape) for name, t in original.items() if name != "lm_head.weight"  # tied: saved once
        }
        assert "model.embed_tokens.weight" in saved and all(not torch.equal(saved[n], original[n]) for n in saved)

    # steps 3 and 4 from checkpoint-2: AdamW's moments as saved, or the final weights would differ
    _launch("train", tmp_path / "resumed", "--resume", tmp_path / "whole" / "checkpoint-2", *flags)
    resumed = json.loads((tmp_path / "resumed" / "result.json").read_text())
    drop = lambda row: {k: v for k, v in row.items() if k != "step_time"}  # noqa: E731
    assert drop(resumed["row"]) == drop(whole["row"])
    final, final_resumed = _weights(tmp_path / "whole" / "final"), _weights(tmp_path / "resumed" / "final")
    assert final.keys() == final_resumed.keys() == saved.keys()
    assert all(torch.equal(final[name], final_resumed[name]) for name in final)

    if not lora:  # FSDP trains as plain data parallel does, up to rounding (the gradient norm sums shards)
        _launch("train", tmp_path / "ddp", "--ddp")
        ddp = json.loads((tmp_path / "ddp" / "result.json").read_text())
        assert ddp["distributed_type"] == "DistributedType.MULTI_CPU" and ddp["parameter_types"] == ["Parameter"]
        assert ddp["reference_types"] == ["Parameter"]
        assert drop(ddp["row"]) == pytest.approx(drop(whole["row"]), rel=1e-4, abs=1e-6)
        final_ddp = _weights(tmp_path / "ddp" / "final")
        assert final.keys() == final_ddp.keys()  # a tied weight saved once, as without sharding
        assert all(torch.allclose(final[name], final_ddp[name], rtol=0, atol=1e-5) for name in final)
        # the reference, mixed towards the policy after every step, is checkpointed whole: every name
        # of its state dict, as without sharding
        ref, ref_ddp = (
            torch.load(tmp_path / run / "checkpoint-2" / "trainer_state.pt", weights_only=False)["ref_model"]
            for run in ("whole", "ddp")
        )
        assert {n: t.shape for n, t in ref.items()} == {n: t.shape for n, t in ref_ddp.items()}
        assert ref.keys() == original.keys()
        assert not torch.equal(ref["model.norm.weight"], original["model.norm.weight"])
        assert all(torch.allclose(ref[name], ref_ddp[name], rtol=0, atol=1e-5) for name in ref)

    # an FSDP checkpoint opens on one process: the optimizer state, saved by parameter name, lands on
    # each parameter
    from grpo_lab import GRPOSession

    checkpoint = tmp_path / "whole" / "checkpoint-2"
    by_name = torch.load(checkpoint / "trainer_state.pt", weights_only=False)["optimizer"]
    session = GRPOSession.load(checkpoint, reward_funcs=task.reward_funcs)
    names = {p: n for n, p in session.model.named_parameters()}
    loaded = session.engine.optimizer.optimizer.state
    assert len(loaded) == len(by_name["state"]) == (16 if lora else len(original) - 1)  # lm_head is tied
    for parameter, moments in loaded.items():
        assert torch.equal(moments["exp_avg"], by_name["state"][names[parameter]]["exp_avg"])
    if not lora:
        reference = session.engine.ref_model.state_dict()
        assert all(torch.equal(reference[name], tensor) for name, tensor in ref.items())


@pytest.mark.slow
def test_a_one_process_checkpoint_opens_under_fsdp_with_its_optimizer_state_cut_into_shards(make_session, tmp_path):
    session = make_session(per_device_train_batch_size=8, max_steps=4)
    session.step()
    session.step()
    session.save(tmp_path / "notebook")
    positional = session.engine.optimizer.state_dict()
    names = [n for n, _ in session.model.named_parameters()]

    _launch("optimizer", tmp_path / "notebook", tmp_path / "gathered.pt")
    gathered = torch.load(tmp_path / "gathered.pt", weights_only=False)
    assert len(gathered["state"]) == len(positional["state"]) > 0
    for index, moments in positional["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(gathered["state"][names[index]][key], moments[key])


@pytest.mark.slow
def test_a_float32_head_on_half_precision_weights_without_mixed_precision_is_refused_under_fsdp(untied_bf16, tmp_path):
    done = subprocess.run(_fsdp_command("fp32head", untied_bf16, tmp_path), cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("refused: cast_lm_head_to_fp32=True under FSDP without mixed precision, on "
                                  "torch.bfloat16 weights") and "bf16=True" in done.stdout
