"""The command line of an exported script: its config overrides (``--learning_rate 1e-5``) and
``--resume_from DIR``, read when the script runs."""

from __future__ import annotations

import sys
from pathlib import Path


def cli_config(base, argv: list[str] | None = None, edits: dict | None = None):
    """``base`` with ``edits`` (a notebook's ``session.config.FIELD = VALUE`` lines) and then the
    command-line overrides applied; also returns ``--resume_from`` (or None)."""
    import argparse
    import dataclasses

    from grpo_lab.state.checkpoint import check_complete
    from grpo_lab.config.grpo_config import GRPOConfig
    from grpo_lab.trainer.trackers import tracker_names

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--resume_from", default=None)
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if "-h" in rest or "--help" in rest:
        print(f"usage: {Path(sys.argv[0]).name} [--resume_from DIR] [--FIELD VALUE ...]\n")
        print("  --resume_from DIR  continue from a saved session (session.save) or a checkpoint-N directory\n")
    if known.resume_from is not None and not Path(known.resume_from).is_dir():
        print(f"error: --resume_from {known.resume_from}: no such directory (give a directory written by "
              "session.save() or a checkpoint-N of a trainer)", file=sys.stderr)
        raise SystemExit(2)
    if known.resume_from is not None:
        try:
            check_complete(known.resume_from)
        except FileNotFoundError as error:
            print(f"error: --resume_from: {error}", file=sys.stderr)
            raise SystemExit(2) from None
    try:
        if edits:
            base = dataclasses.replace(base, **edits)
        config = GRPOConfig.from_args(rest, base=base)
        tracker_names(config.report_to)  # a tracker that is not installed, before the model loads
        return config, known.resume_from
    except (FileNotFoundError, ImportError, ValueError, TypeError, NotImplementedError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
