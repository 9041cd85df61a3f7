"""Reward functions made ready before anything is generated: a reward model given by path loaded,
each function paired with its tokenizer, names made distinct; and the checks that refuse now,
naming the fix, what would otherwise fail only after a generation (a signature that cannot take
the keyword arguments every call passes, a dataset column that shadows one of them, a number of
weights that does not match the functions)."""

from __future__ import annotations

import inspect

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel


def reward_func_name(func) -> str:
    if isinstance(func, PreTrainedModel):
        return str(func.config._name_or_path).rstrip("/").split("/")[-1] or type(func).__name__
    return getattr(func, "__name__", type(func).__name__)


CALL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""Keyword arguments every reward function call receives, besides the dataset's other columns."""


def _ready_made(func) -> bool:
    """Whether ``func`` is one of grpo_lab's or TRL's own reward functions (or made by one of their
    factories), whose signature a user does not edit."""
    module = getattr(func, "__module__", None) or type(func).__module__ or ""
    return module.startswith(("grpo_lab.rewards.", "trl.rewards"))


def check_reward_signature(func, name: str, columns: list[str]) -> None:
    """Raise a TypeError now, naming the fix, if ``func`` cannot take the keyword arguments every call
    passes (``CALL_KEYWORDS`` and the dataset ``columns``), instead of failing after generation."""
    try:  # the signature of what is called: a decorator's wrapper, not the function it wraps
        parameters = inspect.signature(func, follow_wrapped=False).parameters.values()
    except (TypeError, ValueError):  # builtins and some C callables have no signature to read
        return
    passed = [*CALL_KEYWORDS, *columns]
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        accepted = set(passed)
    else:
        accepted = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unexpected = [k for k in passed if k not in accepted]
    missing = [
        p.name for p in parameters
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY) and p.default is p.empty
        and (p.name not in passed or p.kind is p.POSITIONAL_ONLY)
    ]
    if not unexpected and not missing:
        return
    if missing and not unexpected and _ready_made(func):
        # the function is right as it is: the data set lacks the column it reads
        raise TypeError(
            f"Reward function {name!r} reads the dataset column(s) {', '.join(missing)}, which this dataset does not "
            f"have (its columns: {', '.join(columns) or 'none'}). Add or rename the column, e.g. "
            f"dataset = dataset.rename_column({(columns[-1] if columns else 'answer')!r}, {missing[0]!r})."
        )
    problems = []
    if unexpected:
        problems.append(f"does not accept {', '.join(unexpected)}")
    if missing:
        problems.append(f"requires {', '.join(missing)}, which no call passes")
    raise TypeError(
        f"Reward function {name!r} {' and '.join(problems)}. Every call passes the keyword arguments "
        f"{', '.join(passed)}: take the ones you need and end the signature with **kwargs, e.g. "
        f"def {name}(completions, **kwargs)."
    )


def check_column_names(dataset, dataset_name: str) -> None:
    """Refuse a dataset column named like a keyword argument reward functions already receive: the
    column could never reach them."""
    clashing = [column for column in getattr(dataset, "column_names", None) or () if column in CALL_KEYWORDS]
    if clashing:
        renames = "".join(f".rename_column({c!r}, '{c}_column')" for c in clashing)
        raise ValueError(
            f"{dataset_name} has a column named {', '.join(map(repr, clashing))}, a name reward functions "
            f"already receive as a keyword argument ({', '.join(CALL_KEYWORDS)}), so the column cannot reach "
            f"them. Rename it, e.g. {dataset_name} = {dataset_name}{renames}, and read it under that name."
        )


def check_reward_weights(reward_weights: list[float] | None, reward_funcs) -> None:
    """Refuse ``reward_weights`` without one weight per reward function, before anything is generated."""
    count = len(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else int(reward_funcs is not None)
    if reward_weights is not None and len(reward_weights) != count:
        raise ValueError(
            f"reward_weights has {len(reward_weights)} entries ({reward_weights}) but there are {count} reward "
            "functions. Give one weight per function, in the order of reward_funcs, or None to weight them all by 1."
        )


def weights_tensor(reward_weights: list[float] | None, names: list[str], fixed: int = 0):
    """The weight of each of the reward functions ``names`` as a tensor (None: all 1), from
    ``reward_weights``, which lists all but the last ``fixed`` (an environment's ``get_reward``,
    weighted 1); refused where the counts differ (the config can be edited between steps)."""
    if reward_weights is None:
        return None
    if len(reward_weights) != len(names) - fixed:
        listed = len(names) - fixed
        raise ValueError(
            f"reward_weights has {len(reward_weights)} entries but there are {listed} reward functions "
            f"({', '.join(names[:listed])}). Give one weight per function"
            + (f"; the environments' get_reward ({', '.join(names[listed:])}) weigh 1 each." if fixed else ".")
        )
    return torch.tensor([*reward_weights, *[1.0] * fixed], dtype=torch.float32)


def prepare_reward_funcs(reward_funcs, reward_processing_classes=None, model_init_kwargs=None, columns=()):
    """Normalise ``reward_funcs`` to a list; load reward models given by path; pair tokenizers; check
    that each function takes the keyword arguments its calls pass (``columns``: the dataset's
    columns besides the prompt).

    Returns ``(funcs, processing_classes, names)``.
    """
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ValueError("reward_funcs is empty: give at least one reward function or reward model.")
    classes = reward_processing_classes
    if classes is None or not isinstance(classes, (list, tuple)):
        classes = [classes] * len(funcs) if len(funcs) == 1 or classes is None else None
    if classes is None or len(classes) != len(funcs):
        raise ValueError(
            f"reward_processing_classes must have one entry per reward function ({len(funcs)}); "
            "use None for plain functions."
        )
    loaded, tokenizers = [], []
    for func, tokenizer in zip(funcs, classes, strict=True):
        if isinstance(func, str):
            try:
                func = AutoModelForSequenceClassification.from_pretrained(
                    func, num_labels=1, **(model_init_kwargs or {})
                )
            except OSError as error:
                raise ValueError(
                    f"The reward function {func!r} is a string, which is loaded as a reward model (a local "
                    f"directory or a Hugging Face Hub id), and loading it failed: {error} Pass the function "
                    "itself, not its name, to use a Python function."
                ) from error
        if isinstance(func, PreTrainedModel):
            func.eval().requires_grad_(False)
            if tokenizer is None:
                remote_code = bool((model_init_kwargs or {}).get("trust_remote_code"))  # from config.model_kwargs()
                tokenizer = AutoTokenizer.from_pretrained(func.config._name_or_path, trust_remote_code=remote_code)
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            func.config.pad_token_id = tokenizer.pad_token_id
        elif not callable(func):
            raise TypeError(f"A reward function must be callable, a model path or a PreTrainedModel; got {func!r}.")
        loaded.append(func)
        tokenizers.append(tokenizer)
    names = [reward_func_name(f) for f in loaded]
    if len(set(names)) != len(names):
        names = [f"{name}_{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]
    check_reward_signatures(loaded, names, columns)
    return loaded, tokenizers, names


def check_reward_signatures(funcs, names, columns) -> None:
    """:func:`check_reward_signature` for each reward function (models take no keyword arguments);
    nothing while ``columns`` is None (not known yet)."""
    if columns is None:
        return
    for func, name in zip(funcs, names, strict=True):
        if not isinstance(func, PreTrainedModel):
            check_reward_signature(func, name, list(columns))
