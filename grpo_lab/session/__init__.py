"""GRPOSession and its parts: the stage machine, the run record, the stepping loops, files,
undo/fork/what-if, the live doctor and its probe, the reward workbench, the owner guard."""


def __getattr__(name: str):
    # ``grpo_lab.session.GRPOSession``, the name's path before the package had folders; imported on first use
    # so that importing one of the package's modules does not load session.py and what it imports
    if name == "GRPOSession":
        from grpo_lab.session.session import GRPOSession

        return GRPOSession
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
