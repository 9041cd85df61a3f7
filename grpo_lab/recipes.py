"""Train from a YAML recipe, for runs that never open a notebook (``grpo-lab train recipe.yaml``).

A recipe holds ``GRPOConfig`` fields plus four optional keys:

.. code-block:: yaml

    model: path/or/hub-id          # default: the tiny model shipped with grpo_lab
    reward_funcs:                  # "module:function"; default: the embedded task's rewards
      - grpo_lab.tasks.addition:correctness_reward   # modules beside the recipe or in the working
                                                     # directory import too (my_rewards:fn)
    train_dataset: default_task    # "default_task" or a directory written by Dataset.save_to_disk
    eval_dataset: default_task
    learning_rate: 1.0e-4          # any GRPOConfig field
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import sys
from pathlib import Path


RECIPE_KEYS = ("model", "reward_funcs", "train_dataset", "eval_dataset")


def import_object(reference: str, search: tuple[Path, ...] = ()):
    """``"package.module:attribute"`` -> the attribute; the directories ``search`` join the front of
    ``sys.path`` for the rest of the process, as a script's own folder does (a console script's
    ``sys.path`` holds neither the recipe's folder nor the working directory)."""
    module, _, attribute = reference.partition(":")
    if not attribute:
        raise ValueError(f"{reference!r} is not of the form 'package.module:function'.")
    sys.path[:0] = [str(directory) for directory in search if str(directory) not in sys.path]
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module.split(".")[0]:
            raise  # the module was found; something it imports was not
        folders = list(dict.fromkeys(str(d) for d in search))  # the recipe's folder may be the working directory
        where = " (looked in " + ", ".join(folders) + " and on sys.path)" if search else ""
        raise ValueError(f"Cannot import {reference!r}: {error}{where}") from error
    if not hasattr(imported, attribute):
        raise ValueError(f"Cannot import {reference!r}: module {module!r} has no attribute {attribute!r}")
    return getattr(imported, attribute)


def _dataset(reference, task, split: str):
    if reference in (None, "default_task"):
        return getattr(task, f"{split}_dataset")
    from datasets import load_from_disk

    return load_from_disk(str(reference))


def build_trainer(recipe_path: str | Path, argv: list[str] | None = None):
    """A ``GRPOTrainer`` from a recipe file; ``argv`` (``--field value``) overrides config fields."""
    from grpo_lab.config import GRPOConfig, read_yaml_mapping
    from grpo_lab.tasks import default_task
    from grpo_lab.trainer import GRPOTrainer

    recipe = read_yaml_mapping(recipe_path, "GRPOConfig fields and recipe keys")
    fields = {field.name for field in dataclasses.fields(GRPOConfig)}
    near = {key: difflib.get_close_matches(key, RECIPE_KEYS, n=1, cutoff=0.75) for key in recipe if key not in fields}
    misspelled = {key: match[0] for key, match in near.items() if match and key not in RECIPE_KEYS}
    if misspelled:
        key, meant = next(iter(misspelled.items()))
        raise ValueError(f"{recipe_path}: unknown key {key!r}; did you mean {meant!r}?")
    task = default_task()
    setup = {key: recipe.pop(key, None) for key in RECIPE_KEYS}
    config = GRPOConfig.from_args(argv or [],
                                  base=task.config(**recipe) if setup["model"] is None else GRPOConfig(**recipe))
    search = (Path(recipe_path).resolve().parent, Path.cwd())
    if isinstance(setup["reward_funcs"], str):
        raise ValueError(
            f"{recipe_path}: reward_funcs must be a list of 'module:function' entries, one per line starting "
            f"with '- ', got the single string {setup['reward_funcs']!r}."
        )
    if setup["reward_funcs"] is not None and not isinstance(setup["reward_funcs"], list):
        raise ValueError(
            f"{recipe_path}: reward_funcs must be a list of 'module:function' entries, one per line starting "
            f"with '- ', got a {type(setup['reward_funcs']).__name__}: {setup['reward_funcs']!r}."
        )
    for index, reference in enumerate(setup["reward_funcs"] or []):
        if not isinstance(reference, str):
            hint = ""
            if isinstance(reference, dict) and len(reference) == 1:
                [(module, function)] = reference.items()
                hint = (f" (YAML reads '- {module}: {function}' as a mapping: write '- {module}:{function}', "
                        "without the space)")
            raise ValueError(
                f"{recipe_path}: reward_funcs entry #{index} ({reference!r}) is {_article(type(reference).__name__)}, "
                f"not a string; give each entry as 'module:function' text, e.g. '- my_rewards:length_reward'{hint}."
            )
    funcs = [import_object(r, search) for r in setup["reward_funcs"]] if setup["reward_funcs"] else task.reward_funcs
    return GRPOTrainer(
        setup["model"] or task.model, funcs, args=config,
        train_dataset=_dataset(setup["train_dataset"], task, "train"),
        eval_dataset=_dataset(setup["eval_dataset"], task, "eval"),
    )


def _article(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"
