"""Train from a YAML recipe, for runs that never open a notebook (``grpo-lab train recipe.yaml``).

A recipe holds ``GRPOConfig`` fields plus six optional keys:

.. code-block:: yaml

    model: path/or/hub-id          # default: the tiny model shipped with grpo_lab
    reward_funcs:                  # "module:function"; default: the embedded task's rewards
      - grpo_lab.tasks.addition:correctness_reward   # modules beside the recipe or in the working
                                                     # directory import too (my_rewards:fn); an
                                                     # installed package of the same name wins
    train_dataset: default_task    # "default_task", a directory written by Dataset.save_to_disk,
                                   # or a mapping (below)
    eval_dataset: default_task     # default: the embedded task's, where train_dataset is too; else none
    peft:                          # train a LoRA adapter: peft.LoraConfig's fields (task_type CAUSAL_LM)
      r: 16
      lora_alpha: 32
      target_modules: all-linear
    processor:                     # a vision-language model's processor settings, given to
      max_pixels: 401408           # AutoProcessor.from_pretrained(model, ...) (default: as saved)
    learning_rate: 1.0e-4          # any GRPOConfig field

A dataset given as a mapping:

.. code-block:: yaml

    train_dataset:
      path: openai/gsm8k           # a local .jsonl/.json/.csv/.parquet file (one split), a directory
                                   # written by save_to_disk, or a Hugging Face Hub dataset id; a
                                   # relative path is looked up beside the recipe, then in the working
                                   # directory
      name: main                   # hub only: the dataset's configuration
      split: train                 # hub, or a saved DatasetDict: which split (default: train; required
                                   # for eval_dataset). A local file or a saved single Dataset has no
                                   # splits: name and split are refused there
      map: gsm8k_data:to_grpo_row  # optional "module:function", called on each row (a dict); the rows
                                   # it returns (a prompt, and the columns reward functions read)
                                   # replace the original columns
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import sys
from pathlib import Path


RECIPE_KEYS = ("model", "reward_funcs", "train_dataset", "eval_dataset", "peft", "processor")
DATASET_KEYS = ("path", "name", "split", "map")
"""The keys of a dataset given as a mapping (see the module docstring)."""
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def import_object(reference: str, search: tuple[Path, ...] = ()):
    """``"package.module:attribute"`` -> the attribute; the directories ``search`` join the end of
    ``sys.path`` for the rest of the process (a console script's ``sys.path`` holds neither the
    recipe's folder nor the working directory), so that a module there imports while an installed
    package of the same name (a stray ``peft.py`` beside the recipe) still comes first."""
    module, _, attribute = reference.partition(":")
    if not attribute:
        raise ValueError(f"{reference!r} is not of the form 'package.module:function'.")
    sys.path.extend(dict.fromkeys(str(directory) for directory in search if str(directory) not in sys.path))
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


def _dataset(reference, task, split: str, where: str, search: tuple[Path, ...]):
    if reference in (None, "default_task"):
        return getattr(task, f"{split}_dataset")
    if isinstance(reference, dict):
        return _mapped_dataset(reference, f"{where}: {split}_dataset", search, evaluation=split == "eval")
    if not isinstance(reference, str):
        raise ValueError(f"{where}: {split}_dataset must be 'default_task', a directory written by save_to_disk, or "
                         f"a mapping with {', '.join(DATASET_KEYS)}; got {reference!r}.")
    from datasets import load_from_disk

    return load_from_disk(str(reference))


def _mapped_dataset(spec: dict, where: str, search: tuple[Path, ...], *, evaluation: bool = False):
    """A dataset given as a mapping of ``DATASET_KEYS``: loaded, then mapped row by row. ``name`` and
    ``split`` are refused where they do not apply, and an eval set from splits must name its split."""
    from datasets import load_dataset

    unknown = sorted(set(spec) - set(DATASET_KEYS))
    if unknown or not isinstance(spec.get("path"), str):
        problem = f"unknown key(s) {', '.join(map(repr, unknown))}" if unknown else "no 'path' (a string)"
        raise ValueError(f"{where} has {problem}; its keys are {', '.join(DATASET_KEYS)} (path required), e.g. "
                         "{path: data/train.jsonl, map: my_data:to_row}.")
    for key in ("name", "split"):
        if key in spec and not isinstance(spec[key], str):
            raise ValueError(f"{where}: {key} must be a string, got {spec[key]!r}.")
    path = next((folder / spec["path"] for folder in search if (folder / spec["path"]).exists()), None)
    if path is not None and path.is_file():
        if path.suffix not in FILE_BUILDERS or {"name", "split"} & set(spec):
            raise ValueError(f"{where}: {path} is a local file, read as one split: give a "
                             f"{'/'.join(FILE_BUILDERS)} file without 'name' or 'split'.")
        dataset = _local_file(path, where)
    elif path is not None:
        dataset = _saved_dataset(path, spec, where, evaluation)
    else:
        if evaluation and "split" not in spec:
            raise ValueError(f"{where}: a Hub dataset needs 'split' here (e.g. split: test): without it the train "
                             f"split of {spec['path']!r} would be loaded, evaluating on the training data.")
        try:
            dataset = load_dataset(spec["path"], spec.get("name"), split=spec.get("split", "train"))
        except Exception as error:
            raise ValueError(f"{where}: {spec['path']!r} is neither a file nor a folder here, and loading it as a Hub "
                             f"dataset failed ({type(error).__name__}: {error}). Check the path, or the network "
                             "(HF_HUB_OFFLINE=1 allows only datasets already in the cache).") from error
    if "map" in spec:
        dataset = dataset.map(import_object(spec["map"], search), remove_columns=dataset.column_names)
    if "prompt" not in dataset.column_names:
        raise ValueError(f"{where}: the dataset's columns are {', '.join(dataset.column_names)}, without 'prompt'; "
                         "give 'map: module:function' returning a dict with a prompt (and the columns your reward "
                         "functions read) for each row.")
    return dataset


def _local_file(path: Path, where: str):
    """A local .jsonl/.json/.csv/.parquet file as one split, refused with the file's problem (a broken
    line, no rows) instead of ``datasets``' traceback."""
    from datasets import load_dataset

    if path.stat().st_size == 0:
        raise ValueError(f"{where}: {path} is empty; give a file with one row per prompt.")
    try:
        dataset = load_dataset(FILE_BUILDERS[path.suffix], data_files=str(path), split="train")
    except Exception as error:  # datasets wraps the reader's error (e.g. a JSON line cut short) in its own
        if _holds_no_rows(path):  # datasets refuses a split with no rows (a CSV with only its header) vaguely
            raise ValueError(f"{where}: {path} holds no rows; give a file with one row per prompt.") from None
        cause = error
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        problem = " ".join(str(cause).split())[:300]
        form = "one JSON object per line" if path.suffix == ".jsonl" else f"a valid {path.suffix[1:]} file"
        raise ValueError(f"{where}: {path} could not be read ({type(cause).__name__}: {problem}). Check that it is "
                         f"{form}.") from None
    if len(dataset) == 0:
        raise ValueError(f"{where}: {path} holds no rows; give a file with one row per prompt.")
    return dataset


