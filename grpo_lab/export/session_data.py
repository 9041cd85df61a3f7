"""What an exported session script loads beside it, in ``<script>.data/``: the session's datasets
(``save_to_disk``), its tokenizer with what was set on it in the session, and a PEFT adapter's
config. An entry of the tokenizer's or adapter's JSON files that holds a credential is left out."""

from __future__ import annotations

from pathlib import Path

from grpo_lab.credentials import Secrets
from grpo_lab.core.stream_sampler import is_stream


def save_session_data(engine, data_dir: Path, secrets: Secrets) -> None:
    """Write the datasets, tokenizer and adapter config of ``engine`` into ``data_dir``."""
    if is_stream(engine.train_dataset):
        raise NotImplementedError(
            "export cannot carry a streamed train_dataset (an IterableDataset): the script would have no prompts. "
            "Export a session built on a datasets.Dataset, or edit the exported script to build the stream."
        )
    engine.train_dataset.save_to_disk(str(data_dir / "train"))
    if engine.eval_dataset is not None:
        engine.eval_dataset.save_to_disk(str(data_dir / "eval"))
    engine.tokenizer.save_pretrained(str(data_dir / "tokenizer"))  # with what was set on it in the session
    if engine.is_peft:
        engine.unwrapped_model.peft_config["default"].save_pretrained(str(data_dir / "peft"))
    for folder in ("tokenizer", "peft"):  # e.g. an api_key given to the tokenizer's from_pretrained
        secrets.scrub_json(data_dir / folder)
