"""One optimizer step's loss, gradients and logged metrics from grpo_lab's loss stage and from TRL
1.16's ``GRPOTrainer._compute_loss``, on identical tensors.

Both sides get the same per-token log-probs and entropies (functions of two parameter tensors, so
that gradients flow) in place of a model's forward pass, and the same old, reference and sampling
log-probs, advantages, masks and vLLM importance weights. grpo_lab runs its engine's real loss stage
(:class:`grpo_lab.core.loss.LossStage`); TRL runs ``_compute_loss`` once per micro-batch, as its
``training_step`` does, and its metrics are averaged as its ``log`` averages them.

Run as a script under ``accelerate launch`` to compare on every process of a distributed run.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from types import SimpleNamespace

import torch

from grpo_lab import GRPOConfig, ops
from grpo_lab.core.loss import LossStage
from grpo_lab.parallel.layout import layout_for
from grpo_lab.core.optimization import EntropyWeight
from grpo_lab.types import Advantages, Rollout, Scores

MICRO_BATCH, T = 4, 6

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
OPTIONS = (
    {},
    {"beta": 0.04},
    {"beta": 0.04, "use_bias_correction_kl": True},
    {"delta": 1.5},
    {"epsilon_high": 0.28},
    {"top_entropy_quantile": 0.5},
    {"mask_truncated_completions": True},
    {"entropy_coef": 0.01},
    {"off_policy_mask_threshold": 0.05},
    {"vllm": "token_truncate"},
    {"vllm": "token_mask"},
    {"vllm": "sequence_truncate"},
    {"vllm": "sequence_mask"},
    {"beta": 0.04, "top_entropy_quantile": 0.5, "entropy_coef": 0.01, "mask_truncated_completions": True,
     "vllm": "token_truncate"},
)

GRPO_LAB_ONLY = {"backward_skipped_fraction", "off_policy_mask/masked_fraction"}
"""grpo_lab's own step metrics (docs/metrics.md), which TRL has no twin of."""


class _Scores(torch.nn.Module):
    """Stands for the policy: its per-token log-probs and entropies are parameters' functions."""

    def __init__(self, theta_BT: torch.Tensor, psi_BT: torch.Tensor):
        super().__init__()
        self.theta_BT = torch.nn.Parameter(theta_BT.clone())
        self.psi_BT = torch.nn.Parameter(psi_BT.clone())

    def scores(self, index_B=None):
        index_B = slice(None) if index_B is None else index_B
        return -torch.nn.functional.softplus(self.theta_BT[index_B]), torch.nn.functional.softplus(self.psi_BT[index_B])


class _LossEngine:
    """The engine the loss stage reads, with :class:`_Scores` in place of the model's forward pass."""

    def __init__(self, config: GRPOConfig, accelerator, scores: _Scores):
        self.config, self.accelerator = config, accelerator
        self.model = self.unwrapped_model = scores
        self.optimizer = torch.optim.SGD(scores.parameters(), lr=0.0)
        self.optimization = SimpleNamespace(optimizer=self.optimizer, entropy=EntropyWeight(config.entropy_coef))
        self.layout = layout_for(accelerator)
        self.batching = SimpleNamespace(steps_per_generation=config.gradient_accumulation_steps)
        self.trained_parameter_names = None
        self.routes_to_experts = False

    def logprobs_and_aux_loss(self, model, rollout, index_B, *, with_entropy, entropy_grad=False,
                              router_aux_loss=False):
        logprobs_BT, entropies_BT = model.scores(index_B)
        return logprobs_BT, entropies_BT if entropy_grad else entropies_BT.detach(), None

    def router_aux_loss_weight(self) -> float:
        return 0.0

    def step_event(self, name: str) -> None:
        pass


def inputs(seed: int, rows: int, *, truncate: bool) -> dict[str, torch.Tensor]:
    """A step's tensors on one process: ``rows`` completions of up to T tokens."""
    g = torch.Generator().manual_seed(seed)
    theta_BT = torch.randn(rows, T, generator=g)
    logprobs_BT = -torch.nn.functional.softplus(theta_BT)
    lengths_B = torch.randint(1, T + 1, (rows,), generator=g)
    mask_BT = (torch.arange(T) < lengths_B[:, None]).float()
    truncated_B = (torch.arange(rows) % 3 == 1) if truncate else torch.zeros(rows, dtype=torch.bool)
    advantages_B = torch.randn(rows, generator=g)
    advantages_B[::4] = 0.0
    return {
        "theta_BT": theta_BT,
        "psi_BT": torch.randn(rows, T, generator=g),
        "mask_BT": mask_BT,
        "truncated_B": truncated_B,
        "advantages_B": advantages_B,
        "old_BT": logprobs_BT + 0.4 * torch.randn(rows, T, generator=g),
        "ref_BT": logprobs_BT + 0.3 * torch.randn(rows, T, generator=g),
        "sampling_BT": logprobs_BT + 0.3 * torch.randn(rows, T, generator=g),
    }


