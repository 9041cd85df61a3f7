"""The grpo-lab command and its recipes."""


def __getattr__(name: str):
    # ``grpo_lab.cli.main``, the name's path before the package had folders; imported on first use
    # so that importing one of the package's modules does not load commands.py and what it imports
    if name == "main":
        from grpo_lab.cli.commands import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
