"""Saving and loading a GRPOSession: ``state_dict()``/``load_state_dict()`` in memory, and
``save(path)``/``GRPOSession.load(path)`` as checkpoint directories (see :mod:`grpo_lab.state.checkpoint`
for the files and :mod:`grpo_lab.state.run_state` for what they hold)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from grpo_lab import notices
from grpo_lab.state.checkpoint import (
    SAVE_ENTRIES,
    TRAINER_STATE_FILE,
    check_save_target,
    load_saved_weights,
    load_state,
    own_process_state,
    per_process_states,
    safe_state,
    plain_values,
    restore_engine,
    restored_images,
    safe_batch,
    save_engine,
    saved_model_dir,
)
from grpo_lab.credentials.config_values import shareable, without_secrets
from grpo_lab.config.args import function_reference
from grpo_lab.config.grpo_config import GRPOConfig, read_yaml_mapping
from grpo_lab.parallel.dist import (
    gather_to_main, launched_processes, on_main,
)
from grpo_lab.config.live import rebuilt_fields
from grpo_lab.core.models import cast_lm_head_to_fp32, is_vision_checkpoint, load_causal_lm, load_tokenizer
from grpo_lab.rollout.environments import user_reward_funcs
from grpo_lab.state.safe_write import atomic_directory_write
from grpo_lab.state.run_state import on_device, rng_state
from grpo_lab.core.stream_sampler import is_stream


def save(session, path, *, overwrite: bool, trainer_state: str | None) -> Path:
    """``session.save(path)``: the session's checkpoint directory, written atomically by the main process."""
    session.apply_config_edits()
    engine = session.engine
    accelerator = engine.accelerator
    engine.layout.check_savable()
    on_main(accelerator, f"check {path}", lambda: check_save_target(Path(path), overwrite=overwrite))
    pending, unsafe = safe_batch(on_device((session.rollout, session.scores, session.advantages_result), "cpu"))
    if unsafe is not None:
        notices.warn(
            f"The half-used generation batch holds {unsafe} (in its columns or logged extras), which a checkpoint "
            "does not store (loading it would mean unpickling code); the save leaves the batch out, and a run "
            "loaded from it generates a new one. Give reward functions and rollout functions plain values "
            "(numbers, strings, lists, dicts, tensors) to keep it."
        )
        pending = (None, None, None)
    ahead, unsafe = safe_state(session.engine.generation_stage.ahead.state_dict())
    if unsafe is not None:
        notices.warn(
            f"The generation batch prepared for the next step (async_generation) holds {unsafe}, which a checkpoint "
            "does not store (loading it would mean unpickling code); the save leaves it out, and a run loaded from "
            "it generates that batch again, with the weights of the step it resumes at."
        )
    per_process = gather_to_main(accelerator, {"rng": rng_state(), "pending": pending, "generation_ahead": ahead})
    gathered = (  # a sharded (FSDP) model's, optimizer's and reference's whole states, gathered by every process
        engine.layout.full_model_state(engine.model, adapter_only=engine.is_peft),
        engine.layout.full_optimizer_state(engine.model, engine.optimizer),
        None if engine.ref_model is None else engine.layout.full_state(engine.ref_model),
    )
    extra = _checkpoint_records(session)
    write = functools.partial(_write_checkpoint, engine, extra, per_process, gathered, trainer_state)
    on_main(accelerator, f"write {path}", lambda: atomic_directory_write(
        Path(path), write, own_entries=SAVE_ENTRIES, overwrite=overwrite,
    ))
    return Path(path)


