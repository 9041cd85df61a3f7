"""Export a session or a notebook to a standalone training script for ``accelerate launch``.

Both exports produce the same shape of script: a generated-file header, the user's code (reward
functions and whatever builds the data), and a ``GRPOTrainer`` whose config can be overridden from
the command line (``--learning_rate 1e-5``; ``--resume_from DIR`` continues from a saved session or
checkpoint). The script runs the same engine the session stepped through.

Neither export writes a secret: a value that looks like a credential, by its name (``OPENAI_API_KEY``,
``api_key``, ``token``, ``password``, ...) or its form (``sk-...``, ``hf_...``, ``ghp_...``, ``AKIA...``),
in copied code, a global a copied function uses or a config value (``model_init_kwargs={"token": ...}``),
becomes a read of an environment variable (``os.environ["OPENAI_API_KEY"]``; a config value
``os.environ.get("HF_TOKEN")``), and a warning names each such value and its variable. Entries of the
saved tokenizer's or adapter's JSON files that hold one are left out.

Notebook cell convention (``grpo-lab export notebook.ipynb -o train.py``):

- a code cell is exported when it carries the cell tag ``export`` or its first line is ``# export``;
  every other cell (stepping, views, plots) is interactive only and left out;
- the exported cells must create the session with ``NAME = GRPOSession(...)``; in the script that
  call becomes ``GRPOTrainer(...)`` (the same arguments), its ``args=`` receives the command-line
  overrides, and ``NAME.train()`` follows;
- exported ``NAME.config.FIELD = VALUE`` statements become part of the script's config, below the
  command-line overrides; they must be plain assignments at the top level of a cell whose value
  reads only names defined before the session (a literal, a constant); any other edit of
  ``NAME.config``, an edit after the session through the name passed as ``args=``, and any other use
  of ``NAME`` after the session (stepping, plots: in the script it is a trainer), is refused at
  export time;
- a name the exported code reads but no exported cell defines is refused at export time;
- the script creates and trains the ``GRPOTrainer`` under ``if __name__ == "__main__":`` (processes
  that vLLM or multiprocessing spawn import the script again), so the code of the session's cell
  from the session on, and of the cells after it, runs there.

Modules: ``functions`` copies or imports reward functions, rollout functions and tools (with
``local_imports`` warning about imports the script will not find); ``session_script`` and
``session_data`` write a session's script and the data beside it; ``notebook_cells``, ``scopes``,
``config_edits`` and ``notebook_script`` take a notebook's exported cells to a script;
``command_line`` is what a script runs to read its command line; ``script_file`` holds the header
and file writing both exports share.
"""

from grpo_lab.export.command_line import cli_config
from grpo_lab.export.errors import ExportError
from grpo_lab.export.functions import reward_function_code
from grpo_lab.export.notebook_script import export_notebook
from grpo_lab.export.session_script import export_session

__all__ = ["ExportError", "cli_config", "export_notebook", "export_session", "reward_function_code"]
