"""Credentials kept out of every copy of a run's config that leaves the process: ``config.yaml`` in
saves and checkpoints, the applied config in ``trainer_state.pt``, ``training_args.bin``, and the
config sent to trackers (wandb, MLflow, Comet, TensorBoard).

A value is a credential by name and form (:func:`grpo_lab.credentials.recognition.secret_in`): a
Hugging Face token in ``model_init_kwargs["token"]``, ``hub_token``, an ``api_key`` or ``password``
in a nested mapping, or anything shaped like a known key (``hf_...``, ``sk-...``). A field holding one
is written as None and a mapping entry holding one is left out, so that a loaded or resumed run asks
its library for the credential afresh (transformers and huggingface_hub read ``HF_TOKEN`` and the
cached login); the run itself keeps the values it was given.
"""

from __future__ import annotations

from grpo_lab import notices
from grpo_lab.credentials.recognition import secret_in

_said: set[str] = set()  # the entries already named in a warning, once per process


def without_secrets(values: dict) -> tuple[dict, list[str]]:
    """``values`` (a config's ``to_dict()``) without its credentials, and the names of the entries
    dropped (``model_init_kwargs['token']``, ``hub_token``): a top-level field holding one becomes
    None, an entry of a mapping or a list holding one is left out."""
    dropped: list[str] = []

    def kept(value, name: str | None, path: str):
        if isinstance(value, dict):
            return {key: kept(item, key if isinstance(key, str) else name, f"{path}[{key!r}]")
                    for key, item in value.items() if not _is_secret(item, key if isinstance(key, str) else name,
                                                                      f"{path}[{key!r}]", dropped)}
        if isinstance(value, (list, tuple)):
            return type(value)(kept(item, name, f"{path}[{i}]") for i, item in enumerate(value)
                               if not _is_secret(item, name, f"{path}[{i}]", dropped))
        return value

    clean = {name: None if _is_secret(value, name, name, dropped) else kept(value, name, name)
             for name, value in values.items()}
    return clean, dropped


def _is_secret(value, name: str | None, path: str, dropped: list[str]) -> bool:
    if isinstance(value, str) and secret_in(value, name) is not None:
        dropped.append(path)
        return True
    return False


def shareable(values: dict) -> dict:
    """:func:`without_secrets`, saying once per entry what was left out and how a loaded run gets it."""
    clean, dropped = without_secrets(values)
    new = [name for name in dropped if name not in _said]
    if new:
        _said.update(new)
        notices.warn(
            f"{', '.join(new)} {'holds a credential' if len(new) == 1 else 'hold credentials'}, which grpo_lab "
            "never writes to a save, a checkpoint, training_args.bin or a tracker: the files hold None (or no entry) "
            "there. A run loaded or resumed from them reads the credential where its library looks for one (for a "
            "Hugging Face token: HF_TOKEN, or `hf auth login`), or pass it again in args."
        )
    return clean