def load(cls, path, *, model, reward_funcs, train_dataset, eval_dataset, trust_remote_code: bool, kwargs: dict):
    """``GRPOSession.load(path)``: a session of class ``cls`` rebuilt from a checkpoint directory."""
    directory = Path(path)
    state = load_state(directory)
    extra = state["extra"]
    if reward_funcs is None:
        reward_funcs = _unreferenced(extra["reward_funcs"], directory, "reward functions", "reward_funcs=[...]")
    if not {"rollout_func", "tools", "environment_factory"} & set(kwargs):  # else the caller chose how to generate
        kwargs["rollout_func"] = _unreferenced(
            extra["rollout_func"], directory, "rollout function", "rollout_func=..."
        )
        kwargs["tools"] = _unreferenced(extra["tools"], directory, "tools", "tools=[...]")
        kwargs["environment_factory"] = _unreferenced_factories(extra, directory)
    train_dataset, eval_dataset = _saved_datasets(directory, train_dataset, eval_dataset)
    if kwargs.get("args") is None:
        kwargs["args"] = _saved_config(directory / "config.yaml")
        _saved_metric(kwargs["args"], directory)
        if not trust_remote_code:
            kwargs["args"] = _without_remote_code(kwargs["args"], directory)
    own_optimizer, own_scheduler = (part is not None for part in kwargs.get("optimizers", (None, None)))
    saved = per_process_states(state)
    half_used = len(saved) == launched_processes() and saved[0]["pending"][0] is not None  # else it is dropped
    built = rebuilt_fields(
        directory, extra["applied_config"], without_secrets(kwargs["args"].to_dict())[0], own_optimizer, own_scheduler,
        given_model=model is not None, half_used=half_used,
    )
    model_dir = saved_model_dir(directory)
    model = _saved_model(model_dir, model, kwargs["args"])
    remote_code = kwargs["args"].model_kwargs()["trust_remote_code"]
    kwargs.setdefault("processing_class", load_tokenizer(str(model_dir), trust_remote_code=remote_code))
    session = cls(model, reward_funcs, train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs)
    _restore(session, state, built)
    return session


def _with_given_values(applied: dict, given: dict) -> dict:
    """The saved applied config with the values the loading config holds put back where the save
    could keep only a stand-in: a credential it left out (:mod:`grpo_lab.credentials.config_values`),
    a function it named by ``module:name`` (``dynamic_sampling_metric``). A token passed again in args,
    or the function imported again, is not an edit of its field."""
    def stands_for(name: str, value) -> bool:
        new = given[name]
        if callable(new):
            return function_reference(new) == value
        return without_secrets({name: new})[0][name] == value

    return {name: given[name] if name in given and stands_for(name, value) else value
            for name, value in applied.items()}


def _saved_metric(config: GRPOConfig, directory: Path) -> None:
    """A ``dynamic_sampling_metric`` function the save named by ``module:name`` (config.yaml), imported
    again as reward functions are (never from beside the checkpoint); a ValueError saying how to pass
    it where it cannot be found (a lambda, a notebook's function in a new kernel)."""
    metric = config.dynamic_sampling_metric
    if not config.dynamic_sampling or not isinstance(metric, str) or ":" not in metric:
        return  # off: the text stays, and turning it on asks for the function
    try:
        config.dynamic_sampling_metric = _import_reference(metric, directory)
    except (AttributeError, ImportError, ValueError) as error:
        raise ValueError(
            f"The dynamic_sampling_metric function saved in {directory} ({metric}) cannot be found in this process "
            f"({error}; e.g. a lambda, or a function defined in a notebook): make it importable under that module "
            "and name (a module-level def) and load again, or build the session anew with the function."
        ) from None


def _checkpoint_records(session) -> dict:
    """The session's records as a checkpoint stores them (logs: what it cannot store is kept as
    text; functions as ``module:name`` references)."""
    engine, record = session.engine, session.record
    return {
        "history": plain_values(record.history),
        "evaluations": plain_values(record.evaluations),
        "completion_log": plain_values(record.completion_log),
        "config_changes": plain_values(record.config_changes, unknown=_stored_text),
        "applied_config": plain_values(shareable(record.applied_config), unknown=_stored_text),
        "batch_step": session.batch_step,
        "last_stage": record.last_stage,
        "findings": plain_values(session.findings_record.state_dict()),
        "name": session.name,
        "fork_point": session.fork_point,
        "reward_funcs": _referenced(user_reward_funcs(engine)),
        "rollout_func": _referenced(engine.rollout_func),
        "tools": _referenced(engine.tools),
        "environment_factory": _referenced_factories(session.environment_factory),
    }


