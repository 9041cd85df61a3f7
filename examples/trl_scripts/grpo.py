"""A TRL GRPO launch script of the usual shape: ``TrlParser`` over TRL's ``ScriptArguments``,
``GRPOConfig`` and ``ModelConfig`` (command line, ``--config FILE.yaml``, ``--help``), reward functions
named by import path, TRL's quantization and PEFT helpers, then train and save.

Written for TRL 1.16; the only change for grpo_lab is the import below. Two steps on the shipped model
and the embedded addition task (used when no --dataset_name is given):

    MODEL=$(python -c "from grpo_lab.tasks import TINY_MODEL_DIR; print(TINY_MODEL_DIR)")
    python examples/trl_scripts/grpo.py --model_name_or_path $MODEL --output_dir runs/grpo --max_steps 2 \\
        --per_device_train_batch_size 8 --num_generations 4 --max_completion_length 8 --learning_rate 1e-4 \\
        --reward_funcs grpo_lab.tasks.addition.correctness_reward
    python examples/trl_scripts/grpo.py --config examples/trl_scripts/grpo.yaml --model_name_or_path $MODEL

With --dataset_name it loads the data with ``datasets.load_dataset`` (a hub id, or a local folder of
``train``/``test`` data files), as TRL's own GRPO script does.
"""

import importlib
from dataclasses import dataclass, field

from datasets import load_dataset
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from grpo_lab import GRPOConfig, GRPOTrainer  # with TRL: from trl import GRPOConfig, GRPOTrainer


@dataclass
class GRPOScriptArguments(ScriptArguments):
    reward_funcs: list[str] = field(
        default_factory=lambda: ["grpo_lab.tasks.addition.correctness_reward", "grpo_lab.tasks.addition.format_reward"],
        metadata={"help": "Reward functions by import path, e.g. `my_package.rewards.accuracy`."})


def reward_function(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def main(script_args, training_args, model_args):
    if script_args.dataset_name:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
        train_dataset = dataset[script_args.dataset_train_split]
        eval_dataset = dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None
    else:
        from grpo_lab.tasks import default_task

        task = default_task(eval_size=16)
        train_dataset = task.train_dataset
        eval_dataset = task.eval_dataset if training_args.eval_strategy != "no" else None
    training_args.model_init_kwargs = {"dtype": model_args.dtype, **(training_args.model_init_kwargs or {})}
    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=[reward_function(path) for path in script_args.reward_funcs],
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.end()


if __name__ == "__main__":
    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig))
    main(*parser.parse_args_and_config())
