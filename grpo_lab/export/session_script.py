"""``export_session``: a script that trains like a session, with its current config, model, data,
reward functions and rollout function, tools or environment factory.

The data travels beside the script (``session_data``); the functions are imported or copied
(``functions``); the config is the session's difference from the defaults, which the command line
can override (``command_line``).
"""

from __future__ import annotations

import types
from pathlib import Path

from grpo_lab.credentials import Secrets
from grpo_lab.export.errors import ExportError
from grpo_lab.export.functions import is_importable, reward_function_code
from grpo_lab.export.local_imports import warn_local_imports
from grpo_lab.export.script_file import HEADER, check_script_target, writing
from grpo_lab.export.session_data import save_session_data


def export_session(session, path: str | Path) -> Path:
    """Write a script that trains like ``session``: its current config, model, data, rewards."""
    from grpo_lab import __version__

    path = Path(path)
    check_script_target(path, f"give session.export_script a file name, e.g. {path / 'train.py'}")
    engine = session.engine
    secrets = Secrets()
    imports, definitions, names, generation = _copied_functions(engine, secrets)
    rollout = [] if engine.rollout_func is None else [engine.rollout_func]
    environments = [] if engine.environments is None else list(engine.environments.factories.values())
    from grpo_lab.rollout.environments import user_reward_funcs  # torch: not loaded by `grpo-lab export`

    warn_local_imports([*user_reward_funcs(engine), *rollout, *(engine.tools or []), *environments], path)
    data_dir = path.with_suffix(".data")
    fields = session.config.diff()
    metric = fields.get("dynamic_sampling_metric")
    if callable(metric):  # the script imports or defines the function, and the config names it
        more_imports, more_definitions, (name,) = reward_function_code([metric], "Dynamic sampling metric", secrets)
        imports = sorted(set(imports) | set(more_imports))
        definitions += [d for d in more_definitions if d not in definitions]
        fields["dynamic_sampling_metric"] = _FunctionName(name)
    config = _config_source(fields, secrets)
    peft = ""
    if engine.is_peft:  # the adapter's config travels as adapter_config.json beside the data
        imports.append("from peft import PeftConfig")
        peft = "        peft_config=PeftConfig.from_pretrained(str(DATA / 'peft')),"
    model, model_imports = _model_source(engine.model_reference, secrets)
    imports += model_imports
    if secrets.values:
        imports = sorted(set(imports) | {"import os"})
    fix = "pass session.export_script a path in a folder you can write to"
    with writing(path, fix):
        path.parent.mkdir(parents=True, exist_ok=True)
        _save_data_or_nothing(engine, data_dir, secrets)
    body = _script_lines(
        header=HEADER.format(version=__version__, source=f"a GRPOSession at step {session.global_step}",
                             script=path.name),
        imports=imports, definitions=definitions, model=model, data_dir=data_dir, names=names, config=config,
        has_eval=engine.eval_dataset is not None, peft=peft, generation=generation,
    )
    with writing(path, fix):
        path.write_text("\n".join(body))
    secrets.warn(path)
    return path


def _save_data_or_nothing(engine, data_dir: Path, secrets: Secrets) -> None:
    """``save_session_data``; where it fails (a refused prompt column, a full disk) a ``data_dir`` that
    it created is removed again, so that no half-written copy is left (one that was there before is
    left as the failed write leaves it: export again)."""
    import shutil

    created = not data_dir.exists()
    try:
        save_session_data(engine, data_dir, secrets)
    except BaseException:
        if created:
            shutil.rmtree(data_dir, ignore_errors=True)
        raise


def _copied_functions(engine, secrets: Secrets) -> tuple[list[str], list[str], list[str], list[str]]:
    """(import lines, definitions, reward function names, the ``rollout_func=``, ``tools=`` and
    ``environment_factory=`` argument lines) that recreate the session's functions."""
    from grpo_lab.rollout.environments import user_reward_funcs

    imports, definitions, names = reward_function_code(user_reward_funcs(engine), secrets=secrets)
    generation = []
    for funcs, kind, argument in ((engine.rollout_func, "Rollout function", "rollout_func={}"),
                                  (engine.tools, "Tool", "tools=[{}]")):
        if funcs is not None:
            more_imports, more_definitions, more_names = reward_function_code(
                funcs if kind == "Tool" else [funcs], kind, secrets=secrets)
            imports = sorted(set(imports) | set(more_imports))
            definitions += [d for d in more_definitions if d not in definitions]
            generation.append(f"        {argument.format(', '.join(more_names))},")
    if engine.environments is not None:
        more_imports, argument = _environment_factory_code(engine.environments.factory)
        imports = sorted(set(imports) | set(more_imports))
        generation.append(argument)
    return imports, definitions, names, generation


