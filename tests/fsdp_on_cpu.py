"""A GRPOTrainer run under accelerate's FSDP on CPU processes, for the tests in test_fsdp.py.

Launch it with the shipped FSDP config:

    accelerate launch --config_file examples/accelerate_configs/fsdp.yaml --num_processes 2 \
        tests/fsdp_on_cpu.py train OUT [--resume CHECKPOINT]

accelerate treats FSDP as a GPU feature: on a machine without one it runs an FSDP launch as plain
data parallel. torch's FSDP 2 (``fully_shard``) itself runs on CPU over gloo, so this script lets
accelerate take its FSDP path anyway: grpo_lab's Accelerator is built with the launch's FSDP
settings (``FSDP_*`` variables from the config above) and its state marked FSDP, so that
``prepare`` shards the model as on GPUs. Everything after that is grpo_lab's own code.

Modes:
    train OUT [--resume CHECKPOINT] [--lora] [--ddp]
                                      a save before training, then 4 steps of 2 accumulated
                                      micro-batches, a checkpoint every 2,
                                      then ``save_model(OUT/final)``; the main process writes
                                      OUT/result.json, each process OUT/losses-RANK.json (its
                                      skipped backward passes, its all-zero micro-batches). The full
                                      model trains with a KL term against a reference mixed towards it
                                      every step (TR-DPO); --lora trains a rank-8 adapter instead
                                      (beta 0); --ddp leaves accelerate's own choice on CPU, plain
                                      data parallel
    optimizer CHECKPOINT OUT          load CHECKPOINT and write the optimizer state gathered from the
                                      shards, keyed by parameter name, to OUT (torch.save)
    fp32head MODEL OUT                build a session on MODEL (bfloat16 weights) with
                                      cast_lm_head_to_fp32=True and no mixed precision; the main
                                      process prints the error
    tools MODEL OUT                   2 steps with tools=[add] on MODEL (a model that calls it, see
                                      test_tools.py) whose result leaves no room for an answer on
                                      process 1 only, so only process 0 samples a second turn; each
                                      process writes OUT/tools-RANK.json (its tool calls and
                                      tool-inserted tokens per step)
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

import grpo_lab.dist


def fsdp_accelerator(precision: str, *, use_cpu: bool = False) -> Accelerator:
    """Stands in for ``grpo_lab.dist.make_accelerator`` (same signature); the runs here are fp32 on CPU."""
    plugin = FullyShardedDataParallelPlugin()  # the launch's FSDP_* settings
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)  # which a CPU state does not keep
    accelerator.state.fsdp_plugin = plugin
    # AcceleratorState copies PartialState's type whenever it is built again: mark both
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    return accelerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "optimizer", "fp32head", "tools"])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--resume")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--ddp", action="store_true")
    args = parser.parse_args()
    if not args.ddp:
        grpo_lab.dist.make_accelerator = fsdp_accelerator
    from grpo_lab import GRPOConfig, GRPOSession, GRPOTrainer
    from grpo_lab.tasks import default_task

    task = default_task()
    if args.mode == "optimizer":
        checkpoint, out = args.paths
        session = GRPOSession.load(checkpoint, reward_funcs=task.reward_funcs)
        engine, accelerator = session.engine, session.engine.accelerator
        state = grpo_lab.dist.full_optimizer_state(accelerator, engine.model, engine.optimizer)
        if accelerator.is_main_process:
            torch.save(state, out)
        del session, engine  # as GRPOTrainer.close does: the process group is freed before the interpreter exits
        accelerator.free_memory()
        gc.collect()
        accelerator.end_training()
        return
    if args.mode == "fp32head":
        model, out = args.paths
        config = GRPOConfig(output_dir=out, cast_lm_head_to_fp32=True, bf16=False, num_generations=4,
                            per_device_train_batch_size=4)
        try:
            GRPOSession(model, task.reward_funcs, args=config, train_dataset=task.train_dataset)
        except ValueError as error:
            if PartialState().is_main_process:
                print(f"refused: {error}", flush=True)
        PartialState().destroy_process_group()
        return
    if args.mode == "tools":
        run_with_tools(*args.paths)
        return
    (out,) = args.paths
    reference = dict(beta=0.1, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        reference = {}
    config = GRPOConfig(output_dir=out, max_steps=4, save_steps=2, per_device_train_batch_size=4,
                        gradient_accumulation_steps=2, num_generations=4, max_completion_length=8, learning_rate=1e-3,
                        seed=0, disable_tqdm=True, **reference)
    trainer = GRPOTrainer(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          peft_config=peft_config)
    engine = trainer.session.engine
    sharded = [type(p).__name__ for p in engine.model.parameters()]
    reference = [] if engine.ref_model is None else [type(p).__name__ for p in engine.ref_model.parameters()]
    if not args.resume:  # a save before any update must leave the run as it was (compared with --ddp)
        trainer.session.save(f"{out}/start")
    losses = []  # per optimizer step: backward passes skipped, and which micro-batches were all zero here
    trainer.session.on(lambda stage, result: losses.append(
        [result.backward_skipped, (result.advantages.advantages_B.view(2, -1) == 0).all(1).tolist()]
    ) if stage == "loss" else None)
    trainer.train(resume_from_checkpoint=args.resume)
    row = trainer.session.last_metrics
    with open(f"{out}/losses-{trainer.accelerator.process_index}.json", "w") as handle:
        json.dump(losses, handle)
    trainer.save_model(f"{out}/final")
    if trainer.accelerator.is_main_process:
        result = {"row": row, "parameter_types": sorted(set(sharded)), "reference_types": sorted(set(reference)),
                  "distributed_type": str(trainer.accelerator.distributed_type)}
        with open(f"{out}/result.json", "w") as handle:
            json.dump(result, handle)
    trainer.close()  # as a script should: see GRPOTrainer.close


def add(a: int, b: int) -> str:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b) if PartialState().process_index == 0 else "the sum is " + "very " * 30 + "long"


def run_with_tools(model: str, out: str) -> None:
    from transformers import AutoTokenizer

    from grpo_lab import GRPOConfig, GRPOTrainer
    from grpo_lab.tasks import default_task

    task = default_task()
    config = GRPOConfig(output_dir=out, max_steps=2, save_steps=10, per_device_train_batch_size=8, num_generations=4,
                        max_completion_length=64, top_k=1, learning_rate=1e-3, seed=0, disable_tqdm=True)
    # its chat template renders tools, its response_template parses calls
    tokenizer = AutoTokenizer.from_pretrained(model)
    trainer = GRPOTrainer(model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          processing_class=tokenizer, tools=[add])
    steps = []
    trainer.session.on(lambda stage, rollout: steps.append(
        [rollout.columns["tool_calls"],
         int((rollout.env_mask_BT == 0).logical_and(rollout.completion_mask_BT.bool()).sum())]
    ) if stage == "generate" else None)
    trainer.train()
    with open(f"{out}/tools-{trainer.accelerator.process_index}.json", "w") as handle:
        json.dump({"steps": steps, "row": trainer.session.last_metrics}, handle)
    trainer.close()


if __name__ == "__main__":
    main()
