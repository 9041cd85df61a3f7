"""Tiny random vision-language models of two families TRL trains (LLaVA and Gemma 3), built from
configs with a processor assembled from the shipped tokenizer and the family's image processor:
offline fixtures for tests, demos and the notebook, a few hundred kilobytes of weights each.

    model, processor = tiny_vlm("llava")

The tokenizer is the shipped tiny model's, with the family's image tokens added; the chat template
is its ChatML template, which renders an image part as the family's image placeholder. Weights are
random (``seed``): the models learn, but know nothing of colours at the start.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llava", "gemma3")
TOKENIZER_DIR = Path(__file__).parent / "tiny_model"
IMAGE_SIZE = 28

_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "IMAGE{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=IMAGE_SIZE)


def _llava():
    from transformers import (
        AutoTokenizer, CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor,
    )

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR, extra_special_tokens={"image_token": "<image>"})
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=_TEMPLATE.replace("IMAGE", "<image>"))
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), **_TEXT),
        vision_config=dict(model_type="clip_vision_model", patch_size=14, **_VISION),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    return LlavaForConditionalGeneration(config), processor


def _gemma3():
    from transformers import (
        AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor,
    )

    tokens = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR, extra_special_tokens=tokens)
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4,
                                chat_template=_TEMPLATE.replace("IMAGE", "<start_of_image>"))
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), head_dim=8, sliding_window=64, **_TEXT),
        vision_config=dict(patch_size=7, **_VISION),
        mm_tokens_per_image=4, image_token_index=tokenizer.convert_tokens_to_ids(tokens["image_token"]),
        boi_token_index=tokenizer.convert_tokens_to_ids(tokens["boi_token"]),
        eoi_token_index=tokenizer.convert_tokens_to_ids(tokens["eoi_token"]),
    )
    model = Gemma3ForConditionalGeneration(config)
    # transformers starts the projector of image features at zero (a trained checkpoint overwrites it): a random
    # one lets the image reach the logits
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.2)
    return model, processor


def tiny_vlm(family: str = "llava", *, seed: int = 0):
    """``(model, processor)``: a random tiny vision-language model of ``family`` (one of :data:`FAMILIES`)
    and its processor. Save both with ``save_pretrained`` to get a directory a session loads by path."""
    builders = {"llava": _llava, "gemma3": _gemma3}
    if family not in builders:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}.")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model, processor = builders[family]()
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    return model, processor
