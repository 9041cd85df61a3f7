"""Prompts with images, for vision-language models: TRL's dataset formats, the processor's outputs per
prompt, and the model inputs of a batch.

A training row gives its images in an ``image`` column (one image or None) or an ``images`` column
(a list), as TRL reads them; its prompt is a list of chat messages. Before rendering, the images'
placeholders (``{"type": "image"}``) are put at the start of the first user message, as TRL's
``prepare_multimodal_messages`` does, and the model's processor renders the text and turns the
images into the model's inputs: the pixel values and whatever else the family takes (image sizes,
grids), and per-token fields such as Gemma 3's ``token_type_ids``.

Each prompt's processor outputs are kept apart (:class:`ImageInputs`), so that any subset of a
batch (a micro-batch of the loss, a log-prob pass) gets its own inputs by concatenating its rows':
image tensors along their first dimension (one entry per image, or per patch for the families
that flatten patches), per-token fields left-padded like the prompt tokens and extended with zeros
over the completion.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from grpo_lab.chat import is_conversational

IMAGE_COLUMNS = ("images", "image")
"""The dataset columns that hold a row's images, in the order TRL looks for them."""


@dataclass
class ImageInputs:
    """One prompt's processor outputs besides its token ids."""

    image_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensors with one leading entry per image (or patch): ``pixel_values``, ``image_sizes``, ..."""
    token_fields: dict[str, torch.Tensor] = field(default_factory=dict)
    """(P_i,) tensors with one value per prompt token: ``token_type_ids``, ``mm_token_type_ids``."""


def is_vision_processor(processing_class) -> bool:
    """Whether ``processing_class`` is a processor that takes images (a ``ProcessorMixin`` with an
    image processor), not a tokenizer."""
    from transformers import ProcessorMixin

    if not isinstance(processing_class, ProcessorMixin):
        return False
    return getattr(processing_class, "image_processor", None) is not None


def is_vision_model(model) -> bool:
    """Whether ``model`` (a model or its config) has a vision part."""
    config = getattr(model, "config", model)
    return getattr(config, "vision_config", None) is not None


def image_column(column_names) -> str | None:
    """The column that holds the rows' images (``images`` before ``image``, as TRL), or None."""
    names = list(column_names or [])
    return next((name for name in IMAGE_COLUMNS if name in names), None)


def row_images(columns: dict[str, list], column: str | None, rows: int) -> list[list]:
    """Each row's images (a list, empty for a row without) from ``columns``' ``column``."""
    if column is None:
        return [[] for _ in range(rows)]
    if column == "image":
        return [[] if image is None else [image] for image in columns[column]]
    return [list(images or []) for images in columns[column]]


def _is_image(value) -> bool:
    from PIL import Image

    return isinstance(value, Image.Image)


def image_problem(value, column: str) -> str | None:
    """Why ``value`` cannot be the ``column`` of a row, or None when it can."""
    values = [value] if column == "image" else value
    if column == "images" and value is not None and not isinstance(value, (list, tuple)):
        return f"has type {type(value).__name__}, not a list of images (or None)"
    for position, image in enumerate(values or []):
        if image is None and column == "image":
            continue
        if not _is_image(image):
            where = "" if column == "image" else f" (item {position})"
            return f"holds a {type(image).__name__}{where}, not an image ({str(image)[:40]!r})"
    return None


