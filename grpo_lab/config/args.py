"""``GRPOConfig`` values written as text: the command line (``--field value`` overrides, parsed by
transformers' ``HfArgumentParser``), YAML files, and the normalisation that makes such values (and
Python ones such as paths and torch dtypes) what the checks expect and YAML can store.

``HfArgumentParser`` turns each config field into an option (``--max_steps`` and ``--max-steps``, a bare
``--flag`` for booleans, ``--no_flag`` for those that default to True, the field's help). Every value is
then read by :func:`parse_value`, as grpo_lab always has and as TRL's own command lines write them:
``none`` for None, JSON for dicts and lists, comma-separated lists, true/false/yes/no/on/off/1/0.
Options that are not given leave the base config's values alone, and every mistake is a ``ValueError``
that names the option (an unknown one with the closest field name), never argparse's exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import functools
import inspect
import json
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

from grpo_lab import notices
from grpo_lab.errors import ConfigError


def read_yaml_mapping(path, what: str = "GRPOConfig fields") -> dict[str, Any]:
    """The mapping a YAML file holds; malformed YAML or another kind of value is a ValueError that
    names the file (``what``: what the mapping should hold, for that message)."""
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} must hold a mapping of {what}, got {type(values).__name__}.")
    return values


def suggestion(config_class, name: str, prefix: str = "") -> str:
    """The end of an unknown-field message: the closest field name, else where every field is listed."""
    names = sorted(field.name for field in dataclasses.fields(config_class))
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?" if not prefix else f"; did you mean {prefix}{close[0]}?"
    return " (GRPOConfig.help_text() lists every field)."


# ---------------------------------------------------------------------- one value
@functools.cache
def _annotations(config_class) -> dict[str, Any]:
    """Field name -> its annotation as written (fields are declared on a base class)."""
    merged: dict[str, Any] = {}
    for klass in reversed(config_class.__mro__):
        merged.update(inspect.get_annotations(klass))
    return merged


@functools.cache
def _field_types(config_class) -> dict[str, tuple]:
    """Field name -> the types its annotation allows (``float | None`` -> ``(float, NoneType)``)."""
    hints = typing.get_type_hints(config_class)
    union = (typing.Union, types.UnionType)
    return {name: typing.get_args(hint) if typing.get_origin(hint) in union else (hint,)
            for name, hint in hints.items()}


def _list_of_numbers(config_class, name: str) -> bool:
    """Whether a list field holds numbers (``reward_weights``), not strings (``include_for_metrics``)."""
    return any(typing.get_origin(kind) is list and typing.get_args(kind) in ((float,), (int,))
               for kind in _field_types(config_class)[name])


def value_kind(config_class, name: str) -> str:
    """How a field's value is written as text: ``"dict"`` or ``"list"`` (JSON; lists also comma-separated)
    where the annotation allows one, else its first type (``"bool"``, ``"int"``, ``"float"`` or ``"str"``)."""
    allowed = _field_types(config_class).get(name, (str,))
    for container in (dict, list):
        if any(typing.get_origin(kind) is container for kind in allowed):
            return container.__name__
    return allowed[0].__name__ if allowed[0] in (bool, int, float) else "str"


def parse_value(config_class, name: str, raw: str):
    """A command-line string as the value of field ``name``."""
    kind, text = value_kind(config_class, name), raw.strip()
    if text.lower() in ("none", "null") and type(None) in _field_types(config_class)[name]:
        return None
    try:
        if kind == "bool":
            lowered = text.lower()
            if lowered in ("true", "yes", "1", "on"):
                return True
            if lowered in ("false", "no", "0", "off"):
                return False
            raise ValueError
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "dict":
            return json.loads(text)
        if kind == "list":
            if text.startswith("["):
                return json.loads(text)
            parts = [p.strip() for p in text.split(",") if p.strip()]
            if name == "report_to":
                return parts[0] if len(parts) == 1 else parts
            return [float(p) for p in parts] if _list_of_numbers(config_class, name) else parts
    except (ValueError, json.JSONDecodeError):
        annotation = str(_annotations(config_class)[name])
        shown = "" if annotation == kind else f" ({annotation})"
        hint = " Give it as JSON, e.g. '{\"name\": 1}'." if kind == "dict" else ""
        raise ConfigError(f"--{name}: cannot read {raw!r} as {kind}{shown}.{hint}") from None
    if name == "scale_rewards" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


# ---------------------------------------------------------------------- normalisation
_DICT_FIELDS = ("model_init_kwargs", "generation_kwargs", "chat_template_kwargs", "lr_scheduler_kwargs",
                "gradient_checkpointing_kwargs", "transformers_continuous_batching_config")

_STEPS_OR_FRACTION = {"warmup_steps", "logging_steps", "save_steps"}
"""Fields that take a whole number of steps or a fraction of the run below 1."""


def normalise(config) -> None:
    """Put ``config``'s values in the form the checks expect and YAML can store (see :func:`_plain`):
    JSON strings of dict fields parsed, TRL's spellings of ``pad_to_multiple_of`` and
    ``scale_rewards`` (True / False) read."""
    for name, value in config.to_dict().items():
        object.__setattr__(config, name, _plain(type(config), name, value))
    for name in _DICT_FIELDS:
        value = getattr(config, name)
        if isinstance(value, str):
            try:
                object.__setattr__(config, name, json.loads(value))
            except json.JSONDecodeError as error:
                raise ConfigError(f"{name} is not valid JSON ({error}): give a dict or a JSON object string.") from None
        if getattr(config, name) is not None and not isinstance(getattr(config, name), dict):
            raise ConfigError(f"{name} must be a dict (or a JSON object string), got {getattr(config, name)!r}.")
    multiple = config.pad_to_multiple_of
    if isinstance(multiple, str) and multiple != "auto":  # TRL's command-line spellings
        multiple = None if multiple.lower() in ("none", "null") else int(multiple) if multiple.isdigit() else multiple
        object.__setattr__(config, "pad_to_multiple_of", multiple)
    if multiple not in ("auto", None) and (not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1):
        raise ConfigError(f"pad_to_multiple_of must be an int >= 1, None or 'auto' (got {multiple!r}).")
    if config.scale_rewards is True:
        object.__setattr__(config, "scale_rewards", "group")
    elif config.scale_rewards is False:
        object.__setattr__(config, "scale_rewards", "none")


def _plain(config_class, name: str, value):
    """A value as YAML can store it and as the checks expect it: numbers written as strings (YAML 1.1
    reads ``1e-5`` as a string) parsed, whole floats for integer fields (and whole step counts of
    fields that also take a fraction, ``--warmup_steps 10``) made ints, paths and torch dtypes made
    strings."""
    kind = value_kind(config_class, name)
    if isinstance(value, str) and kind in ("int", "float") and value.strip().lower() not in ("none", "null"):
        try:
            value = parse_value(config_class, name, value)
        except ValueError:
            return value
    whole = isinstance(value, float) and value.is_integer()
    if whole and (kind == "int" or (name in _STEPS_OR_FRACTION and value >= 1)):
        return int(value)
    return _yaml_safe(value)


def _yaml_safe(value):
    if isinstance(value, dict):
        return {k: _yaml_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_yaml_safe(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    return value


_YAML_TYPES = (str, int, float, bool, type(None))


def function_reference(func) -> str:
    """How a config file names a function a config field holds (``dynamic_sampling_metric``): its
    ``module:qualified_name``, which ``GRPOSession.load`` imports again (a lambda or a function
    defined inside another one is written too, and a load then asks for it)."""
    return f"{getattr(func, '__module__', None)}:{getattr(func, '__qualname__', type(func).__qualname__)}"


def stored_value(value):
    """``value`` as a config file stores it, for values set on a config after it was checked (a
    ``torch.dtype`` in ``model_init_kwargs``, as TRL's scripts assign it): transformers' config objects
    (``BitsAndBytesConfig``, ``AcceleratorConfig``) as the dicts their ``to_dict()`` gives, which
    ``from_pretrained`` and the config read back, enums as their values, anything else YAML cannot
    hold as its text (with a warning), so that the file a checkpoint needs is always written."""
    value = _yaml_safe(value)
    if isinstance(value, dict):
        return {key: stored_value(item) for key, item in value.items()}
    if isinstance(value, list):
        return [stored_value(item) for item in value]
    if isinstance(value, enum.Enum):
        return stored_value(value.value)
    if callable(getattr(value, "to_dict", None)):
        return stored_value(value.to_dict())
    if not isinstance(value, _YAML_TYPES):
        notices.warn(f"A config value of type {type(value).__name__} is stored in config.yaml as its text, "
                     f"{str(value)!r}: a config loaded from that file gets the text.")
        return str(value)
    return value


# ---------------------------------------------------------------------- the command line
@functools.cache
def _parser(config_class):
    from transformers import HfArgumentParser

    class ConfigParser(HfArgumentParser):
        """``HfArgumentParser`` over the config's fields, each value read by ``parse_value`` and reported
        only when given; errors raise ``ValueError`` instead of exiting."""

        def add_argument(self, *names, **kwargs):
            if "help" in kwargs:
                kwargs["help"] = kwargs["help"].replace("%", "%%")
            name = kwargs.get("dest", names[0].removeprefix("--"))
            if name in _field_types(config_class) and kwargs.get("action") is None:
                for key in ("type", "nargs", "const", "default", "required"):
                    kwargs.pop(key, None)
                if value_kind(config_class, name) == "bool":
                    kwargs.update(nargs="?", const=True)  # a bare --flag means true
                kwargs["type"] = functools.partial(_read_option, config_class, name)
            if name in _field_types(config_class):
                kwargs["default"] = argparse.SUPPRESS  # absent options leave the base config's values
            return super().add_argument(*names, **kwargs)

        def error(self, message):
            raise ConfigError(message)

    parser = ConfigParser(config_class, add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--config", action="append", default=[])
    return parser


def _read_option(config_class, name: str, raw: str):
    try:
        return parse_value(config_class, name, raw)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _attach_dashed_values(argv: list[str]) -> list[str]:
    """``--name -0.5,1`` as ``--name=-0.5,1``: argparse reads a word that starts with '-' as an option
    unless it is a plain negative number, while only words that start with '--' name a field here."""
    joined: list[str] = []
    for word in argv:
        after_option = joined and joined[-1].startswith("--") and "=" not in joined[-1]
        if after_option and word.startswith("-") and not word.startswith("--"):
            joined[-1] += f"={word}"
        else:
            joined.append(word)
    return joined


def config_from_args(config_class, argv: list[str] | None = None, base=None):
    """``base`` (default: the defaults) with ``--field value`` overrides from ``argv`` (default: ``sys.argv``);
    see :meth:`GRPOConfig.from_args`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(config_class.help_text(base))
        raise SystemExit(0)
    try:
        given, unknown = _parser(config_class).parse_known_args(_attach_dashed_values(argv))
    except argparse.ArgumentError as error:
        option = (error.argument_name or "").split("/")[0]
        if error.message.startswith("expected"):
            raise ConfigError(f"{option} needs a value, e.g. {option} VALUE.") from None
        raise ConfigError(error.message) from None
    if unknown:
        if not unknown[0].startswith("--"):
            raise ConfigError(f"Unexpected argument {unknown[0]!r}: give config fields as --name value.")
        name = unknown[0][2:].partition("=")[0].replace("-", "_")
        raise ConfigError(f"Unknown option --{name}{suggestion(config_class, name, prefix='--')}")
    values = base.to_dict() if base is not None else {}
    for path in given.config:
        if not Path(path).is_file():
            raise ConfigError(f"--config {path}: no such file (give a YAML file of GRPOConfig fields).")
        values.update(read_yaml_mapping(path))
    values.update({name: value for name, value in vars(given).items() if name != "config"})
    return config_class(**values)