def config_for(loss_type: str, level: str, options: dict, accumulation: int) -> GRPOConfig | None:
    """grpo_lab's config of one setting; None where grpo_lab refuses the combination (a setting the
    loss type would ignore)."""
    fields = {k: v for k, v in options.items() if k != "vllm"}
    if loss_type == "cispo":  # its cap is epsilon_high itself, at least 1
        fields = {"epsilon_high": 1.3, **fields}
    try:
        return GRPOConfig(
            output_dir="unused", loss_type=loss_type, importance_sampling_level=level, num_generations=4,
            per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=accumulation,
            max_completion_length=T, report_to="none", **fields,
        )
    except ValueError:
        return None


def importance_weights(data: dict, options: dict) -> torch.Tensor | None:
    mode = options.get("vllm")
    if mode is None:
        return None
    mask_BT = _loss_mask(data, options)
    return ops.vllm_importance_weights(data["old_BT"], data["sampling_BT"], mask_BT, mode=mode, clip_max=1.6,
                                       clip_min=0.6)


def _loss_mask(data: dict, options: dict) -> torch.Tensor:
    if options.get("mask_truncated_completions"):
        return ops.truncation_mask(data["mask_BT"], data["truncated_B"])
    return data["mask_BT"]


def grpo_lab_step(config: GRPOConfig, accelerator, data: dict, weights) -> tuple[float, list, dict]:
    """The loss, the parameters' gradients and the metrics of grpo_lab's loss stage."""
    rows = len(data["advantages_B"])
    scores = _Scores(data["theta_BT"], data["psi_BT"])
    rollout = Rollout(
        prompts=[None] * rows, completions=[None] * rows, completion_texts=[""] * rows, columns={},
        prompt_ids_BP=torch.zeros(rows, 1, dtype=torch.long), prompt_mask_BP=torch.ones(rows, 1, dtype=torch.long),
        completion_ids_BT=torch.zeros(rows, T, dtype=torch.long), completion_mask_BT=data["mask_BT"].long(),
        is_truncated_B=data["truncated_B"], group_index_B=torch.arange(rows) // 4, old_logprobs_BT=data["old_BT"],
        ref_logprobs_BT=data["ref_BT"] if config.beta else None, sampling_logprobs_BT=data["sampling_BT"],
        importance_weights_BT=weights,
    )
    scored = Scores(rollout=rollout, rewards_BF=torch.zeros(rows, 1), reward_names=["r"])
    advantages = Advantages(scores=scored, rewards_B=torch.zeros(rows), advantages_B=data["advantages_B"],
                            group_mean_B=torch.zeros(rows), group_std_B=torch.zeros(rows),
                            is_std_zero_B=torch.zeros(rows, dtype=torch.bool))
    result = LossStage(_LossEngine(config, accelerator, scores)).loss(advantages)
    metrics = {k: v for k, v in result.metrics.items() if k not in GRPO_LAB_ONLY}
    return result.loss, _gradients(scores), metrics


def _gradients(scores: _Scores) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in scores.parameters()]


def trl_step(config: GRPOConfig, accelerator, data: dict, weights) -> tuple[float, list, dict]:
    """The loss, gradients and metrics of TRL 1.16's ``_compute_loss``, one call per micro-batch."""
    from trl import GRPOTrainer

    accumulation = config.gradient_accumulation_steps
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    scores = _Scores(data["theta_BT"], data["psi_BT"])
    _trl_attributes(trainer, config, accelerator, weights is not None)
    mask_BT = _loss_mask(data, {"mask_truncated_completions": config.mask_truncated_completions})
    num_items = accelerator.gather(mask_BT.sum().reshape(1)).sum()
    total = 0.0
    for k in range(accumulation):
        index_B = torch.arange(k * MICRO_BATCH, (k + 1) * MICRO_BATCH)
        trainer._get_per_token_logps_and_entropies = lambda *a, index_B=index_B, **kw: (*scores.scores(index_B), None)
        batch = {
            "prompt_ids": torch.zeros(MICRO_BATCH, 1, dtype=torch.long),
            "prompt_mask": torch.ones(MICRO_BATCH, 1, dtype=torch.long),
            "completion_ids": torch.zeros(MICRO_BATCH, T, dtype=torch.long),
            "completion_mask": mask_BT[index_B], "advantages": data["advantages_B"][index_B],
            "old_per_token_logps": data["old_BT"][index_B], "sampling_per_token_logps": data["sampling_BT"][index_B],
            "num_items_in_batch": num_items,
        }
        if config.beta:
            batch["ref_per_token_logps"] = data["ref_BT"][index_B]
        if weights is not None:
            batch["importance_sampling_ratio"] = weights[index_B]
        loss = trainer._compute_loss(None, batch)
        loss.backward()
        total += float(loss.detach())
    logged = float(accelerator.gather(torch.tensor([total])).mean())
    return logged, _gradients(scores), _trl_log_average(trainer._metrics["train"])


