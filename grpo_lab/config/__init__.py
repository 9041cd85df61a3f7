"""How a run is configured: GRPOConfig, its field table with each field's change rule, the checks, the
command-line parser and the live edits."""


def __getattr__(name: str):
    # ``grpo_lab.config.GRPOConfig``, the name's path before the package had folders; imported on first use
    # so that importing one of the package's modules does not load grpo_config.py and what it imports
    if name == "GRPOConfig":
        from grpo_lab.config.grpo_config import GRPOConfig

        return GRPOConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
