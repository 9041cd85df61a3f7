"""What a run saves: the run's state dicts and their format, checkpoint files, safe writes, the run logs."""


def __getattr__(name: str):
    # ``grpo_lab.state.FORMAT_VERSION``, the name's path before the package had folders; imported on first use
    # so that importing one of the package's modules does not load run_state.py and what it imports
    if name == "FORMAT_VERSION":
        from grpo_lab.state.run_state import FORMAT_VERSION

        return FORMAT_VERSION
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