def _stored_text(value) -> str:
    """A config value a checkpoint cannot hold as it is: a function as ``module:name``, else its text."""
    return function_reference(value) if callable(value) else str(value)


def _referenced_factories(factory) -> dict | None:
    """``environment_factory`` as ``_referenced`` stores functions (its classes or functions, by
    reference), with the names of a dict of them; the environments themselves are live objects, never
    stored: a loaded run builds new ones."""
    if not isinstance(factory, dict):
        return _referenced(factory)
    referenced = _referenced(list(factory.values()))
    return None if referenced is None else {**referenced, "names": list(factory)}


def _unreferenced_factories(extra: dict, directory: Path):
    """The ``environment_factory`` that ``_referenced_factories`` stored in a checkpoint's ``extra``
    records (None for a checkpoint made before it was kept)."""
    if "environment_factory" not in extra:
        return None
    saved = extra["environment_factory"]
    found = _unreferenced(saved, directory, "environment factories", "environment_factory=...")
    if found is None or "names" not in saved:
        return found
    return dict(zip(saved["names"], found, strict=True))


def _write_checkpoint(engine, extra: dict, per_process: list, gathered: tuple, trainer_state: str | None,
                      directory: Path) -> None:
    """Write a checkpoint's files into ``directory`` (the main process, inside an atomic write)."""
    from datasets.utils.logging import disable_progress_bar, enable_progress_bar, is_progress_bar_enabled

    save_engine(engine, directory, extra, per_process, gathered)
    if trainer_state is not None:
        (directory / TRAINER_STATE_FILE).write_text(trainer_state)
    shown = is_progress_bar_enabled()
    disable_progress_bar()  # a checkpoint is not worth three progress bars per save
    try:
        if not is_stream(engine.train_dataset):  # a stream is not stored; its position is in the state
            engine.train_dataset.save_to_disk(str(directory / "train_dataset"))
        if engine.eval_dataset is not None:
            engine.eval_dataset.save_to_disk(str(directory / "eval_dataset"))
    finally:
        if shown:
            enable_progress_bar()


