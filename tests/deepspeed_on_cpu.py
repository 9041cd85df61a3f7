"""A GRPOTrainer run under accelerate's DeepSpeed ZeRO path on CPU processes, for test_deepspeed.py.

Launch it with a shipped DeepSpeed config:

    accelerate launch --config_file examples/accelerate_configs/deepspeed_zero2.yaml --num_processes 2 \
        tests/deepspeed_on_cpu.py train OUT [--resume CHECKPOINT] [--lora] [--bf16]

accelerate treats DeepSpeed as a GPU feature: on a machine without one it runs a DeepSpeed launch as
plain data parallel. DeepSpeed itself runs on CPU (its CPU accelerator, over gloo), so this script
lets accelerate take its DeepSpeed path anyway: grpo_lab's Accelerator is built with the launch's
DeepSpeed settings (``ACCELERATE_DEEPSPEED_*`` variables from the config) and its state marked
DEEPSPEED, so that ``prepare`` builds DeepSpeed's engine as on GPUs. Everything after that is
grpo_lab's own code.

Modes:
    train OUT [--resume CHECKPOINT] [--lora] [--bf16] [--ddp]
                                      a save before training, then 4 steps of 2 accumulated
                                      micro-batches, a checkpoint every 2, then
                                      ``save_model(OUT/final)``; the main process writes
                                      OUT/result.json. The full model trains with a KL term against
                                      a reference mixed towards it every step (TR-DPO); --lora trains
                                      a rank-8 adapter instead (beta 0); --bf16 turns on DeepSpeed's
                                      bf16 (16-bit weights, fp32 master weights in the optimizer);
                                      --ddp leaves accelerate's own choice on CPU, plain data parallel
    optimizer CHECKPOINT OUT          load CHECKPOINT and write the optimizer state gathered from
                                      ZeRO's partitions, keyed by parameter name, to OUT (torch.save)
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedType

import grpo_lab.dist


def deepspeed_accelerator(precision: str, *, use_cpu: bool = False) -> Accelerator:
    """Stands in for ``grpo_lab.dist.make_accelerator`` (same signature), giving ``precision`` to
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "optimizer"])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--resume")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    if not args.ddp:
        grpo_lab.dist.make_accelerator = deepspeed_accelerator
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
    (out,) = args.paths
    reference = dict(beta=0.1, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        reference = {}
    config = GRPOConfig(output_dir=out, max_steps=4, save_steps=2, per_device_train_batch_size=4,
                        gradient_accumulation_steps=2, num_generations=4, max_completion_length=8, learning_rate=1e-3,
                        seed=0, disable_tqdm=True, bf16=args.bf16, **reference)
    trainer = GRPOTrainer(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          peft_config=peft_config)
    accelerator = trainer.accelerator
    if not args.resume:  # a save before any update must leave the run as it was (compared with --ddp)
        trainer.session.save(f"{out}/start")
    trainer.train(resume_from_checkpoint=args.resume)
    row = trainer.session.last_metrics
    trainer.save_model(f"{out}/final")
    if accelerator.is_main_process:
        plugin = accelerator.state.deepspeed_plugin
        result = {"row": row, "distributed_type": str(accelerator.distributed_type),
                  "zero_stage": None if plugin is None else plugin.zero_stage,
                  "engine": type(trainer.session.engine.model).__name__}
        with open(f"{out}/result.json", "w") as handle:
            json.dump(result, handle)
    trainer.close()  # as a script should: see GRPOTrainer.close


if __name__ == "__main__":
    main()