def check_image_rows(dataset, name: str = "train_dataset") -> None:
    """Refuse, naming the row and the fix, a row whose image column holds something else than images
    (PIL images; a ``datasets.Image`` feature decodes to them) or whose prompt is not conversational
    (the images are placed in its first user message, as TRL requires)."""
    import datasets

    column = image_column(dataset.column_names)
    if column is None:
        return
    feature = dataset.features.get(column) if isinstance(dataset, datasets.Dataset) else None
    declared = isinstance(feature, datasets.Image) or isinstance(getattr(feature, "feature", None), datasets.Image)
    rows = dataset.with_format(None) if isinstance(dataset, datasets.Dataset) else dataset
    values = None if declared else rows[column]  # a declared feature holds images: decoded only where needed
    for row, prompt in enumerate(rows["prompt"]):
        images = None if declared else values[row]
        if not is_conversational(prompt):
            raise ValueError(
                f"{name} row {row}: the prompt is not a list of chat messages, but the rows have images "
                f"(column {column!r}). Training on images needs conversational prompts, as in TRL: give "
                "[{'role': 'user', 'content': ...}] and let the processor's chat template place the images."
            )
        problem = None if declared else image_problem(images, column)
        if problem is not None:
            feature = "datasets.Image()" if column == "image" else "datasets.Sequence(datasets.Image())"
            raise ValueError(
                f"{name} row {row}: the {column!r} column {problem}. Give PIL images"
                f"{', or None for a row without one' if column == 'image' else ''}; a column of image file paths "
                f"becomes one with {name} = {name}.cast_column({column!r}, {feature}). Else repair or drop the row."
            )
        placed = image_placeholders(prompt)
        room = any(message["role"] == "user" and isinstance(message.get("content"), str) for message in prompt)
        if placed or not room:  # the images must match the placeholders, or have a user text to go before
            given = len(row_images({column: [rows[row][column] if declared else images]}, column, 1)[0])
            if given and placed != given:
                where = (f"places {placed} image(s) ({{'type': 'image'}} parts)" if placed else
                         "places no image and has no user message given as a string to put them before")
                raise ValueError(
                    f"{name} row {row}: the prompt {where}, but the row has {given} in its {column!r} column. Give "
                    "one {'type': 'image'} part per image, or none and a user message whose content is a string "
                    "(the images then go before its text, as TRL places them)."
                )


def check_vision_parts(processing_class, model, column: str | None, name: str = "train_dataset") -> None:
    """Refuse images given to a text-only model or a processing class that cannot take them."""
    if column is None:
        return
    if not is_vision_model(model):  # first: no processor would make a text model take images
        raise ValueError(
            f"{name} has an {column!r} column, but the model ({type(model).__name__}) is a text-only model (its "
            "config has no vision_config). Train a vision-language model (AutoModelForImageTextToText), or remove "
            f"the column: {name} = {name}.remove_columns({column!r})."
        )
    if not is_vision_processor(processing_class):
        raise ValueError(
            f"{name} has an {column!r} column, but processing_class is a {type(processing_class).__name__}, which "
            "cannot take images. Pass the model's processor: processing_class=AutoProcessor.from_pretrained(...)."
        )


def check_image_training(processing_class, policy, config, datasets: list[tuple[str, object, bool]],
                         custom: dict) -> None:
    """Refuse images a run cannot train on, naming the row or setting and the fix: in each of
    ``datasets`` (``(name, dataset, whether its rows are read now)``), an image column given with a
    tokenizer or a text-only ``policy`` (:func:`check_vision_parts`), a row whose images are not
    images or whose prompt is not chat messages (:func:`check_image_rows`); and, for a vision-language
    model's processor, the settings that do not take images: continuous batching, one-step-off
    generation, and the rollout function, tools or environment factory given (``custom``, by name)."""
    for name, dataset, read_rows in datasets:
        column = image_column(None if dataset is None else getattr(dataset, "column_names", None))
        check_vision_parts(processing_class, policy, column, name)
        if column is not None and read_rows:
            check_image_rows(dataset, name)
    if not is_vision_processor(processing_class):
        return
    unsupported = [(f"{setting}=True", f"{setting}=False") for setting in
                   ("use_transformers_continuous_batching", "async_generation") if getattr(config, setting)]
    unsupported += [(setting, f"no {setting}") for setting, given in custom.items() if given]
    if unsupported:
        setting, fix = unsupported[0]
        raise ValueError(
            f"{setting} does not take a vision-language model's images in grpo_lab yet (processing_class is a "
            f"{type(processing_class).__name__}). Train it with transformers' generation: {fix}."
        )


def image_placeholders(messages: list[dict]) -> int:
    """How many ``{"type": "image"}`` parts the messages' contents hold already."""
    return sum(isinstance(part, dict) and part.get("type") == "image"
               for message in messages if isinstance(message.get("content"), list) for part in message["content"])


