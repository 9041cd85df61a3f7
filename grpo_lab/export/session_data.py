"""What an exported session script loads beside it, in ``<script>.data/``: the session's datasets
(``save_to_disk``), its tokenizer (a vision-language model's processor) with what was set on it in
the session, and a PEFT adapter's
config. An entry of the tokenizer's or adapter's JSON files that holds a credential is left out, and
so is a dataset column that holds one (a prompt column that does is refused)."""

from __future__ import annotations

from pathlib import Path

from grpo_lab.credentials import Secrets
from grpo_lab.credentials.recognition import contains_secret
from grpo_lab.export.errors import ExportError
from grpo_lab.core.stream_sampler import is_stream


def save_session_data(engine, data_dir: Path, secrets: Secrets) -> None:
    """Write the datasets, tokenizer and adapter config of ``engine`` into ``data_dir``."""
    if is_stream(engine.train_dataset):
        raise NotImplementedError(
            "export cannot carry a streamed train_dataset (an IterableDataset): the script would have no prompts. "
            "Export a session built on a datasets.Dataset, or edit the exported script to build the stream."
        )
    _without_secrets(engine.train_dataset, "train", secrets).save_to_disk(str(data_dir / "train"))
    if engine.eval_dataset is not None:
        _without_secrets(engine.eval_dataset, "eval", secrets).save_to_disk(str(data_dir / "eval"))
    # with what was set on it in the session; a vision-language model's processor, with its image settings
    engine.processing_class.save_pretrained(str(data_dir / "tokenizer"))
    if engine.is_peft:
        engine.unwrapped_model.peft_config["default"].save_pretrained(str(data_dir / "peft"))
    for folder in ("tokenizer", "peft"):  # e.g. an api_key given to the tokenizer's from_pretrained
        secrets.scrub_json(data_dir / folder)


def _without_secrets(dataset, split: str, secrets: Secrets):
    """``dataset`` without its columns that hold a credential in any row (judged by the column's name
    and the value's form, as config values are), each named in ``secrets``' warning. The prompt
    column is what the script trains on: one that holds a credential is refused. Only columns that
    hold text are read (images, audio and arrays are not decoded), a thousand rows at a time."""
    text_columns = [name for name, feature in dataset.features.items() if _holds_text(feature)]
    leaking: dict[str, int] = {}
    if text_columns:
        start = 0
        for batch in dataset.select_columns(text_columns).iter(batch_size=1000):
            for column in text_columns:
                if column not in leaking:
                    row = next((i for i, value in enumerate(batch[column]) if contains_secret(value, column)), None)
                    if row is not None:
                        leaking[column] = start + row
            start += len(batch[text_columns[0]])
    if "prompt" in leaking:
        raise ExportError(
            f"Row {leaking['prompt']} of the {split} dataset's prompt column holds what looks like a credential, "
            "which the export must not write. Remove it from the prompts (dataset.filter or dataset.map), build the "
            "session on that dataset, and export again."
        )
    for column, row in leaking.items():
        secrets.found.append((f"column {column!r} of the {split} dataset (row {row} first)",
                              "left out of its copy (a reward function that reads it must get it another way)"))
    return dataset.remove_columns(list(leaking)) if leaking else dataset


def _holds_text(feature) -> bool:
    """Whether a ``datasets`` feature is, or holds, strings (a chat's messages included)."""
    from datasets import Value

    if isinstance(feature, Value):
        return feature.dtype in ("string", "large_string")
    if isinstance(feature, dict):
        return any(_holds_text(inner) for inner in feature.values())
    if isinstance(feature, (list, tuple)):
        return any(_holds_text(inner) for inner in feature)
    inner = getattr(feature, "feature", None)  # Sequence, List, LargeList
    return inner is not None and _holds_text(inner)
