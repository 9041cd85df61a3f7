"""GRPOTrainer, the script trainer: a loop over session.step() with transformers' events, evaluation, the
doctor's stop, results, the model card and trackers."""


def __getattr__(name: str):
    # ``grpo_lab.trainer.GRPOTrainer``, the name's path before the package had folders; imported on first use
    # so that importing one of the package's modules does not load trainer.py and what it imports
    if name == "GRPOTrainer":
        from grpo_lab.trainer.trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