def _saved_config(path: Path) -> GRPOConfig:
    """A checkpoint's config; a field this version does not have (a TrainingArguments field of the
    transformers version that wrote it) is left out, with a warning."""
    values = read_yaml_mapping(path)
    fields = {field.name for field in dataclasses.fields(GRPOConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        notices.warn(
            f"{path} sets {', '.join(unknown)}, which this GRPOConfig does not have (the checkpoint was written with "
            "another transformers or grpo_lab version); those settings are left out."
        )
    return GRPOConfig(**{name: value for name, value in values.items() if name in fields})


def _saved_datasets(directory: Path, train_dataset, eval_dataset):
    """The datasets to load with: those given, else the ones saved beside the checkpoint."""
    from datasets import load_from_disk

    if train_dataset is None:
        if not (directory / "train_dataset").exists():
            raise ValueError(
                f"{directory} was written by a run that streamed its prompts (an IterableDataset), which a "
                "checkpoint does not store: pass the same stream as train_dataset=; the run continues from the "
                "position saved in the checkpoint."
            )
        train_dataset = load_from_disk(str(directory / "train_dataset"))
    if eval_dataset is None and (directory / "eval_dataset").exists():
        eval_dataset = load_from_disk(str(directory / "eval_dataset"))
    return train_dataset, eval_dataset


def _saved_model(model_dir: Path, model, config: GRPOConfig):
    """What the session is built from: ``model`` (given) with the saved weights copied in, a PEFT
    model with the saved adapter, or the saved model's directory."""
    adapter = (model_dir / "adapter_config.json").exists()
    if model is None and not adapter and config.cast_lm_head_to_fp32:
        model = load_causal_lm(str(model_dir), config.model_kwargs())  # the saved weights are copied in below
    if model is not None:
        if config.cast_lm_head_to_fp32:  # before the copy: a head in the model's dtype would round the saved one
            cast_lm_head_to_fp32(model)
        load_saved_weights(model, model_dir)
        return model
    if adapter and is_vision_checkpoint(str(model_dir)):  # peft has no auto class for them: the base, then the adapter
        from peft import PeftConfig, PeftModel

        base = load_causal_lm(PeftConfig.from_pretrained(str(model_dir)).base_model_name_or_path, config.model_kwargs())
        return PeftModel.from_pretrained(base, str(model_dir), is_trainable=True)
    if adapter:
        from peft import AutoPeftModelForCausalLM

        return AutoPeftModelForCausalLM.from_pretrained(str(model_dir), is_trainable=True, **config.model_kwargs())
    return str(model_dir)


def _restore(session, state: dict, built: dict) -> None:
    """Put the checkpoint's engine state, records and this process's half-used batch into a session
    just built from it; ``built``: the build-time fields changed on load, ``{name: (old, new)}``."""
    extra = state["extra"]
    accelerator = session.engine.accelerator
    own = own_process_state(state, accelerator.process_index, accelerator.num_processes)
    restore_engine(session.engine, state, own["rng"])
    session.own_random.adopt(own["rng"])  # its own from here: the checkpoint's, not the one it was built with
    session.name, session.fork_point = extra.get("name"), extra.get("fork_point")  # absent before forks existed
    built_changes = [{"step": state["global_step"] + 1, "field": name, "old": old, "new": new}
                     for name, (old, new) in built.items()]
    session.record.load_state_dict({
        **extra, "config_changes": extra["config_changes"] + built_changes,
        "applied_config": _with_given_values(
            {**extra["applied_config"], **{name: new for name, (_, new) in built.items()}}, session.config.to_dict()),
    })
    session.batch_step = extra["batch_step"]
    session.findings_record.load_state_dict(extra.get("findings"), session.record.last_step)  # absent before kept
    session.engine.generation_stage.ahead.load_state_dict(own.get("generation_ahead"))  # absent before it existed
    if own["pending"] is None or own["pending"][0] is None:  # dropped, or saved between batches
        session.discard_batch()
        return
    session.rollout, session.scores, session.advantages_result = on_device(own["pending"], accelerator.device)
    session.rollout.columns = restored_images(session.rollout.columns)  # the images it was saved with, as PIL images
    if session.scores is not None and session.scores.reward_names != session.engine.reward_names:
        notices.warn(
            f"The saved run stopped inside a generation batch scored by {session.scores.reward_names}; its "
            f"remaining {session.engine.steps_per_batch - session.batch_step} optimizer step(s) train on those "
            f"scores, and the reward functions given now ({session.engine.reward_names}) score the batches "
            "after it; session.discard_batch() drops it instead."
        )


def _without_remote_code(config: GRPOConfig, directory: Path) -> GRPOConfig:
    """The checkpoint's config without the settings that make loading a model run or fetch code
    (``trust_remote_code``, ``code_revision``, hub kernels): a file in the checkpoint must not be able
    to turn them on; only the caller's own arguments can."""
    init_kwargs = dict(config.model_init_kwargs or {})
    dropped = [name for name in list(init_kwargs) if name in ("trust_remote_code", "code_revision") or "kernel" in name]
    if "/" in str(init_kwargs.get("attn_implementation", "")):  # an attention kernel fetched from the hub
        dropped.append("attn_implementation")
    for name in dropped:
        init_kwargs.pop(name)
    if config.trust_remote_code or dropped:
        settings = ["trust_remote_code"] * bool(config.trust_remote_code)
        settings += [f"model_init_kwargs[{n!r}]" for n in dropped]
        notices.warn(
            f"{directory / 'config.yaml'} sets {', '.join(settings)}, which a checkpoint cannot turn on: the model is "
            "loaded without running or fetching code. If you trust the checkpoint, load it with "
            "GRPOSession.load(path, trust_remote_code=True), or pass your own args= with these settings."
        )
        config.trust_remote_code = False
        config.model_init_kwargs = init_kwargs or None
    return config


def _unreferenced(saved, directory: Path, what: str, argument: str):
    """Functions saved by ``_referenced``, imported by name; a ValueError naming the argument that
    passes them again where they could not be stored, or cannot be found any more (defined in a
    notebook, renamed, moved)."""
    problem = "could not be stored (not importable by module and name, e.g. a lambda or a notebook's function)"
    if not (isinstance(saved, dict) and isinstance(saved.get("functions"), list)):
        saved = None  # nothing this version wrote: never unpickled
    if saved is not None and saved["none"]:
        return None
    if saved is not None:
        try:
            found = [_import_reference(reference, directory) for reference in saved["functions"]]
            return found if saved["is_list"] else found[0]
        except (AttributeError, ImportError, ValueError) as error:
            problem = f"cannot be found in this process ({error}; e.g. defined in a notebook)"
    again = "it" if what == "rollout function" else "them"
    raise ValueError(
        f"The {what} saved in {directory} {problem}; pass {again} again: GRPOSession.load(path, {argument})."
    )


def _import_reference(reference: str, directory: Path | None = None):
    """The function a ``module:name`` reference names. A module not imported yet that would be
    imported from the checkpoint ``directory``, from inside it, or from a folder above it (the
    folder holding the checkpoint, reached as a module or as a namespace package) is refused:
    loading must not run code that arrived with the checkpoint. A module the process has imported
    already (the notebook's own reward module) is taken as it is."""
    import importlib
    import sys

    module_name, _, qualname = reference.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"{reference!r} is not a 'module:name' reference")
    if directory is not None and module_name not in sys.modules:
        source = _checkpoint_side_source(module_name.partition(".")[0], Path(directory).resolve())
        if source is not None:
            raise ImportError(f"{module_name} would be imported from {source}, beside or inside the checkpoint")
    found = importlib.import_module(module_name)
    for part in qualname.split("."):
        found = getattr(found, part)
    if not callable(found):
        raise ValueError(f"{reference} is not callable")
    return found


def _checkpoint_side_source(top_module: str, directory: Path) -> Path | None:
    """Where ``top_module`` would be imported from (its file, or a package's or namespace package's
    folders) when that is ``directory``, inside it, or a file or folder in one of the folders above
    it; else None. Finding the module imports nothing."""
    import importlib.util

    spec = importlib.util.find_spec(top_module)
    if spec is None:
        return None
    places = [Path(spec.origin)] if spec.origin and spec.has_location else []
    places += [Path(location) for location in spec.submodule_search_locations or ()]
    above = {directory, *directory.parents}
    for place in (p.resolve() for p in places):
        if place == directory or directory in place.parents or place.parent in above:
            return place
    return None


def _referenced(funcs) -> dict | None:
    """Reward functions, tools (or a rollout function) as ``module:name`` references that load
    imports, never unpickles; None where one is not importable under its name (a lambda, a loaded
    reward model: it must then be passed again). No functions at all: ``{"none": True, ...}``."""
    if funcs is None:
        return {"functions": [], "is_list": False, "none": True}
    is_list = isinstance(funcs, (list, tuple))
    references = []
    for func in funcs if is_list else [funcs]:
        module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
        if not module or not qualname or "<" in qualname:
            return None
        reference = f"{module}:{qualname}"
        try:
            if _import_reference(reference) is not func:
                return None
        except (AttributeError, ImportError, ValueError):
            return None
        references.append(reference)
    return {"functions": references, "is_list": is_list, "none": False}