def _trl_attributes(trainer, config: GRPOConfig, accelerator, vllm_correction: bool) -> None:
    """What ``_compute_loss`` reads of its trainer, from the shared config."""
    bonus = config.entropy_coef != 0.0
    trainer.accelerator = accelerator
    trainer.args = SimpleNamespace(**{**config.to_dict(), "steps_per_generation": config.gradient_accumulation_steps})
    trainer.model = SimpleNamespace(training=True)
    trainer.current_gradient_accumulation_steps = config.gradient_accumulation_steps
    for name in ("loss_type", "importance_sampling_level", "beta", "top_entropy_quantile", "off_policy_mask_threshold",
                 "max_completion_length", "entropy_coef"):
        setattr(trainer, name, getattr(config, name))
    trainer.epsilon_low = config.epsilon
    trainer.epsilon_high = config.epsilon_high if config.epsilon_high is not None else config.epsilon
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = vllm_correction
    trainer._entropy_bonus_enabled, trainer.use_adaptive_entropy, trainer.aux_loss_enabled = bonus, False, False
    trainer._metrics = {"train": defaultdict(list)}


def _trl_log_average(values: dict[str, list[float]]) -> dict[str, float]:
    """TRL's ``log``: each metric's mean over what its micro-batches appended, NaN left out."""
    averaged = {}
    for name, appended in values.items():
        numbers = [v for v in appended if not math.isnan(v)]
        averaged[name] = sum(numbers) / len(numbers) if numbers else float("nan")
    return averaged


def settings(accumulations=(1, 2)):
    """Every (loss type, importance-sampling level, options, accumulation steps) grpo_lab accepts."""
    for loss_type in LOSS_TYPES:
        for level in ("token", "sequence"):
            for options in OPTIONS:
                for accumulation in accumulations:
                    if config_for(loss_type, level, options, accumulation) is not None:
                        yield loss_type, level, options, accumulation


def compare(loss_type, level, options, accumulation, accelerator, seed: int) -> list[str]:
    """The differences between the two sides' loss, gradients and metrics (empty when they agree)."""
    config = config_for(loss_type, level, options, accumulation)
    data = inputs(seed, MICRO_BATCH * accumulation, truncate=bool(options.get("mask_truncated_completions")))
    weights = importance_weights(data, options)
    lab_loss, lab_grads, lab_metrics = grpo_lab_step(config, accelerator, data, weights)
    trl_loss, trl_grads, trl_metrics = trl_step(config, accelerator, data, weights)
    problems = []
    if not math.isclose(lab_loss, trl_loss, rel_tol=1e-5, abs_tol=1e-7):
        problems.append(f"loss {lab_loss} vs {trl_loss}")
    for name, ours, theirs in zip(("logprob", "entropy"), lab_grads, trl_grads):
        if not torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7):
            problems.append(f"{name} gradient differs by {float((ours - theirs).abs().max()):.3g}")
    lab_metrics.pop("loss")
    if set(lab_metrics) != set(trl_metrics):
        problems.append(f"metric names: grpo_lab only {set(lab_metrics) - set(trl_metrics)}, "
                        f"TRL only {set(trl_metrics) - set(lab_metrics)}")
    for name in set(lab_metrics) & set(trl_metrics):
        ours, theirs = lab_metrics[name], trl_metrics[name]
        if not (math.isnan(ours) and math.isnan(theirs)) and not math.isclose(ours, theirs, rel_tol=1e-5,
                                                                               abs_tol=1e-7):
            problems.append(f"{name} {ours} vs {theirs}")
    return problems


def main(out_path: str) -> None:
    """Compare every setting with gradient accumulation 2 on this process; write the differences."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    found = {}
    for loss_type, level, options, accumulation in settings(accumulations=(2,)):
        problems = compare(loss_type, level, options, accumulation, accelerator, seed=100 + rank)
        if problems:
            found[f"{loss_type}/{level}/{json.dumps(options)}"] = problems
    with open(f"{out_path}-{rank}.json", "w") as report:
        json.dump(found, report)
    accelerator.end_training()  # the process group joins its threads before the interpreter shuts down


if __name__ == "__main__":
    main(sys.argv[1])
