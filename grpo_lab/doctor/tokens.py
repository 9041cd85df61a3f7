"""The doctor's rules over the prompt and completion tokens: a chat template that leaves the
assistant header out of the prompts, an EOS token the model never emits, padding that a rollout
function's completions cannot be told from (pad == EOS), and stop strings that never matched.

:func:`chat_parts` reads what a chat template writes around an assistant turn by rendering a small
conversation; the rules are pure functions of token ids, texts and those parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_lab.doctor.findings import Finding
from grpo_lab.doctor.rules import EXAMPLES, clipped, share_text
from grpo_lab.doctor.thresholds import DEFAULTS, Thresholds

_MARKER = "GRPO_LAB_DOCTOR_MARKER"


@dataclass(frozen=True)
class ChatParts:
    """What the tokenizer's chat template writes: ``generation_prompt``, what ``add_generation_prompt=True``
    appends after the user's turn; ``assistant_header``, what precedes an assistant message's content
    (the generation prompt the template should produce); ``end_of_turn``, the first token after an
    assistant message's content (None where the template writes none)."""

    generation_prompt: str
    assistant_header: str
    end_of_turn: str | None


def chat_parts(tokenizer, chat_template_kwargs: dict | None = None) -> ChatParts | None:
    """The :class:`ChatParts` of ``tokenizer``'s chat template; None without a template, or where it
    cannot render a user turn followed by an assistant turn."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    user = [{"role": "user", "content": "1+1="}]

    def render(messages, generation: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation,
                                             **(chat_template_kwargs or {}))

    try:
        alone, prompted = render(user, False), render(user, True)
        answered = render([*user, {"role": "assistant", "content": _MARKER}], False)
    except Exception:  # a template that refuses these roles or needs other variables: nothing to compare
        return None
    generation_prompt = prompted[len(alone):] if prompted.startswith(alone) else ""
    before, found, after = answered.partition(_MARKER)
    header = before[len(alone):] if found and before.startswith(alone) else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after.strip() else []
    specials = set(tokenizer.all_special_ids)
    special = [token for token in ids if token in specials]
    end = special[0] if special else ids[0] if ids else None
    return ChatParts(generation_prompt, header, None if end is None else tokenizer.convert_ids_to_tokens(end))


def generation_prompt(parts: ChatParts | None, prompt_texts: list[str], *, conversational: bool) -> list[Finding]:
    """Conversational prompts that do not end with the template's generation prompt, or, where the
    template renders none, with the header it writes before an assistant message (the model is then
    asked to continue the user's turn); plain-text prompts given to a tokenizer whose template has
    such a header (info: right for a base model)."""
    expected = None if parts is None else parts.generation_prompt or parts.assistant_header
    if not (expected or "").strip():
        return []
    missing = [text for text in prompt_texts if not text.rstrip().endswith(expected.rstrip())]
    if not missing:
        return []
    tails = [repr(text[-60:]) for text in missing[:EXAMPLES]]
    evidence = {"prompts without the header": share_text(len(missing), len(prompt_texts)),
                "assistant header": expected, "prompt endings": tails}
    if not conversational:
        return [Finding(
            "prompts_without_chat_template", "info",
            "The prompts are plain text, which is tokenized as it is: the model does not see its chat template's "
            f"assistant header ({expected!r}). Right for a base model; a chat-tuned model may answer "
            "as if it continued the user's text.",
            evidence,
            "For a chat-tuned model give prompts as messages: {'prompt': [{'role': 'user', 'content': text}]}.",
        )]
    if parts.generation_prompt:
        cause = "they were rendered without add_generation_prompt=True (by a rollout function, or before the run)"
        fix = ("Render conversational prompts with tokenizer.apply_chat_template(messages, add_generation_prompt=True, "
               "tokenize=False), or give the dataset chat messages and let the session render them.")
    else:
        cause = "the chat template renders nothing for add_generation_prompt=True"
        fix = ("Use a chat template with a generation prompt block, e.g. end it with \"{% if add_generation_prompt %}"
               f"{expected}{{% endif %}}\" (tokenizer.chat_template = ...), and pass that tokenizer as "
               "processing_class.")
    return [Finding(
        "generation_prompt_missing", "warning",
        f"The prompts end after the user's turn, without the assistant header {expected!r} the "
        f"template writes before an assistant message: {cause}. The model must then write the header itself, and "
        "the reward and loss see it as part of the answer.",
        evidence,
        fix,
    )]


def eos_emitted(completion_ids_BT: torch.Tensor, generated_mask_BT: torch.Tensor, *, eos_ids: set[int],
                end_of_turn_id: int | None, names: dict[int, str], is_truncated_B: torch.Tensor,
                max_completion_length: int) -> list[Finding]:
    """No completion of the probe emitted an EOS id: an error where the template's end-of-turn token
    (another id) was emitted instead, since generation stops only at EOS; a warning otherwise."""
    tokens = completion_ids_BT.cpu()[generated_mask_BT.cpu().bool()]
    if len(tokens) == 0 or any(bool((tokens == eos).any()) for eos in eos_ids):
        return []
    shown = ", ".join(f"{names.get(i, i)!r} (id {i})" for i in sorted(eos_ids))
    evidence = {"EOS ids": shown, "truncated": share_text(int(is_truncated_B.sum()), len(is_truncated_B)),
                "max_completion_length": max_completion_length}
    turn_ends = 0 if end_of_turn_id is None or end_of_turn_id in eos_ids else int((tokens == end_of_turn_id).sum())
    if turn_ends:
        name = names.get(end_of_turn_id, end_of_turn_id)
        evidence[f"{name!r} (id {end_of_turn_id}) emitted"] = turn_ends
        return [Finding(
            "eos_never_emitted", "error",
            f"The model never emitted the EOS token generation stops at ({shown}); it ended its turns with {name!r}, "
            "the token the chat template closes an assistant message with. Every completion runs on to "
            "max_completion_length past its answer.",
            evidence,
            f"Set tokenizer.eos_token = {name!r} (or model.generation_config.eos_token_id = {end_of_turn_id}) before "
            "building the session, and pass that tokenizer as processing_class.",
        )]
    return [Finding(
        "eos_never_emitted", "warning",
        f"No completion of the probe emitted an EOS token ({shown}) within max_completion_length="
        f"{max_completion_length}: either the limit leaves no room to finish (see the truncation finding) or this "
        "model does not end its answers with that token.",
        evidence,
        "Check which token the model ends an answer with (session.completions_view(), or decode a completion with "
        "skip_special_tokens=False) and make it the tokenizer's eos_token; else raise max_completion_length.",
    )]


def pad_is_eos(pad_id: int | None, eos_ids: set[int], completion_ids_BT: torch.Tensor,
               generated_mask_BT: torch.Tensor, *, custom_rollout: bool) -> list[Finding]:
    """pad == EOS where it matters: a rollout function's completions, whose token lists are taken as
    returned, so padding it appends reads as an EOS and is trained on (generation by the backend cuts
    each completion after its first EOS, so there it does not matter)."""
    if pad_id is None or pad_id not in eos_ids or not custom_rollout:
        return []
    mask_BT = generated_mask_BT.cpu().bool()
    ids_BT = completion_ids_BT.cpu()
    lengths_B = mask_BT.sum(1)
    padded = 0
    for row, length in enumerate(lengths_B.tolist()):
        kept = ids_BT[row][mask_BT[row]]
        padded += length >= 2 and int(kept[-1]) == pad_id and int(kept[-2]) == pad_id
    return [Finding(
        "pad_is_eos", "warning" if padded else "info",
        f"The pad token is the EOS token (id {pad_id}), and a rollout function generates the completions: a "
        "completion it returns padded cannot be told from one that ended, so its padding counts as generated, "
        f"trained-on tokens. {padded} completion(s) of the probe end with two or more of that token.",
        {"pad_token_id": pad_id, "EOS ids": sorted(eos_ids), "completions ending in 2+ pad/EOS tokens": padded},
        "Give the tokenizer a pad token of its own (tokenizer.pad_token = '<|pad|>' if the vocabulary has one, or "
        "another unused special token), or make the rollout function return each completion without padding.",
    )]


def stop_strings(stops: list[str], completion_texts: list[str], *, stopped_early: int,
                 truncated_share: float, thresholds: Thresholds = DEFAULTS) -> list[Finding]:
    """Stop strings (``generation_kwargs['stop']`` for vLLM, ``['stop_strings']`` for transformers) that
    no completion of the probe contains and that ended no completion (``stopped_early``: completions
    that end without an EOS before max_completion_length, as a stop string leaves them). A
    warning where ``truncation_warning`` or more of the completions were truncated (the stop string
    was to end them), else info."""
    unmatched = [stop for stop in stops if not any(stop in text for text in completion_texts)]
    if not unmatched or stopped_early:
        return []
    return [Finding(
        "stop_never_matched", "warning" if truncated_share >= thresholds.truncation_warning else "info",
        f"The stop string(s) {unmatched} ended no completion of the probe: they do not occur in what this model "
        "writes (a stop string must match the generated text exactly, whitespace and case included).",
        {"stop strings": unmatched, "example completions": [clipped(t) for t in completion_texts[:EXAMPLES]]},
        "Compare the stop strings with the example completions; remove the ones the model never writes, or "
        "rely on the EOS token.",
    )]
