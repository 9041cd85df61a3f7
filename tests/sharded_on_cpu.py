"""GRPOTrainer runs under accelerate's FSDP and DeepSpeed ZeRO paths on CPU processes, several runs in
one launch, for test_fsdp.py, test_deepspeed.py and test_tools.py.

Launch it with a shipped config and a plan, a JSON list of runs done in order in the same processes
(the launch's start-up, most of what a short run costs, is paid once):

    accelerate launch --config_file examples/accelerate_configs/fsdp.yaml --num_processes 2 \
        tests/sharded_on_cpu.py PLAN.json

accelerate treats FSDP and DeepSpeed as GPU features: on a machine without one it runs such a launch
as plain data parallel. torch's FSDP 2 (``fully_shard``) and DeepSpeed (its CPU accelerator) run on
CPU over gloo, so this script lets accelerate take those paths anyway: grpo_lab's Accelerator is built
with the launch's settings (``FSDP_*`` or ``ACCELERATE_DEEPSPEED_*`` variables from the config) and its
state marked FSDP or DEEPSPEED, so that ``prepare`` shards the model (or builds DeepSpeed's engine) as
on GPUs. Everything after that is grpo_lab's own code. Between two runs accelerate's state is built
anew and the process group kept; each run builds its trainers as a script of its own would.

Runs (``out`` a folder; the main process writes ``out/result.json``):
    {"mode": "train", "out": OUT, "resume": CHECKPOINT or null, "lora": false, "bf16": false, "ddp": false}
        a save before training (not when resuming), then 4 steps of 2 accumulated micro-batches, a
        checkpoint every 2, then ``save_model(OUT/final)``; each process also writes
        OUT/losses-RANK.json (its skipped backward passes, its all-zero micro-batches). The full model
        trains with a KL term against a reference mixed towards it every step (TR-DPO); "lora" trains
        a rank-8 adapter instead (beta 0); "bf16" turns on DeepSpeed's bf16 (16-bit weights, fp32
        master weights in the optimizer); "ddp" leaves accelerate's own choice on CPU, plain data
        parallel; "dynamic_sampling" turns it on (at temperature 2, rewarded by
        ``test_dynamic_sampling.parity_reward``), and each process writes OUT/batches-RANK.json (per step:
        its number of completions, rounds drawn, group numbers and answers)
    {"mode": "optimizer", "checkpoint": CHECKPOINT, "out": FILE}
        load CHECKPOINT and write the optimizer state gathered from the shards or partitions, keyed by
        parameter name, to FILE (torch.save)
    {"mode": "fp32head", "model": MODEL, "out": OUT}
        build a session on MODEL (bfloat16 weights) with cast_lm_head_to_fp32=True and no mixed
        precision; the main process writes the error to OUT/refused.txt
    {"mode": "tools", "model": MODEL, "out": OUT}
        2 steps with tools=[add] on MODEL (a model that calls it, see test_tools.py) whose result leaves
        no room for an answer on process 1 only, so only process 0 samples a second turn; each process
        writes OUT/tools-RANK.json (its tool calls and tool-inserted tokens per step)
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin

import grpo_lab.parallel.dist

PLAIN_ACCELERATOR = grpo_lab.parallel.dist.make_accelerator


def fsdp_accelerator(precision: str, *, use_cpu: bool = False) -> Accelerator:
    """Stands in for ``grpo_lab.parallel.dist.make_accelerator`` (same signature); the runs here are fp32 on CPU."""
    plugin = FullyShardedDataParallelPlugin()  # the launch's FSDP_* settings
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)  # which a CPU state does not keep
    accelerator.state.fsdp_plugin = plugin
    # AcceleratorState copies PartialState's type whenever it is built again: mark both
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    return accelerator


def deepspeed_accelerator(precision: str, *, use_cpu: bool = False) -> Accelerator:
    """Stands in for ``grpo_lab.parallel.dist.make_accelerator`` (same signature), giving ``precision`` to
    DeepSpeed's config as accelerate does on GPUs."""
    if AcceleratorState._shared_state and AcceleratorState().deepspeed_plugins is not None:
        return Accelerator(cpu=True)  # a second one (a resumed run's session) takes the first one's plugin
    plugin = DeepSpeedPlugin()  # the launch's ACCELERATE_DEEPSPEED_* settings
    # DeepSpeed's mixed precision is its engine's (16-bit weights, fp32 master copy), never autocast
    accelerator = Accelerator(mixed_precision="no", cpu=True, deepspeed_plugin=plugin)  # a CPU state drops the plugin
    state = accelerator.state
    # AcceleratorState copies PartialState's type whenever it is built again: mark both
    state.distributed_type = PartialState().distributed_type = DistributedType.DEEPSPEED
    plugin.set_mixed_precision({"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[precision])
    plugin.select(_from_accelerator_state=True)
    state.deepspeed_plugins = plugin
    return accelerator


def without_shared_memory_collectives() -> None:
    """DeepSpeed's CPU accelerator compiles a shared-memory all-reduce kernel with the system's C++
    compiler when its process group starts in an environment that has not built it yet (every fresh
    clone: ~50 s of CPU on a 2-core machine), after probing every optional op with compiler runs; on
    GPUs neither happens (NCCL does the collectives). Marking no op as buildable skips both, and
    DeepSpeed's collectives go through gloo like the rest of these runs'."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {}  # read as .get(name, False) when the process group starts


def launch_accelerator():
    """The stand-in for the launch's config: FSDP or DeepSpeed."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        without_shared_memory_collectives()
        return deepspeed_accelerator
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return fsdp_accelerator
    raise SystemExit("launch this script with an FSDP or DeepSpeed config (examples/accelerate_configs)")


def release(trainer, *, last: bool) -> None:
    """What ``GRPOTrainer.close`` does; the process group ends after the last run only."""
    if not last:
        trainer.accelerator.end_training = lambda: None
    trainer.close()


def train(task, run: dict, last: bool) -> None:
    from grpo_lab import GRPOConfig, GRPOTrainer

    out = run["out"]
    reference = dict(beta=0.1, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    peft_config = None
    if run.get("lora"):
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        reference = {}
    reward_funcs, sampling = task.reward_funcs, {}
    if run.get("dynamic_sampling"):
        from tests.test_dynamic_sampling import SPREAD, parity_reward

        reward_funcs, sampling = [parity_reward], SPREAD
    config = GRPOConfig(output_dir=out, max_steps=4, save_steps=2, per_device_train_batch_size=4,
                        gradient_accumulation_steps=2, num_generations=4, max_completion_length=8, learning_rate=1e-3,
                        seed=0, disable_tqdm=True, bf16=run.get("bf16", False), **reference, **sampling)
    trainer = GRPOTrainer(task.model, reward_funcs, args=config, train_dataset=task.train_dataset,
                          peft_config=peft_config)
    accelerator, engine = trainer.accelerator, trainer.session.engine
    sharded = [type(p).__name__ for p in engine.model.parameters()]
    reference = [] if engine.ref_model is None else [type(p).__name__ for p in engine.ref_model.parameters()]
    if not run.get("resume"):  # a save before any update must leave the run as it was (compared with ddp)
        trainer.session.save(f"{out}/start")
    losses = []  # per optimizer step: backward passes skipped, and which micro-batches were all zero here
    trainer.session.on(lambda stage, result: losses.append(
        [result.backward_skipped, (result.advantages.advantages_B.view(2, -1) == 0).all(1).tolist()]
    ) if stage == "loss" else None)
    batches = []  # per generation batch: what this process drew and kept
    trainer.session.on(lambda stage, rollout: batches.append(
        [len(rollout), rollout.dynamic_sampling.rounds, rollout.group_index_B.tolist(), rollout.columns["answer"]]
    ) if stage == "generate" and rollout.dynamic_sampling is not None else None)
    trainer.train(resume_from_checkpoint=run.get("resume"))
    row = trainer.session.last_metrics
    if batches:
        with open(f"{out}/batches-{accelerator.process_index}.json", "w") as handle:
            json.dump(batches, handle)
    with open(f"{out}/losses-{accelerator.process_index}.json", "w") as handle:
        json.dump(losses, handle)
    trainer.save_model(f"{out}/final")
    if accelerator.is_main_process:
        plugin = accelerator.state.deepspeed_plugin
        result = {"row": row, "parameter_types": sorted(set(sharded)), "reference_types": sorted(set(reference)),
                  "distributed_type": str(accelerator.distributed_type),
                  "zero_stage": None if plugin is None else plugin.zero_stage,
                  "engine": type(trainer.session.engine.model).__name__}
        with open(f"{out}/result.json", "w") as handle:
            json.dump(result, handle)
    release(trainer, last=last)


def gather_optimizer(task, run: dict, last: bool) -> None:
    from grpo_lab import GRPOSession

    session = GRPOSession.load(run["checkpoint"], reward_funcs=task.reward_funcs)
    engine, accelerator = session.engine, session.engine.accelerator
    state = engine.layout.full_optimizer_state(engine.model, engine.optimizer)
    if accelerator.is_main_process:
        torch.save(state, run["out"])
    del session, engine  # as GRPOTrainer.close does: the process group is freed before the interpreter exits
    accelerator.free_memory()
    gc.collect()
    if last:
        accelerator.end_training()


def fp32_head(task, run: dict, last: bool) -> None:
    from grpo_lab import GRPOConfig, GRPOSession

    config = GRPOConfig(output_dir=run["out"], cast_lm_head_to_fp32=True, bf16=False, num_generations=4,
                        per_device_train_batch_size=4)
    try:
        GRPOSession(run["model"], task.reward_funcs, args=config, train_dataset=task.train_dataset)
        refusal = "built"
    except ValueError as error:
        refusal = f"refused: {error}"
    if PartialState().is_main_process:
        Path(run["out"]).mkdir(parents=True, exist_ok=True)
        (Path(run["out"]) / "refused.txt").write_text(refusal)
    gc.collect()
    if last:
        PartialState().destroy_process_group()


def add(a: int, b: int) -> str:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b) if PartialState().process_index == 0 else "the sum is " + "very " * 30 + "long"


def with_tools(task, run: dict, last: bool) -> None:
    from transformers import AutoTokenizer

    from grpo_lab import GRPOConfig, GRPOTrainer

    out = run["out"]
    config = GRPOConfig(output_dir=out, max_steps=2, save_steps=10, per_device_train_batch_size=8, num_generations=4,
                        max_completion_length=64, top_k=1, learning_rate=1e-3, seed=0, disable_tqdm=True)
    # its chat template renders tools, its response_template parses calls
    tokenizer = AutoTokenizer.from_pretrained(run["model"])
    trainer = GRPOTrainer(run["model"], task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          processing_class=tokenizer, tools=[add])
    steps = []
    trainer.session.on(lambda stage, rollout: steps.append(
        [rollout.columns["tool_calls"],
         int((rollout.env_mask_BT == 0).logical_and(rollout.completion_mask_BT.bool()).sum())]
    ) if stage == "generate" else None)
    trainer.train()
    with open(f"{out}/tools-{trainer.accelerator.process_index}.json", "w") as handle:
        json.dump({"steps": steps, "row": trainer.session.last_metrics}, handle)
    release(trainer, last=last)


MODES = {"train": train, "optimizer": gather_optimizer, "fp32head": fp32_head, "tools": with_tools}


def main() -> None:
    (plan_file,) = sys.argv[1:]
    plan = json.loads(Path(plan_file).read_text())
    sharded = launch_accelerator()
    launched_type = PartialState(cpu=True).distributed_type  # accelerate's own choice on CPU: plain data parallel
    from grpo_lab.tasks import default_task

    task = default_task()
    for index, run in enumerate(plan):
        AcceleratorState._reset_state()  # a new run builds accelerate's state afresh, in the same process group
        GradientState._reset_state()
        PartialState().distributed_type = launched_type
        grpo_lab.parallel.dist.make_accelerator = PLAIN_ACCELERATOR if run.get("ddp") else sharded
        if PartialState().is_main_process:
            print(f"run {index + 1} of {len(plan)}: {json.dumps(run)}", file=sys.stderr, flush=True)
        MODES[run["mode"]](task, run, last=index == len(plan) - 1)
        gc.collect()


if __name__ == "__main__":
    main()
