"""Load the policy, its tokenizer and (when needed) a frozen reference model.

A model may be given as a local path or hub id (loaded with ``model_init_kwargs``) or as an
already-built ``PreTrainedModel``. Tokenizers are set to pad on the left, as generation requires,
and fall back to the EOS token for padding when they have no pad token (as TRL does).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from grpo_lab import notices

CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
"""transformers' name for a key/value cache, as an argument of ``forward``/``generate`` and a field of
their outputs: ``cache`` in releases that renamed it (5.24 has; the old name is deprecated there),
``past_key_values`` before."""

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def check_model_reference(name: str, *, model: bool = True, subfolder: str | None = None) -> None:
    """Raise a clear error, before any hub lookup, for a model that cannot be found or read.

    A name that is not an existing path must look like a hub id (``org/name``), and the hub must be
    reachable (``HF_HUB_OFFLINE`` unset). With ``model`` (not for a tokenizer, whose directory needs
    no config.json), a local directory (or its ``subfolder``) must hold a config.json (or a PEFT
    adapter's adapter_config.json) and no truncated .safetensors file.
    """
    path = Path(name).expanduser()
    if path.is_dir() and not (path / "config.json").exists() and (path / "model" / "config.json").exists():
        raise FileNotFoundError(
            f"{name} is a grpo_lab checkpoint or saved session, not a model directory: its model is in "
            f"{path / 'model'}. Pass that directory, or continue the run with resume_from_checkpoint / --resume_from."
        )
    if model and path.is_file():
        raise FileNotFoundError(
            f"{name} is a file; a model is the directory save_pretrained writes (config.json, the weights and the "
            f"tokenizer's files), or a hub id. Give the folder that holds it"
            f"{f' ({path.parent}, if those files are there)' if (path.parent / 'config.json').exists() else ''}."
        )
    if path.exists():
        if model and path.is_dir():
            check_model_files(path / subfolder if subfolder else path)
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes"}
    if offline or not _HUB_ID.fullmatch(name):
        where = "HF_HUB_OFFLINE is set, so the hub is not searched" if offline else "it is not a hub id either"
        raise FileNotFoundError(
            f"Model {name!r} does not exist as a local path ({where}). Give a directory written by "
            "save_pretrained (it holds config.json), a hub model id, or a PreTrainedModel instance."
        )


def check_model_files(directory: Path) -> None:
    """Refuse a local model directory that ``from_pretrained`` would fail on without saying why: one
    without config.json (nor adapter_config.json), or with a .safetensors file cut short."""
    if not (directory / "config.json").is_file() and not (directory / "adapter_config.json").is_file():
        held = sorted(entry.name for entry in directory.iterdir()) if directory.is_dir() else []
        listing = ", ".join(held[:8]) + (", ..." if len(held) > 8 else "") if held else "nothing"
        raise FileNotFoundError(
            f"{directory} holds no config.json (it holds {listing}), so it is not a model directory: "
            "from_pretrained reads the model's architecture from config.json. Copy the model's config.json into "
            "it, or give the directory that save_pretrained wrote (or a hub model id)."
        )
    for file in sorted(directory.glob("*.safetensors")):
        problem = safetensors_damage(file)
        if problem is not None:
            raise OSError(
                f"The weights file {file} is damaged: {problem}. It was most likely cut short by an interrupted "
                "download, copy or save. Download it again, or save the model again with save_pretrained."
            )


def safetensors_damage(file: Path) -> str | None:
    """What is wrong with a .safetensors file's framing (read from its header alone), or None: a file
    shorter than its header, a header that is not JSON, or tensors that end past the end of the file."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"it holds {size} bytes, too few for a safetensors header"
        header_size = int.from_bytes(head, "little")
        if 8 + header_size > size:
            return f"its header claims {header_size} bytes but the file holds {size}"
        try:
            header = json.loads(handle.read(header_size))
        except ValueError:
            return "its header is not valid JSON"
    if not isinstance(header, dict):
        return "its header is not valid JSON"
    ends = [entry["data_offsets"][1] for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets", ())) == 2]
    expected = 8 + header_size + max(ends, default=0)
    if expected > size:
        return f"its tensors need {expected} bytes but the file holds only {size}"
    return None


def load_tokenizer(name_or_path: str, **kwargs):
    """The tokenizer for ``name_or_path``, padding on the left, with a pad token; for a vision-language
    model's directory (one with a processor's settings), its processor, whose tokenizer is prepared."""
    check_model_reference(name_or_path, model=False)
    if any(os.path.isfile(os.path.join(name_or_path, file)) for file in PROCESSOR_FILES) or (
            not os.path.isdir(name_or_path) and _hub_vision_checkpoint(name_or_path, kwargs)):
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
        if getattr(processor, "image_processor", None) is not None:
            prepare_tokenizer(processor.tokenizer)
            return processor
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    return prepare_tokenizer(tokenizer)


def _hub_vision_checkpoint(name: str, kwargs: dict) -> bool:
    """Whether hub id ``name`` holds a vision-language model (False where it holds no model config: a
    tokenizer's repository)."""
    try:
        return is_vision_checkpoint(name, kwargs)
    except (OSError, ValueError):
        return False


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
"""Files a processor's ``save_pretrained`` writes beside the tokenizer's."""


def prepare_tokenizer(tokenizer):
    """Make a user-supplied tokenizer usable for generation: a pad token and left padding."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                "The tokenizer has neither a pad token nor an EOS token. Set tokenizer.pad_token "
                "(and tokenizer.eos_token) before building the session."
            )
        notices.warn("The tokenizer has no pad token; using its EOS token for padding, as TRL does.")
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.padding_side != "left":
        tokenizer.padding_side = "left"
    return tokenizer


def with_quantization(model, model_init_kwargs: dict, quantization_config) -> dict:
    """``model_init_kwargs`` for a policy given as a path, with the trainer's ``quantization_config``
    merged in (TRL's rule: refused where ``model_init_kwargs`` has one too; ignored, with TRL's
    warning, for a model given as an object)."""
    if quantization_config is None:
        return model_init_kwargs
    if not isinstance(model, (str, os.PathLike)):
        notices.log_warning("You passed `quantization_config` to the trainer, but your model is already instantiated. "
                            "The `quantization_config` will be ignored.")
        return model_init_kwargs
    if "quantization_config" in model_init_kwargs:
        raise ValueError("You set `quantization_config` both as a trainer argument and in `args.model_init_kwargs`. "
                         "Please set it in only one place, preferably as a trainer argument.")
    return {**model_init_kwargs, "quantization_config": quantization_config}


def load_causal_lm(model, model_init_kwargs: dict | None = None) -> PreTrainedModel:
    """A causal LM from a path / hub id (with ``model_init_kwargs``; a vision-language model through
    ``AutoModelForImageTextToText``) or the model itself (a ``PreTrainedModel``, or a PEFT model
    wrapping one)."""
    from peft import PeftModel

    if isinstance(model, (PreTrainedModel, PeftModel)):
        return model
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"model must be a path, a hub id, a PreTrainedModel or a PeftModel, got {type(model).__name__}."
        )
    name = str(model)
    check_model_reference(name, subfolder=(model_init_kwargs or {}).get("subfolder"))
    kwargs = model_init_kwargs or {}
    if is_vision_checkpoint(name, kwargs):  # a vision-language model, loaded as TRL loads one
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_pretrained(name, **kwargs)
    return AutoModelForCausalLM.from_pretrained(name, **kwargs)


HUB_KWARGS = ("trust_remote_code", "subfolder", "revision", "token", "cache_dir", "local_files_only",
              "force_download", "proxies")
"""The keyword arguments of ``from_pretrained`` that say where a model's files are (the others build it)."""


def is_vision_checkpoint(name: str, model_init_kwargs: dict | None = None) -> bool:
    """Whether the model at ``name`` (a directory or hub id) is a vision-language model: its config has
    a ``vision_config``. A directory holding a PEFT adapter answers for its base model."""
    kwargs = {key: value for key, value in (model_init_kwargs or {}).items() if key in HUB_KWARGS}
    folder = os.path.join(name, kwargs.get("subfolder") or "")
    if os.path.isfile(os.path.join(folder, "adapter_config.json")):
        from peft import PeftConfig

        name, kwargs = PeftConfig.from_pretrained(folder).base_model_name_or_path, {}
    return getattr(AutoConfig.from_pretrained(name, **kwargs), "vision_config", None) is not None


class Float32Head(torch.nn.Linear):
    """A linear output layer that computes in float32: its input is cast to float32 and autocast is
    off inside it, so logits come out in float32 whatever the dtype of the rest of the model and of
    mixed precision. ``cast_lm_head_to_fp32`` gives the LM head this class (its weights stay where
    they are, so state dicts and saved models keep their names)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        with torch.autocast(hidden.device.type, enabled=False):  # .float(): FSDP's mixed precision may cast the weights
            return F.linear(hidden.float(), self.weight.float(), bias)


def cast_lm_head_to_fp32(model) -> None:
    """The ScaleRL recipe's float32 LM head (arXiv:2510.13786): the output layer's weights in float32
    and its products computed in float32 (see :class:`Float32Head`), so the log-probs the loss and
    the importance ratios use carry no bfloat16 rounding of the logits. The output layer must be a
    plain linear layer. Tied to the input embeddings, as TRL allows, the shared weights become
    float32, and the embeddings' outputs are cast back to the dtype the rest of the model computes
    in, so that only the head's products change."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head, embeddings = base.get_output_embeddings(), base.get_input_embeddings()
    if head is None or type(head) not in (torch.nn.Linear, Float32Head):
        raise ValueError(
            f"cast_lm_head_to_fp32=True needs the model's output layer to be a plain torch.nn.Linear, and it is "
            f"{type(head).__module__}.{type(head).__qualname__}. If an adapter or a quantization wraps it, leave it "
            "out of the adapter's target_modules and of quantization; otherwise set cast_lm_head_to_fp32=False."
        )
    tied = embeddings is not None and head.weight is embeddings.weight
    dtype = head.weight.dtype
    head.float()
    head.__class__ = Float32Head
    if tied and dtype != torch.float32 and not getattr(embeddings, "_grpo_lab_output_dtype", None):
        embeddings._grpo_lab_output_dtype = dtype
        embeddings.register_forward_hook(_embeddings_in_model_dtype)


def _embeddings_in_model_dtype(module, args, output):
    """The output of float32 embeddings tied to a float32 head, in the model's own dtype."""
    return output.to(module._grpo_lab_output_dtype)


def keep_4bit_layers_differentiable(model) -> None:
    """Stop bitsandbytes' 4-bit layers from repacking their weights for its CPU inference kernel.

    On a CPU with AVX512-BF16, bitsandbytes (0.50) repacks a 4-bit layer's weights on its first
    eval-mode forward without gradients (a generation) and then runs every forward, training ones
    included, through a kernel that has no backward: no gradient reaches the layers below, and
    QLoRA trains only the adapters nearest the output. The policy keeps the format that trains.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def enable_gradient_checkpointing(model, kwargs: dict) -> None:
    """Turn on activation recomputation under the name this transformers version uses."""
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name (recent transformers 5 releases)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def config_settings(config) -> dict:
    """A model config's attributes, with those of the dicts and sub-configs nested in it (a
    multimodal model's ``text_config``...) merged in."""
    settings = dict(vars(config))
    for nested in list(settings.values()):
        if isinstance(nested, dict):
            settings.update(nested)
        elif hasattr(nested, "to_dict") and hasattr(nested, "model_type"):  # a sub-config
            settings.update(vars(nested))
    return settings


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config fields through which transformers' mixture-of-experts models give their number of experts."""


def routes_to_experts(model) -> bool:
    """Whether ``model``'s config (or a config nested in it) has more than one routed expert."""
    config = getattr(model, "config", None)
    settings = config_settings(config) if config is not None else {}
    return any(isinstance(settings.get(name), int) and settings[name] > 1 for name in _EXPERT_COUNTS)


def router_aux_loss_weight(model, coef: float | None) -> float:
    """The weight of a mixture-of-experts model's load-balancing loss (TRL's rule): ``coef``, or
    where that is None the model config's own ``router_aux_loss_coef`` (0 where it declares none);
    0 for a model whose config has no ``output_router_logits`` (not a mixture of experts returning
    router logits), for which a non-zero ``coef`` is refused."""
    text_config = model.config.get_text_config()
    if not hasattr(text_config, "output_router_logits"):
        if coef:
            raise ValueError(
                f"router_aux_loss_coef={coef} but {type(model).__name__} is not a mixture-of-experts model that "
                "returns router logits (its config has no output_router_logits), so there is no load-balancing "
                "loss to weight. Leave router_aux_loss_coef=None."
            )
        return 0.0
    return float(getattr(text_config, "router_aux_loss_coef", 0.0) or 0.0) if coef is None else float(coef)

