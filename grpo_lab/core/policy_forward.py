"""Scoring completion tokens under a policy: the one place that picks which forward pass runs.

A log-prob pass takes one of three paths (``pick_path``):

- ``plain``: one transformers forward call over ``[prompt, completion]`` rows
  (``grpo_lab.core.model_calls.full_forward``).
  Always available; the only path while a mixture-of-experts model's load-balancing loss is
  returned (that loss is over whole rows), and the one every speed path falls back to.
- ``shared_prompt``: each distinct prompt run once, its keys and values indexed out to its
  completions, then the completion tokens on top (``accel.prefix_sharing``, with
  ``share_prompt_prefix``), where the model's cache allows it.
- ``compact``: the distinct prompts and only the kept completion positions in one pass through the
  model's own modules (``accel.compact_forward``, with ``compact_forward`` as well), for the models
  that pass supports and right-padded completion masks.

The speed paths are imported on first use through the run's ``accel.SpeedPaths``. One that fails
against this transformers (``accel.TRANSFORMERS_CHANGED``) is turned off for the run, with one
warning, and the pick is made again, so the pass that runs is the one the setting's ``False`` gives.

Shapes: B completions, P prompt tokens (left padded), T completion tokens (right padded), N kept
completion tokens, V vocabulary entries.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from grpo_lab import notices, ops
from grpo_lab.accel import TRANSFORMERS_CHANGED, SpeedPaths
from grpo_lab.core.model_calls import full_forward, full_logits

PLAIN, SHARED_PROMPT, COMPACT = "plain", "shared_prompt", "compact"
_MODULES = {SHARED_PROMPT: "prefix_sharing", COMPACT: "compact_forward"}  # the speed path behind each


class TokenScores(NamedTuple):
    """What ``score_tokens`` returns."""

    logprobs_BT: torch.Tensor
    entropies_BT: torch.Tensor | None  # with with_entropy
    aux_loss: object  # with router_aux_loss: the model output's aux_loss (None where it returns none); else None


def right_padded(mask_BT: torch.Tensor) -> bool:
    """Whether every row of ``mask_BT`` is ones, then zeros."""
    return bool((mask_BT[:, 1:] <= mask_BT[:, :-1]).all())


def unpack(values_N: torch.Tensor, slots_N: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """(B, T) values: ``values_N`` at the flat positions ``slots_N``, zeros elsewhere (differentiable)."""
    return values_N.new_zeros(B * T).index_copy(0, slots_N, values_N).view(B, T)


def pick_path(model, completion_mask_BT, speed_paths: SpeedPaths, *, share_prompt_prefix: bool, compact_forward: bool,
              router_aux_loss: bool = False) -> str:
    """The path of a log-prob pass of ``model`` over completions masked by ``completion_mask_BT``:
    ``PLAIN``, ``SHARED_PROMPT`` or ``COMPACT`` (see the module's docstring). The compact pass runs
    over the shared prompts, so it needs ``share_prompt_prefix`` too."""
    if router_aux_loss or not share_prompt_prefix:
        return PLAIN
    sharing = speed_paths.prefix_sharing()
    if sharing is None or sharing.skip_reason(model) is not None:
        return PLAIN
    if compact_forward and speed_paths.compact_reason(model) is None and right_padded(completion_mask_BT):
        return COMPACT
    return SHARED_PROMPT


def completion_logits(model, prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT, *,
                      speed_paths: SpeedPaths, share_prompt_prefix: bool, compact_forward: bool,
                      router_aux_loss: bool = False, model_inputs: dict | None = None):
    """``(logits, slots_N, aux_loss)`` from the path ``pick_path`` picks: ``(logits_BTV, None, ...)``,
    or on the compact path ``(logits_NV, slots_N, None)``, the logits of the N completion tokens the
    mask keeps and their flat index into the (B, T) positions (``unpack`` spreads per-token values
    back). The paths' logits agree up to float rounding. ``aux_loss`` is the model's load-balancing
    loss with ``router_aux_loss`` (router logits on), else None. A vision-language model's image
    inputs (``model_inputs``) keep the pass on the plain path, the one that takes them."""
    rows = (model, prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT)
    if model_inputs is not None:
        share_prompt_prefix = False
    while True:
        path = pick_path(model, completion_mask_BT, speed_paths, share_prompt_prefix=share_prompt_prefix,
                         compact_forward=compact_forward, router_aux_loss=router_aux_loss)
        if path == PLAIN:
            break
        try:
            if path == COMPACT:
                return (*speed_paths.prefix_sharing().compact_logits(*rows), None)
            logits_BTV = speed_paths.prefix_sharing().shared_logits(*rows)
        except TRANSFORMERS_CHANGED as error:
            speed_paths.turn_off(_MODULES[path], error)
            continue
        if logits_BTV is not None:
            return logits_BTV, None, None
        break  # the model's cache cannot be shared (PrefixSharing warned, and keeps the model on the plain pass)
    if router_aux_loss:
        output = full_forward(*rows, output_router_logits=True, **(model_inputs or {}))
        return output.logits[:, :-1, :], None, getattr(output, "aux_loss", None)
    return full_logits(*rows, model_inputs), None, None


def score_tokens(model, prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT, *,
                 speed_paths: SpeedPaths, share_prompt_prefix: bool, compact_forward: bool, temperature: float,
                 with_entropy: bool, entropy_grad: bool = False, router_aux_loss: bool = False,
                 model_inputs: dict | None = None) -> TokenScores:
    """Per-token log-probs (and entropies, and with ``router_aux_loss`` a mixture-of-experts model's
    load-balancing loss) of the completions under ``model``, from the path ``pick_path`` picks.

    Logits are divided by the sampling ``temperature`` first, so the log-probs are those of the
    distribution the completions were sampled from (as TRL does). On the compact path only the kept
    tokens are scored, and the (B, T) results hold zeros after each completion's end. Entropies
    carry their gradient only with ``entropy_grad`` (for the entropy bonus). ``model_inputs``: a
    vision-language model's image inputs for these rows.
    """
    logits, slots_N, aux_loss = completion_logits(
        model, prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT, speed_paths=speed_paths,
        share_prompt_prefix=share_prompt_prefix, compact_forward=compact_forward, router_aux_loss=router_aux_loss,
        model_inputs=model_inputs,
    )
    if slots_N is not None:  # the kept tokens only, as one row
        logits, token_ids = logits.unsqueeze(0), completion_ids_BT.flatten().index_select(0, slots_N).unsqueeze(0)
    else:
        token_ids = completion_ids_BT
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = ops.selective_log_softmax(logits, token_ids)
    entropies = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropies = ops.entropy_from_logits(logits)
    if slots_N is None:
        return TokenScores(logprobs, entropies, aux_loss)
    spread = lambda values: unpack(values[0], slots_N, *completion_ids_BT.shape)  # noqa: E731
    return TokenScores(spread(logprobs), None if entropies is None else spread(entropies), aux_loss)


def note_compact_unsupported(model, speed_paths: SpeedPaths, *, compact_forward: bool, main_process: bool) -> None:
    """Warn (main process) when ``compact_forward`` is on but the compact pass cannot run ``model``."""
    reason = speed_paths.compact_reason(model) if compact_forward else None
    if reason is not None and "compact_forward" not in speed_paths.off and main_process:
        notices.warn(
            f"compact_forward is on, but grpo_lab's compact forward pass cannot run this model, so transformers' "
            f"slower forward pass runs instead: {reason}. Set compact_forward=False to silence this note."
        )


def note_speed_paths(policy, speed_paths: SpeedPaths, config, *, images: bool, main_process: bool) -> None:
    """Tell (main process) of a speed path that is on but cannot run the policy: the compact pass for
    a model it does not know (``note_compact_unsupported``); for a vision-language model (``images``),
    an info line of the ``grpo_lab`` logger that its passes take transformers' paths, as the speed
    paths (on by default, which a TRL user did not ask for) do not take images."""
    if not images:
        note_compact_unsupported(policy, speed_paths, compact_forward=config.compact_forward, main_process=main_process)
        return
    settings = [name for name in ("compact_forward", "share_prompt_prefix") if getattr(config, name)]
    if settings and main_process:
        logging.getLogger("grpo_lab").info(
            f"{' and '.join(settings)} {'are' if len(settings) > 1 else 'is'} on, but grpo_lab's speed paths do not "
            "take a vision-language model's images: generation runs model.generate and the log-prob passes "
            "transformers' forward, as TRL's do."
        )