def multimodal_messages(messages: list[dict], images: list) -> list[dict]:
    """``messages`` with one ``{"type": "image"}`` part per image before the text of the first user
    message whose content is a string (TRL's placement), unless they place the images themselves
    (placeholders in their contents, filled in order); other string contents become text parts."""
    placed = not images or image_placeholders(messages) > 0
    result = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if message["role"] == "user" and not placed:
                parts = [{"type": "image"} for _ in images] + parts
                placed = True
            message = {**message, "content": parts}
        result.append(message)
    if not placed:
        raise ValueError(
            f"A prompt has {len(images)} image(s) but no {{'type': 'image'}} part and no user message given as a "
            "string to put them before: place them with {'type': 'image'} parts, one per image."
        )
    return result


VISION_COUNT_ROWS = 2_000
"""Datasets of a vision-language model up to this many rows have every prompt processed with its
images and counted when the session is built (image tokens included); larger ones a generation
batch at a time, as it is drawn."""


def prompt_lengths(processor, prompts: list, images: list[list], chat_template_kwargs: dict | None = None, *,
                   rows: list[int] | None = None, dataset: str = "train_dataset") -> list[int]:
    """Each prompt's token count with its images, as generation gives them to the model (the image
    tokens included); a prompt that cannot be rendered is refused naming its row of ``dataset``."""
    from grpo_lab.rollout.prompts import prompt_problem

    rows = list(range(len(prompts))) if rows is None else rows
    for row, prompt, row_given in zip(rows, prompts, images, strict=True):
        problem = prompt_problem(prompt, image_parts=True) or image_problem(row_given, "images")
        if problem is not None:
            raise ValueError(f"{dataset} row {row}: the prompt {problem}. Repair or drop the row.")
    ids, _ = processed_prompts(processor, prompts, images, chat_template_kwargs)
    return [len(row_ids) for row_ids in ids]