def _holds_no_rows(path: Path) -> bool:
    """Whether a CSV file that ``datasets`` could not read is a header without rows."""
    import pandas as pd

    if path.suffix != ".csv":
        return False
    try:
        return pd.read_csv(path).empty
    except Exception:  # unreadable for another reason: the caller reports that one
        return False


def _saved_dataset(path: Path, spec: dict, where: str, evaluation: bool):
    """A folder written by ``save_to_disk``: a Dataset, or a DatasetDict's split ``spec["split"]``."""
    from datasets import load_from_disk

    if "name" in spec:
        raise ValueError(f"{where}: 'name' (a Hub dataset's configuration) does not apply to {path}, a folder written "
                         "by save_to_disk: remove 'name'.")
    dataset = load_from_disk(str(path))
    if not isinstance(dataset, dict):
        if "split" in spec:
            raise ValueError(f"{where}: {path} holds a single Dataset, with no splits: remove 'split' (or save the "
                             "DatasetDict whole to choose one of its splits).")
        return dataset
    splits = ", ".join(dataset)
    if evaluation and "split" not in spec:
        raise ValueError(f"{where}: {path} holds the splits {splits}: give 'split' (e.g. split: test); without it "
                         "the train split would be loaded, evaluating on the training data.")
    split = spec.get("split", "train")
    if split not in dataset:
        raise ValueError(f"{where}: split {split!r} is not in {path}, which holds the splits {splits}: "
                         "give one of them as 'split'.")
    return dataset[split]


def _peft_config(spec, where: str):
    """``peft.LoraConfig`` from the recipe's ``peft`` mapping (None: full fine-tuning)."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: peft must be a mapping of peft.LoraConfig fields, e.g. "
                         f"{{r: 16, lora_alpha: 32, target_modules: all-linear}}; got {spec!r}.")
    from peft import LoraConfig

    try:
        return LoraConfig(**{"task_type": "CAUSAL_LM", **spec})
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: peft: {error} (its keys are peft.LoraConfig's fields: r, lora_alpha, "
                         "lora_dropout, target_modules...).") from error


def _processor(spec, model, where: str):
    """The model's processor loaded with the recipe's ``processor`` settings (None: the model's own,
    as saved beside it)."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: processor must be a mapping of the processor's settings, e.g. "
                         f"{{max_pixels: 401408}}; got {spec!r}.")
    if model is None:
        raise ValueError(f"{where}: processor settings are for a vision-language model's processor; give its "
                         "model (the shipped tiny model is a text model, with a tokenizer).")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model, **spec)


def build_trainer(recipe_path: str | Path, argv: list[str] | None = None):
    """A ``GRPOTrainer`` from a recipe file; ``argv`` (``--field value``) overrides config fields."""
    from grpo_lab.config.grpo_config import GRPOConfig, read_yaml_mapping
    from grpo_lab.tasks import default_task
    from grpo_lab.trainer.trainer import GRPOTrainer

    recipe = read_yaml_mapping(recipe_path, "GRPOConfig fields and recipe keys")
    if not recipe:
        raise ValueError(
            f"{recipe_path} is empty, so it would train the embedded default task with its defaults. Write the "
            "fields and recipe keys to set (examples/recipe.yaml shows them), or `train_dataset: default_task` with "
            "the fields you change to train the default task on purpose."
        )
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
    own_data = setup["train_dataset"] not in (None, "default_task")
    where = str(recipe_path)
    return GRPOTrainer(
        setup["model"] or task.model, funcs, args=config,
        train_dataset=_dataset(setup["train_dataset"], task, "train", where, search),
        eval_dataset=None if own_data and setup["eval_dataset"] is None else _dataset(
            setup["eval_dataset"], task, "eval", where, search),
        peft_config=_peft_config(setup["peft"], where),
        processing_class=_processor(setup["processor"], setup["model"], where),
    )


def _article(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"
