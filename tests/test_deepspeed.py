"""Training and checkpoints under DeepSpeed ZeRO-2 and ZeRO-3: two CPU processes, accelerate's DeepSpeed
path with the shipped configs (see sharded_on_cpu.py for how it runs without GPUs), DeepSpeed's own
engine and partitioning over gloo. The runs of each config are one launch (the ``zero2_runs`` and ``zero3_runs``
fixtures), in the order the tests read them."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import launch_plan
from tests.test_generation_modes_resume import assert_sharded_processes_filled_alike

pytest.importorskip("deepspeed")  # a dev dependency: its CPU accelerator runs these



def _result(out: Path) -> dict:
    return json.loads((out / "result.json").read_text())


def _row(out: Path) -> dict:
    return {k: v for k, v in _result(out)["row"].items() if k != "step_time"}


def _weights(directory: Path) -> dict:
    (file,) = [f for f in ("model.safetensors", "adapter_model.safetensors") if (directory / f).exists()]
    return load_file(directory / file)


@pytest.fixture(scope="module")
def zero2_runs(tmp_path_factory):
    """The ZeRO-2 runs, in one launch with the shipped ZeRO-2 config: fp32 and bf16, each trained and
    resumed from its checkpoint-2, a run with dynamic sampling, and the same run as plain data parallel
    (accelerate's own choice for a DeepSpeed launch on CPU). Returns the folder holding a folder per run."""
    folder = tmp_path_factory.mktemp("zero2")
    plan = [{"mode": "train", "out": folder / "fp32" / "whole"},
            {"mode": "train", "out": folder / "fp32" / "resumed", "resume": folder / "fp32" / "whole" / "checkpoint-2"},
            {"mode": "train", "out": folder / "bf16" / "whole", "bf16": True},
            {"mode": "train", "out": folder / "bf16" / "resumed", "bf16": True,
             "resume": folder / "bf16" / "whole" / "checkpoint-2"},
            {"mode": "train", "out": folder / "dynamic", "dynamic_sampling": True},
            {"mode": "train", "out": folder / "ddp", "ddp": True}]
    log = launch_plan("deepspeed_zero2.yaml", plan, folder, "--mixed_precision", "no")  # fp32 on CPU
    assert "asked for DeepSpeed, which shards the model over GPUs" in log  # said by the plain data parallel run
    assert _result(folder / "ddp")["distributed_type"] == "DistributedType.MULTI_CPU"
    return folder


@pytest.fixture(scope="module")
def zero3_runs(task, tmp_path_factory):
    """The ZeRO-3 runs, in one launch with the shipped ZeRO-3 config: fp32, and a bf16 LoRA adapter, each
    trained and resumed from its checkpoint-2, a run with dynamic sampling, and a one-process save opened
    under ZeRO-3. Returns the
    folder, and the one-process session's optimizer state and parameter names."""
    from grpo_lab import GRPOSession
    from tests.conftest import SMALL

    folder = tmp_path_factory.mktemp("zero3")
    session = GRPOSession(task.model, task.reward_funcs, train_dataset=task.train_dataset,
                          args=task.config(**{**SMALL, "output_dir": str(folder / "out"), "max_steps": 4}))
    session.step()
    session.step()
    session.save(folder / "notebook")
    plan = [{"mode": "train", "out": folder / "fp32" / "whole"},
            {"mode": "train", "out": folder / "fp32" / "resumed", "resume": folder / "fp32" / "whole" / "checkpoint-2"},
            {"mode": "train", "out": folder / "lora" / "whole", "lora": True, "bf16": True},
            {"mode": "train", "out": folder / "lora" / "resumed", "lora": True, "bf16": True,
             "resume": folder / "lora" / "whole" / "checkpoint-2"},
            {"mode": "train", "out": folder / "dynamic", "dynamic_sampling": True},
            {"mode": "optimizer", "checkpoint": folder / "notebook", "out": folder / "gathered.pt"}]
    launch_plan("deepspeed_zero3.yaml", plan, folder, "--mixed_precision", "no")
    return {"folder": folder, "positional": session.engine.optimizer.state_dict(),
            "names": [n for n, _ in session.model.named_parameters()]}


@pytest.mark.slow
@pytest.mark.parametrize("stage, precision", [(2, "fp32"), (3, "fp32"), (2, "bf16")],
                         ids=["zero2", "zero3", "zero2-bf16"])
def test_a_zero_run_checkpoints_the_whole_model_and_optimizer_state_and_a_resumed_run_finishes_bitwise(
        task, request, stage, precision):
    bf16 = precision == "bf16"  # DeepSpeed's mixed precision: 16-bit weights, fp32 master copy
    runs = request.getfixturevalue("zero2_runs" if stage == 2 else "zero3_runs")
    runs_dir = (runs if stage == 2 else runs["folder"]) / precision
    whole = _result(runs_dir / "whole")
    assert (whole["distributed_type"], whole["zero_stage"], whole["engine"]) == (
        "DistributedType.DEEPSPEED", stage, "DeepSpeedEngine")
    checkpoint = runs_dir / "whole" / "checkpoint-2"
    from grpo_lab.state.checkpoint import load_state

    names = {p.name for p in checkpoint.iterdir()}  # grpo_lab's files alone, none of DeepSpeed's
    assert {"trainer_state.pt", "optimizer.pt", "model.safetensors", "COMPLETE"} <= names
    assert not {n for n in names if n.startswith("global_step") or n in ("latest", "zero_to_fp32.py")}

    # every weight whole (under ZeRO-3 each process holds a part of each), trained, a tied weight once
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(task.model).state_dict()
    saved = _weights(checkpoint)
    assert {name: t.shape for name, t in saved.items()} == {
        name: t.shape for name, t in original.items() if name != "lm_head.weight"}
    assert {t.dtype for t in saved.values()} == {torch.bfloat16 if bf16 else torch.float32}
    # the optimizer state gathered from the partitions by parameter name, read without unpickling code
    state = load_state(checkpoint)
    masters = state["optimizer"].get("zero_master_weights")
    if bf16:  # the fp32 weights the optimizer steps, which the saved ones are rounded from
        assert masters.keys() == saved.keys() and all(t.dtype == torch.float32 for t in masters.values())
        assert all(torch.equal(masters[name].to(torch.bfloat16), saved[name]) for name in saved)
    else:
        assert masters is None
        masters = saved
    assert all(not torch.equal(masters[name], original[name]) for name in saved)  # every weight trained
    assert state["optimizer_by_name"] and sorted(state["optimizer"]["param_groups"][0]["params"]) == sorted(saved)
    moments = state["optimizer"]["state"]
    assert {name: m["exp_avg_sq"].shape for name, m in moments.items()} == {n: t.shape for n, t in saved.items()}
    assert all(float(m["step"]) == 2 and m["exp_avg"].abs().sum() > 0 for m in moments.values())
    reference = state["ref_model"]  # the TR-DPO reference, mixed towards the policy every step, whole
    assert reference.keys() == original.keys() and reference["model.norm.weight"].dtype == saved[
        "model.norm.weight"].dtype  # in the policy's dtype, as a resumed run builds it from the saved weights
    assert not torch.equal(reference["model.layers.0.mlp.up_proj.weight"].float(),
                           original["model.layers.0.mlp.up_proj.weight"])

    # steps 3 and 4 from checkpoint-2 (a new trainer, run after the whole one): AdamW's moments (and fp32
    # master weights) as saved, or the final weights would differ
    assert _row(runs_dir / "resumed") == _row(runs_dir / "whole")
    final, final_resumed = _weights(runs_dir / "whole" / "final"), _weights(runs_dir / "resumed" / "final")
    assert final.keys() == final_resumed.keys() == saved.keys()
    assert all(torch.equal(final[name], final_resumed[name]) for name in final)

    if not bf16:  # ZeRO trains as plain data parallel does, up to rounding (its norm and reductions sum partitions)
        ddp_run = request.getfixturevalue("zero2_runs") / "ddp"
        assert _row(runs_dir / "whole") == pytest.approx(_row(ddp_run), rel=1e-4, abs=1e-6)
        final_ddp = _weights(ddp_run / "final")
        assert all(torch.allclose(final[name], final_ddp[name], rtol=0, atol=1e-5) for name in final)

    # save_model() wrote full weights that a plain model loads
    plain = AutoModelForCausalLM.from_pretrained(runs_dir / "whole" / "final").state_dict()
    assert all(torch.equal(plain[name].to(final[name].dtype), final[name]) for name in final)
    assert torch.equal(plain["lm_head.weight"].to(final["model.embed_tokens.weight"].dtype),
                       final["model.embed_tokens.weight"])

    # a ZeRO checkpoint opens on one process: the optimizer state lands on each parameter by name (in the
    # parameter's dtype, as torch keeps it; DeepSpeed's fp32 master weights are ZeRO's alone)
    from grpo_lab import GRPOSession

    session = GRPOSession.load(checkpoint, reward_funcs=task.reward_funcs)
    names = {p: n for n, p in session.model.named_parameters()}
    loaded = session.engine.optimizer.optimizer.state
    assert len(loaded) == len(moments)
    for parameter, kept in loaded.items():
        assert torch.equal(kept["exp_avg"], moments[names[parameter]]["exp_avg"].to(parameter.dtype))


@pytest.mark.slow
def test_a_zero_3_bf16_lora_run_checkpoints_the_adapter_alone_and_a_resumed_run_finishes_bitwise(zero3_runs):
    runs_dir = zero3_runs["folder"] / "lora"
    saved = _weights(runs_dir / "whole" / "checkpoint-2")
    assert len(saved) == 16 and all(  # rank 8 on the 128-wide query and value projections of 4 layers
        t.shape == ((8, 128) if ".lora_A." in name else (128, 8)) for name, t in saved.items())
    assert all(t.abs().sum() > 0 for name, t in saved.items() if ".lora_B." in name)  # trained from zeros
    # PEFT keeps an adapter over bf16 weights in fp32, which DeepSpeed leaves as it is: no master copy to keep
    from grpo_lab.state.checkpoint import load_state

    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert "zero_master_weights" not in load_state(runs_dir / "whole" / "checkpoint-2")["optimizer"]
    assert _row(runs_dir / "resumed") == _row(runs_dir / "whole")
    final, final_resumed = _weights(runs_dir / "whole" / "final"), _weights(runs_dir / "resumed" / "final")
    assert final.keys() == saved.keys() and all(torch.equal(final[n], final_resumed[n]) for n in final)


@pytest.mark.slow
def test_a_one_process_checkpoint_opens_under_zero_3_with_its_optimizer_state_cut_into_partitions(zero3_runs):
    positional, names = zero3_runs["positional"], zero3_runs["names"]
    gathered = torch.load(zero3_runs["folder"] / "gathered.pt", weights_only=True)
    assert len(gathered["state"]) == len(positional["state"]) > 0
    for index, moments in positional["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(gathered["state"][names[index]][key], moments[key])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_dynamic_sampling_under_zero_fills_every_process_alike(request, stage):
    runs = request.getfixturevalue("zero2_runs" if stage == 2 else "zero3_runs")
    out = (runs if stage == 2 else runs["folder"]) / "dynamic"
    result = json.loads((out / "result.json").read_text())
    assert (result["distributed_type"], result["zero_stage"]) == ("DistributedType.DEEPSPEED", stage)
    assert_sharded_processes_filled_alike(out)