def _environment_factory_code(factory) -> tuple[list[str], str]:
    """(import lines, the ``environment_factory=`` argument line) of a session's environment factory
    (or dict of them), which the script imports: an environment is a class with state and methods,
    which the script cannot rebuild from a notebook the way it copies a function."""
    named = factory if isinstance(factory, dict) else {None: factory}
    imports = []
    for each in named.values():
        if not isinstance(each, type | types.FunctionType) or not is_importable(each):
            raise ExportError(
                f"The environment factory {getattr(each, '__qualname__', each)!r} cannot be imported by the script "
                "(it is defined in a notebook, or is no module-level class or function). Move the environment class "
                "into a module file, import it from there and pass it as environment_factory."
            )
        imports.append(f"from {each.__module__} import {each.__name__}")
    if isinstance(factory, dict):
        argument = "{" + ", ".join(f"{name!r}: {each.__name__}" for name, each in factory.items()) + "}"
    else:
        argument = factory.__name__
    return imports, f"        environment_factory={argument},"


class _FunctionName(str):
    """A config value the script writes as a name it imports or defines, not as a string literal."""

    def __repr__(self) -> str:
        return str(self)


def _config_source(fields: dict, secrets: Secrets) -> str:
    """The session's config fields that differ from the defaults as a ``dict(...)`` expression; a
    value that holds a credential (``model_init_kwargs={"token": ...}``) reads the environment."""
    return "dict(\n" + "".join(
        f"    {k}={secrets.render(v, k, f'config {k}', optional=True)},\n" for k, v in sorted(fields.items())) + ")"


def _model_source(reference, secrets: Secrets) -> tuple[str, list[str]]:
    """The expression the script loads the model from, and the import lines it needs."""
    from grpo_lab.tasks import TINY_MODEL_DIR

    model = repr(reference)
    if isinstance(reference, str):
        model = secrets.render(reference, "model", "the model reference")
    if reference == str(TINY_MODEL_DIR):
        tiny = "str(TINY_MODEL_DIR)  # the tiny model shipped with grpo_lab"
        return tiny, ["from grpo_lab.tasks import TINY_MODEL_DIR"]
    return model, []


def _script_lines(*, header: str, imports: list[str], definitions: list[str], model: str, data_dir: Path,
                  names: list[str], config: str, has_eval: bool, peft: str, generation: list[str]) -> list[str]:
    """The lines of the session's script: the copied code, the settings, and ``main()``."""
    eval_dataset = "load_from_disk(str(DATA / " + repr("eval") + "))" if has_eval else "None"
    return [
        header,
        "from pathlib import Path\n",
        "from datasets import load_from_disk\n",
        "from grpo_lab import GRPOConfig",
        "from grpo_lab.export import cli_config",
        "from grpo_lab.core.models import load_tokenizer",
        "from grpo_lab import GRPOTrainer",
        *imports,
        "",
        *["\n" + d.rstrip() + "\n" for d in definitions],
        f"\nMODEL = {model}",
        f"DATA = Path(__file__).parent / {data_dir.name!r}  # the session's datasets (save_to_disk) and tokenizer",
        f"REWARD_FUNCS = [{', '.join(names)}]",
        f"# The session's config at export time (fields that differ from the defaults).\nCONFIG = {config}\n",
        "",
        "def main(argv=None):",
        "    config, resume_from = cli_config(GRPOConfig(**CONFIG), argv)",
        "    trainer = GRPOTrainer(",
        "        MODEL, REWARD_FUNCS, args=config,",
        "        processing_class=load_tokenizer(str(DATA / 'tokenizer'), trust_remote_code=config.trust_remote_code),",
        "        train_dataset=load_from_disk(str(DATA / 'train')),",
        f"        eval_dataset={eval_dataset},",
        *([peft] if peft else []),
        *generation,
        "    )",
        "    trainer.train(resume_from_checkpoint=resume_from)",
        "    trainer.save_model()",
        "    trainer.close()  # frees the model and ends the process group of an accelerate launch",
        "",
        "",
        'if __name__ == "__main__":',
        "    main()",
        "",
    ]
