"""Training and checkpoints of a model sharded by FSDP: two CPU processes, accelerate's FSDP path with
the shipped config (see sharded_on_cpu.py for how it runs without GPUs), torch's ``fully_shard``
sharding. Every run of the module is one launch (the ``fsdp_runs`` fixture), in the order the tests read them."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import launch_plan
from tests.test_generation_modes_resume import assert_sharded_processes_filled_alike

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fsdp_runs(task, untied_bf16, tmp_path_factory):
    """Every FSDP run of this module, in one launch: the full model (with a KL reference) and a LoRA adapter,
    each trained and resumed from its checkpoint-2, the full run as plain data parallel, a one-process save
    opened under FSDP, a run with dynamic sampling, and a refused float32 head. Returns the folder, the
    launch's log and the one-process session's optimizer state and parameter names."""
    from grpo_lab import GRPOSession
    from tests.conftest import SMALL

    folder = tmp_path_factory.mktemp("fsdp")
    session = GRPOSession(task.model, task.reward_funcs, train_dataset=task.train_dataset,
                          args=task.config(**{**SMALL, "output_dir": str(folder / "out"), "max_steps": 4}))
    session.step()
    session.step()
    session.save(folder / "notebook")
    positional = session.engine.optimizer.state_dict()
    names = [n for n, _ in session.model.named_parameters()]
    plan = [{"mode": "train", "out": folder / "whole"},
            {"mode": "train", "out": folder / "resumed", "resume": folder / "whole" / "checkpoint-2"},
            {"mode": "train", "out": folder / "ddp", "ddp": True},
            {"mode": "train", "out": folder / "lora" / "whole", "lora": True},
            {"mode": "train", "out": folder / "lora" / "resumed", "lora": True,
             "resume": folder / "lora" / "whole" / "checkpoint-2"},
            {"mode": "optimizer", "checkpoint": folder / "notebook", "out": folder / "gathered.pt"},
            {"mode": "train", "out": folder / "dynamic", "dynamic_sampling": True},
            {"mode": "fp32head", "model": untied_bf16, "out": folder / "fp32head"}]
    log = launch_plan("fsdp.yaml", plan, folder)
    return {"folder": folder, "log": log, "positional": positional, "names": names}


def _weights(directory: Path) -> dict:
    (file,) = [f for f in ("model.safetensors", "adapter_model.safetensors") if (directory / f).exists()]
    return load_file(directory / file)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_an_fsdp_run_checkpoints_the_whole_model_and_a_resumed_run_finishes_identically(task, fsdp_runs, lora):
    runs_dir = fsdp_runs["folder"] / ("lora" if lora else "")
    log = fsdp_runs["log"]
    assert "compact forward pass cannot run this model" in log and "parameters are sharded (FSDP" in log
    whole = json.loads((runs_dir / "whole" / "result.json").read_text())
    assert whole["distributed_type"] == "DistributedType.FSDP" and whole["parameter_types"] == ["DTensor"]
    assert whole["reference_types"] == ([] if lora else ["DTensor"])  # the KL reference is sharded too
    assert whole["row"]["step"] == 4 and (runs_dir / "whole" / "checkpoint-2" / "COMPLETE").exists()
    if lora:  # beta 0: a first micro-batch zero on both processes skips its backward pass on both, or a
        # backward pass gathering shards on one process alone would hang the other
        losses = [json.loads((runs_dir / "whole" / f"losses-{rank}.json").read_text()) for rank in (0, 1)]
        for (skipped, zero), (other_skipped, other_zero) in zip(*losses, strict=True):
            assert skipped == other_skipped == int(zero[0] and other_zero[0])
        assert any(step[0] for step in losses[0])

    # every tensor whole (each process holds half of each), as the unsharded model has them
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(task.model).state_dict()
    saved = _weights(runs_dir / "whole" / "checkpoint-2")
    if lora:  # the adapter alone: rank 8 on the 128-wide query and value projections of 4 layers
        assert len(saved) == 16 and all(
            t.shape == ((8, 128) if ".lora_A." in name else (128, 8)) for name, t in saved.items()
        )
    else:
        assert {name: tuple(t.shape) for name, t in saved.items()} == {
            name: tuple(t.shape) for name, t in original.items() if name != "lm_head.weight"  # tied: saved once
        }
        assert "model.embed_tokens.weight" in saved and all(not torch.equal(saved[n], original[n]) for n in saved)

    # steps 3 and 4 from checkpoint-2 (a new trainer, run after the whole one): AdamW's moments as saved, or
    # the final weights would differ
    resumed = json.loads((runs_dir / "resumed" / "result.json").read_text())
    drop = lambda row: {k: v for k, v in row.items() if k != "step_time"}  # noqa: E731
    assert drop(resumed["row"]) == drop(whole["row"])
    final, final_resumed = _weights(runs_dir / "whole" / "final"), _weights(runs_dir / "resumed" / "final")
    assert final.keys() == final_resumed.keys() == saved.keys()
    assert all(torch.equal(final[name], final_resumed[name]) for name in final)

    if not lora:  # FSDP trains as plain data parallel does, up to rounding (the gradient norm sums shards)
        ddp = json.loads((runs_dir / "ddp" / "result.json").read_text())
        assert ddp["distributed_type"] == "DistributedType.MULTI_CPU" and ddp["parameter_types"] == ["Parameter"]
        assert ddp["reference_types"] == ["Parameter"]
        assert drop(ddp["row"]) == pytest.approx(drop(whole["row"]), rel=1e-4, abs=1e-6)
        final_ddp = _weights(runs_dir / "ddp" / "final")
        assert final.keys() == final_ddp.keys()  # a tied weight saved once, as without sharding
        assert all(torch.allclose(final[name], final_ddp[name], rtol=0, atol=1e-5) for name in final)
        # the reference, mixed towards the policy after every step, is checkpointed whole: every name
        # of its state dict, as without sharding
        ref, ref_ddp = (
            torch.load(runs_dir / run / "checkpoint-2" / "trainer_state.pt", weights_only=False)["ref_model"]
            for run in ("whole", "ddp")
        )
        assert {n: t.shape for n, t in ref.items()} == {n: t.shape for n, t in ref_ddp.items()}
        assert ref.keys() == original.keys()
        assert not torch.equal(ref["model.norm.weight"], original["model.norm.weight"])
        assert all(torch.allclose(ref[name], ref_ddp[name], rtol=0, atol=1e-5) for name in ref)

    # an FSDP checkpoint opens on one process: the optimizer state, saved by parameter name, lands on
    # each parameter
    from grpo_lab import GRPOSession

    checkpoint = runs_dir / "whole" / "checkpoint-2"
    by_name = torch.load(checkpoint / "optimizer.pt", weights_only=True)
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
def test_a_one_process_checkpoint_opens_under_fsdp_with_its_optimizer_state_cut_into_shards(fsdp_runs):
    positional, names = fsdp_runs["positional"], fsdp_runs["names"]
    gathered = torch.load(fsdp_runs["folder"] / "gathered.pt", weights_only=False)
    assert len(gathered["state"]) == len(positional["state"]) > 0
    for index, moments in positional["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(gathered["state"][names[index]][key], moments[key])


@pytest.mark.slow
def test_a_float32_head_on_half_precision_weights_without_mixed_precision_is_refused_under_fsdp(fsdp_runs):
    refusal = (fsdp_runs["folder"] / "fp32head" / "refused.txt").read_text()
    assert refusal.startswith("refused: cast_lm_head_to_fp32=True under FSDP without mixed precision, on "
                              "torch.bfloat16 weights") and "bf16=True" in refusal


@pytest.mark.slow
def test_dynamic_sampling_under_fsdp_fills_every_process_alike(fsdp_runs):
    out = fsdp_runs["folder"] / "dynamic"
    assert json.loads((out / "result.json").read_text())["distributed_type"] == "DistributedType.FSDP"
    assert_sharded_processes_filled_alike(out)

