"""A sampling loop for Llama, Qwen2 and Qwen3 models, used in place of ``model.generate``.

At every decoding step ``model.generate`` runs transformers' general machinery around the model's
forward pass, itself wrapped (``grpo_lab.accel.compact_forward``), then its logits processors and
stopping criteria. This loop runs the compact forward pass with:

- each distinct prompt pre-filled once, its keys and values copied to its group's rows;
- keys and values written in place into buffers sized for the prompt and ``max_new_tokens``;
- tokens drawn as ``generate`` draws them: transformers' own warpers (temperature, top-k, top-p,
  min-p) in ``generate``'s order on float32 logits, ``torch.multinomial`` on the softmax (argmax
  without sampling), finished rows filled with padding, and an end once every row has finished.

Under one seed it draws the tokens ``model.generate`` draws (tests check it on the shipped model
for plain, warped and greedy settings), its logits being transformers' bitwise there. Where
``compact_forward`` takes a decoding step's products weight-first (weights of a MiB or more, on a
CPU), the logits differ by float rounding, and a draw can differ where two tokens tie that closely.
``unsupported_reason`` names what keeps a model or setting on ``model.generate``: the model
(``compact_forward.unsupported_reason``), or a generation setting beyond the warpers above
(repetition penalty, beams, stop strings, ...).

Shapes: B rows, U distinct prompts, P prompt positions, T completion positions, V vocabulary entries.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpo_lab.accel import compact_forward
from grpo_lab.accel.prefix_sharing import distinct_prompts
from grpo_lab.core.model_calls import position_ids


_SAMPLING_FIELDS = {
    "do_sample", "temperature", "top_k", "top_p", "min_p", "max_new_tokens", "max_length", "pad_token_id",
    "eos_token_id", "bos_token_id", "repetition_penalty", "use_cache",
}
"""Generation settings the loop honours (or, like max_length beside max_new_tokens, that do not
apply); any other set to something but None, False or transformers' default needs ``model.generate``."""


@functools.cache
def _global_defaults() -> dict[str, Any]:
    """transformers' values for the settings a generation config leaves unset (top_k=50, num_beams=1,
    ...), which ``generate`` applies after the model's own defaults; empty where a transformers
    release does not list them."""
    listed = getattr(GenerationConfig, "_get_default_generation_params", None)
    return dict(listed()) if listed is not None else {}


def effective_settings(model, generation_config: GenerationConfig) -> dict[str, Any]:
    """The settings ``model.generate`` samples with: ``generation_config``'s, then for those it leaves
    unset (None) the model's own generation defaults, then transformers' (``generate`` merges them
    in that order)."""
    settings = dict(vars(generation_config))
    model_defaults = getattr(model, "generation_config", None)
    for defaults in (vars(model_defaults) if model_defaults is not None else {}, _global_defaults()):
        for name, value in defaults.items():
            if settings.get(name) is None:
                settings[name] = value
    return settings


def unsupported_reason(model, generation_config: GenerationConfig) -> str | None:
    """Why the loop cannot stand in for ``model.generate`` here, or None when it can."""
    reason = compact_forward.unsupported_reason(model)
    if reason is not None:
        return reason
    settings = effective_settings(compact_forward.transformers_model(model), generation_config)
    defaults = _global_defaults()
    others = sorted(
        name for name, value in settings.items()
        if not name.startswith("_") and name not in _SAMPLING_FIELDS and name != "transformers_version"
        and value is not None and value is not False and value != defaults.get(name)
    )
    if others:
        return f"the generation settings {', '.join(others)} need model.generate"
    unset = [name for name in ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p")
             if settings[name] is None]
    if unset:
        return f"{', '.join(unset)} unset: model.generate applies its own defaults"
    if (settings["repetition_penalty"] or 1.0) != 1.0:
        return "repetition_penalty needs model.generate"
    if settings["use_cache"] is False:
        return "use_cache=False asks model.generate to recompute every step"
    return None


def warpers(settings: dict[str, Any]) -> LogitsProcessorList:
    """The logits warpers ``model.generate`` applies when sampling with ``settings``, in its order."""
    processors = LogitsProcessorList()
    if not settings["do_sample"]:
        return processors
    temperature, top_k, top_p, min_p = (settings[name] for name in ("temperature", "top_k", "top_p", "min_p"))
    if temperature is not None and temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        processors.append(TopKLogitsWarper(top_k=top_k))
    if top_p is not None and top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=top_p))
    if min_p is not None:
        processors.append(MinPLogitsWarper(min_p=min_p))
    return processors


@torch.no_grad()
def sample(
    model, prompt_ids_BP: torch.Tensor, prompt_mask_BP: torch.Tensor, generation_config: GenerationConfig,
    *, share_prompts: bool = True,
) -> torch.Tensor:
    """(B, T) completion tokens (T <= max_new_tokens), padded after each row's first EOS, drawn as
    ``model.generate`` draws them. The caller checks ``unsupported_reason`` first and puts the
    model in eval mode.

    With ``share_prompts``, each distinct prompt row is pre-filled once.
    """
    settings = effective_settings(compact_forward.transformers_model(model), generation_config)
    process = warpers(settings)
    eos = settings["eos_token_id"]
    eos_ids = torch.tensor(
        eos if isinstance(eos, list) else [] if eos is None else [eos], dtype=torch.long, device=prompt_ids_BP.device
    )
    B, P = prompt_ids_BP.shape
    max_new = settings["max_new_tokens"]
    if share_prompts:
        first_U, inverse_B = distinct_prompts(prompt_ids_BP, prompt_mask_BP)
    else:
        first_U = inverse_B = torch.arange(B, device=prompt_ids_BP.device)
    valid_BS = torch.cat([prompt_mask_BP.bool(), prompt_mask_BP.new_ones(B, max_new, dtype=torch.bool)], dim=1)
    positions_BP = position_ids(prompt_mask_BP)
    cache = compact_forward.new_cache(model)
    logits_BV = compact_forward.forward(
        model, prompt_ids_BP[first_U], positions_BP[first_U], valid_BS[first_U], cache, 0, last_only=True
    ).index_select(0, inverse_B)
    cache = compact_forward.select_rows(cache, inverse_B)
    # generate pads finished rows with pad_token_id, or without one with the first EOS id
    pad = settings["pad_token_id"] if settings["pad_token_id"] is not None else int(eos_ids[0]) if len(eos_ids) else 0
    tokens_BT = prompt_ids_BP.new_full((B, max_new), pad)
    finished_B = torch.zeros(B, dtype=torch.bool, device=prompt_ids_BP.device)
    next_position_B1 = positions_BP[:, -1:] + 1
    for step in range(max_new):
        scores_BV = process(tokens_BT[:, :step], logits_BV.float())
        if settings["do_sample"]:
            token_B = torch.multinomial(torch.softmax(scores_BV, dim=-1), num_samples=1).squeeze(1)
        else:
            token_B = scores_BV.argmax(dim=-1)
        tokens_BT[:, step] = torch.where(finished_B, pad, token_B)
        finished_B |= torch.isin(tokens_BT[:, step], eos_ids)
        if step == max_new - 1 or bool(finished_B.all()):
            break
        logits_BV = compact_forward.forward(
            model, tokens_BT[:, step : step + 1], next_position_B1 + step, valid_BS, cache, P + step, last_only=True
        )
    return tokens_BT[:, : step + 1]
