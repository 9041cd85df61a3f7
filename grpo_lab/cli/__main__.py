"""``python -m grpo_lab.cli``: the grpo-lab command."""

import sys

from grpo_lab.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