_counted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each dataset's prompt lengths with its images, by what decides them (:func:`_processing_key`): a
session built again on the same dataset object (a fork) does not process every image again."""


def _processing_key(processor, chat_template_kwargs: dict | None):
    """What decides a prompt's length besides the row: the tokenizer's (``prompts.counting_key``), the
    image processor's settings and the processor's chat template; None where it cannot be told."""
    from grpo_lab.rollout.prompts import counting_key

    text = counting_key(processor.tokenizer, chat_template_kwargs)
    return None if text is None else (text, processor.image_processor.to_json_string(), str(processor.chat_template))


def dataset_prompt_lengths(processor, dataset, chat_template_kwargs: dict | None = None,
                           name: str = "train_dataset") -> list[int]:
    """:func:`prompt_lengths` of every row of ``dataset`` (a ``datasets.Dataset``), kept for the next
    session built on the same dataset object with the same processor settings."""
    key = _processing_key(processor, chat_template_kwargs)
    kept = None if key is None else _counted.setdefault(dataset, {})
    if kept is not None and key in kept:
        return list(kept[key])
    rows = dataset.with_format(None)
    column = image_column(dataset.column_names)
    images = row_images({column: rows[column]} if column else {}, column, len(rows))
    lengths = prompt_lengths(processor, list(rows["prompt"]), images, chat_template_kwargs, dataset=name)
    if kept is not None:
        kept[key] = lengths
    return list(lengths)


def processed_prompts(processor, prompts: list, images: list[list], chat_template_kwargs: dict | None = None,
                      ) -> tuple[list[list[int]], list[ImageInputs]]:
    """``(token ids, image inputs)`` of each prompt with its images, from ``processor``, as TRL renders
    them for a vision-language model: chat messages through the processor's chat template, with the
    images' placeholders, which the processor expands to the model's image tokens; a plain-text
    prompt (a row without images) as it is. A prompt equal to the one before it with the same images
    (the copies of a group) reuses that result."""
    ids_B, inputs_B = [], []
    for position, (prompt, prompt_images) in enumerate(zip(prompts, images, strict=True)):
        if position > 0 and prompt == prompts[position - 1] and prompt_images == images[position - 1]:
            ids_B.append(ids_B[-1])
            inputs_B.append(inputs_B[-1])
            continue
        text = rendered_prompt(processor, prompt, prompt_images, chat_template_kwargs)
        output = processor(text=[text], images=[prompt_images] if prompt_images else None, return_tensors="pt",
                           add_special_tokens=False)
        ids = output["input_ids"][0]
        inputs = ImageInputs()
        for key, value in output.items():
            if key in ("input_ids", "attention_mask") or not isinstance(value, torch.Tensor):
                continue
            if value.dim() == 2 and value.shape == output["input_ids"].shape:
                inputs.token_fields[key] = value[0]
            else:
                inputs.image_tensors[key] = value
        ids_B.append(ids.tolist())
        inputs_B.append(inputs)
    return ids_B, inputs_B


def rendered_prompt(processor, prompt, images: list, chat_template_kwargs: dict | None = None) -> str:
    """A prompt's text before the processor expands it: chat messages through the processor's chat
    template, with one placeholder per image; a plain-text prompt (a row without images) as it is."""
    if isinstance(prompt, str):
        return prompt
    return processor.apply_chat_template(multimodal_messages(prompt, images), tokenize=False,
                                         add_generation_prompt=True, **(chat_template_kwargs or {}))


def engine_prompts(processor, prompts: list, images: list[list], chat_template_kwargs: dict | None = None
                   ) -> list[dict]:
    """The prompts as vLLM takes a vision-language model's (its ``TokensPrompt``):
    ``{"prompt_token_ids": ids, "multi_modal_data": {"image": [images]}}``, the ids those of the text
    the processor renders, tokenized without special tokens (as :func:`processed_prompts` does), with
    one placeholder per image unexpanded (vLLM's own processor expands them); ``{"prompt_token_ids":
    ids}`` for a row without images. The copies of a group are one object."""
    requests: list[dict] = []
    for position, (prompt, prompt_images) in enumerate(zip(prompts, images, strict=True)):
        if position > 0 and prompt == prompts[position - 1] and prompt_images == images[position - 1]:
            requests.append(requests[-1])
            continue
        text = rendered_prompt(processor, prompt, prompt_images, chat_template_kwargs)
        request = {"prompt_token_ids": processor.tokenizer(text, add_special_tokens=False)["input_ids"]}
        if prompt_images:
            request["multi_modal_data"] = {"image": list(prompt_images)}
        requests.append(request)
    return requests


def model_inputs(rows: list[ImageInputs], prompt_mask_BP: torch.Tensor, completion_width: int = 0, *,
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's extra inputs for a batch of B rows whose prompts are ``rows``' (left padded to P
    tokens: ``prompt_mask_BP``), each followed by T = ``completion_width`` completion tokens: every
    image tensor concatenated over the rows along its first dimension, ``(N, ...)`` for the rows'
    N images (or patches), floating ones cast to ``dtype``; every per-token field ``(B, P + T)``, each
    row's values at its prompt's tokens and zeros on the padding and the completion. On
    ``prompt_mask_BP``'s device. Refuses image tensors whose shapes past the first dimension differ
    between prompts (families that pad each processor call's images to its widest, such as
    LLaVA-NeXT's tiles), which concatenating would misalign."""
    device = prompt_mask_BP.device
    inputs: dict[str, torch.Tensor] = {}
    for key in dict.fromkeys(key for row in rows for key in row.image_tensors):
        parts = [row.image_tensors[key] for row in rows if key in row.image_tensors]
        shapes = {tuple(part.shape[1:]) for part in parts}
        if len(shapes) > 1:
            raise ValueError(
                f"The processor gave prompts {key!r} of different shapes past their first dimension "
                f"({sorted(shapes)[:2]}), which grpo_lab cannot put in one batch: this model family pads images "
                "per processor call. Give images of one size (resize them in the dataset) to train it."
            )
        value = torch.cat(parts).to(device)
        inputs[key] = value.to(dtype) if dtype is not None and value.is_floating_point() else value
    B, P = prompt_mask_BP.shape
    for key in dict.fromkeys(key for row in rows for key in row.token_fields):
        kind = next(row.token_fields[key].dtype for row in rows if key in row.token_fields)
        values_BL = torch.zeros(B, P + completion_width, dtype=kind, device=device)
        for b, row in enumerate(rows):
            if key in row.token_fields:
                values = row.token_fields[key]
                values_BL[b, P - len(values):P] = values.to(device)
        inputs[key] = values_BL
    return inputs


def image_token_id(model) -> int | None:
    """The id of the token the model's image features take the place of (never to be sampled)."""
    config = getattr(model, "config", model)
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return None
