"""GRPOSession on the real engine, the shipped tiny model and real reward functions.

Each stage's numbers are checked against an independent recomputation from grpo_lab.ops.
"""

import pandas as pd
import pytest
import torch

from grpo_lab import ops
from grpo_lab.session.session import StageOrderError


def test_transformers_optimizer_names_build_transformers_optimizers(make_session):
    """paged_adamw_8bit (bitsandbytes' AdamW8bit, not paged on a CPU) and sgd, as TRL builds them."""
    import bitsandbytes

    for optim, kind in (("paged_adamw_8bit", bitsandbytes.optim.AdamW), ("sgd", torch.optim.SGD)):
        session = make_session(optim=optim, weight_decay=0.1)
        optimizer = session.engine.optimizer.optimizer
        assert isinstance(optimizer, kind) and optimizer.param_groups[0]["weight_decay"] == 0.1
        before = [p.detach().clone() for p in session.model.parameters()]
        session.step()
        assert any(not torch.equal(a, b) for a, b in zip(before, session.model.parameters()))
        session.config.adam_epsilon = 1e-6  # an AdamW setting sgd does not take is left out of its groups
        session.step()
        assert ("eps" in optimizer.param_groups[0]) is (optim != "sgd")


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_stages_return_numbers_that_match_an_independent_recomputation(make_session, task, optim):
    session = make_session(optim=optim)
    assert session.engine.optimizer.optimizer.defaults["fused"] is (optim == "adamw_torch_fused")
    assert session.next_stage == "generate"

    rollout = session.generate()
    assert len(rollout) == 8 and session.next_stage == "score"
    # each prompt appears num_generations (4) times in a row
    assert rollout.prompts[0:4] == [rollout.prompts[0]] * 4 and rollout.prompts[4] != rollout.prompts[0]
    assert rollout.group_index_B.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    mask_BT, truncated_B = ops.completion_mask_from_ids(rollout.completion_ids_BT,
                                                        eos_token_id=session.tokenizer.eos_token_id)
    torch.testing.assert_close(rollout.completion_mask_BT, mask_BT)
    torch.testing.assert_close(rollout.is_truncated_B, truncated_B)
    assert rollout.old_logprobs_BT is None and rollout.ref_logprobs_BT is None  # not needed here

    scores = session.score()
    expected = [func(prompts=rollout.prompts, completions=rollout.completions, **rollout.columns)
                for func in task.reward_funcs]
    torch.testing.assert_close(scores.rewards_BF, torch.tensor(expected).T)

    advantages = session.advantages()
    reference = ops.compute_advantages(scores.rewards_BF, num_generations=4, scale_rewards="group")
    torch.testing.assert_close(advantages.advantages_B, reference.advantages_B)
    torch.testing.assert_close(advantages.rewards_B, scores.rewards_BF.sum(dim=1))

    result = session.loss()
    engine = session.engine
    with torch.no_grad():
        logprobs_BT, _ = engine.sequence_logprobs(engine.model, rollout, torch.arange(8), with_entropy=False)
    mask = rollout.completion_mask_BT.float()
    # on-policy (ratio 1): the dapo loss is -sum(A_i * mask_it) / sum(mask)
    expected_loss = -(advantages.advantages_B[:, None] * mask).sum() / mask.sum()
    assert result.loss == pytest.approx(float(expected_loss), abs=1e-6)
    torch.testing.assert_close(result.logprobs_BT, logprobs_BT)
    torch.testing.assert_close(result.ratio_BT * mask, mask)

    params = [p for p in engine.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    grads = [p.grad.detach().clone() for p in params]
    row = session.update()
    # first AdamW step: m_hat = g, v_hat = g^2, so p <- p - lr * g / (|g| + eps), after clipping g
    norm = torch.sqrt(sum((g**2).sum() for g in grads))
    scale = min(1.0, 1.0 / (float(norm) + 1e-6))
    for p, old, g in zip(params, before, grads):
        g = g * scale
        torch.testing.assert_close(p.detach(), old - 1e-3 * g / (g.abs() + 1e-8), atol=1e-6, rtol=1e-5)
    assert row["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    assert row["learning_rate"] == 1e-3 and session.global_step == 1
    assert session.next_stage == "generate"


def test_result_objects_render_and_convert(make_session):
    session = make_session()
    rollout, scores, advantages, result = session.generate(), session.score(), session.advantages(), session.loss()
    frame = result.to_pandas()
    assert list(frame.columns[:5]) == ["group", "prompt", "completion", "length", "truncated"]
    for column in ["rewards/correctness_reward", "rewards/format_reward", "reward", "advantage", "ratio",
                   "clipped_fraction", "entropy"]:
        assert column in frame.columns
    assert len(frame) == 8
    for obj in (rollout, scores, advantages, result):
        assert "<table" in obj._repr_html_() and type(obj).__name__ in repr(obj)


HISTORY_COLUMNS = [
    "reward", "reward_std", "rewards/correctness_reward/mean", "rewards/correctness_reward/std",
    "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio", "entropy", "loss", "grad_norm",
    "learning_rate", "num_tokens", "step_time",
]
CLIP_COLUMNS = {  # each loss type's own clip statistics, as TRL logs them (none for sapo)
    "cispo": ["cispo_clip_ratio"], "sapo": [], "vespo": ["vespo/phi_seq_mean"],
}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_every_loss_type_steps(make_session, loss_type):
    session = make_session(loss_type=loss_type, **({"epsilon_high": 5.0} if loss_type == "cispo" else {}))
    session.run(2, progress=False)
    history = session.history
    assert len(history) == 2 and list(history["step"]) == [1, 2]
    clipped = CLIP_COLUMNS.get(loss_type, ["clip_ratio/low_mean", "clip_ratio/high_max", "clip_ratio/region_mean"])
    for column in HISTORY_COLUMNS + clipped:
        assert column in history.columns and history[column].notna().all(), column
    assert not {"cispo_clip_ratio", "clip_ratio/region_mean"} - set(clipped) & set(history.columns)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(beta=0.04),
        dict(num_iterations=2),
        dict(gradient_accumulation_steps=2),
        dict(steps_per_generation=2),
        dict(importance_sampling_level="sequence", num_iterations=2),
        dict(top_entropy_quantile=0.2, mask_truncated_completions=True),
    ],
    ids=["beta", "num_iterations", "grad_accum", "steps_per_generation", "gspo", "entropy_mask"],
)
def test_options_step(make_session, overrides):
    session = make_session(**overrides)
    rollout = session.generate()
    reused = overrides.get("num_iterations", 1) > 1 or overrides.get("steps_per_generation", 1) > 1
    assert (rollout.old_logprobs_BT is not None) == reused
    assert (rollout.ref_logprobs_BT is not None) == ("beta" in overrides)
    session.step()
    if reused:  # the same batch feeds the next optimizer step: no generation in between
        assert session.next_stage == "loss"
        result = session.loss()
        assert result.sample_index_B.tolist() == (
            list(range(8)) if "num_iterations" in overrides else list(range(8, 16))
        )
        session.update()
    assert session.next_stage == "generate"
    if "beta" in overrides:
        assert "kl" in session.history.columns and (session.history["kl"] >= 0).all()


def test_the_reference_moves_towards_the_policy_every_ref_model_sync_steps_updates(make_session):
    # TR-DPO: after the update of every 2nd step, ref <- 0.6 * policy + 0.4 * ref
    session = make_session(beta=0.1, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.6)
    ref, policy = session.engine.ref_model, session.model
    start = [p.detach().clone() for p in ref.parameters()]
    session.step()
    assert all(torch.equal(r, s) for r, s in zip(ref.parameters(), start))  # step 1: left alone
    assert not all(torch.equal(p, s) for p, s in zip(policy.parameters(), start))
    session.step()
    for r, p, s in zip(ref.parameters(), policy.parameters(), start, strict=True):
        torch.testing.assert_close(r, 0.6 * p.detach() + 0.4 * s, rtol=0, atol=1e-6)  # rounding of the order


def test_lora_steps_and_uses_disabled_adapter_as_reference(task, tmp_path):
    from peft import LoraConfig

    from grpo_lab import GRPOSession
    from tests.conftest import SMALL

    lora = GRPOSession(
        task.model, task.reward_funcs, args=task.config(**SMALL, beta=0.04, output_dir=str(tmp_path)),
        train_dataset=task.train_dataset,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    assert lora.engine.ref_model is None  # the base model (adapter disabled) is the reference
    trainable = [n for n, p in lora.engine.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    rollout = lora.generate()
    # a fresh LoRA adapter is zero-initialised on B, so the reference equals the policy
    with torch.no_grad():
        policy_BT, _ = lora.engine.sequence_logprobs(lora.engine.model, rollout, torch.arange(8), with_entropy=False)
    mask = rollout.completion_mask_BT.bool()
    torch.testing.assert_close(rollout.ref_logprobs_BT[mask], policy_BT[mask])
    lora.step()
    lora.run(1, progress=False)
    assert lora.history["kl"].iloc[-1] > 0  # the adapter moved away from the base model


def test_stage_order_errors_name_the_stage_to_call(make_session):
    session = make_session()
    with pytest.raises(StageOrderError, match=r"next stage is generate\(\)"):
        session.score()
    with pytest.raises(StageOrderError, match=r"generate\(\) first"):
        session.update()
    session.generate()
    with pytest.raises(StageOrderError, match=r"session.score\(\)"):
        session.loss()
    session.score()
    session.advantages()
    session.loss()
    session.update()
    with pytest.raises(StageOrderError, match="already used the last gradients"):
        session.update()
    session.step()  # still usable
    assert session.global_step == 2


def test_rescore_and_recompute_without_regenerating(make_session):
    session = make_session()
    rollout = session.generate()
    first = session.score()
    session.reward_funcs = [lambda completions, **kw: [float(len(str(c))) for c in completions]]
    second = session.score()
    assert second.rollout is rollout and second.reward_names == ["<lambda>"]
    assert second.rewards_BF.shape == (8, 1) and not torch.equal(first.rewards_BF[:, :1], second.rewards_BF)
    session.advantages()
    session.config.scale_rewards = "none"
    unscaled = session.advantages()
    groups = unscaled.rewards_B.view(2, 4)
    torch.testing.assert_close(unscaled.advantages_B, (groups - groups.mean(1, keepdim=True)).flatten())
    first_loss = session.loss().loss
    session.config.epsilon = 0.1
    assert session.loss().loss == pytest.approx(first_loss)  # ratio 1: epsilon does not matter
    session.update()
    assert [c["field"] for c in session.config_changes] == ["scale_rewards", "epsilon"]


def test_entropy_bonus_subtracts_coef_times_mean_token_entropy_from_the_step_loss(make_session):
    session = make_session()
    session.generate()
    session.score()
    session.advantages()
    plain = session.loss()
    plain_grads = [p.grad.clone() for p in session.model.parameters() if p.grad is not None]
    session.config.entropy_coef = 0.3
    bonus = session.loss()
    # dapo, one micro-batch, one process: H = sum m H / N, the mean token entropy logged as "entropy".
    assert bonus.loss == pytest.approx(plain.loss - 0.3 * plain.metrics["entropy"], rel=1e-5, abs=1e-7)
    assert bonus.metrics["entropy_coef"] == 0.3 and "entropy_coef" not in plain.metrics
    grads = [p.grad for p in session.model.parameters() if p.grad is not None]
    assert any(not torch.allclose(a, b) for a, b in zip(plain_grads, grads))  # the bonus has a gradient
    session.update()
    assert session.history["entropy_coef"].tolist() == [0.3]


@pytest.mark.parametrize(("target", "applied", "internal"),
                         [(100.0, [0.02, 0.03, 0.04], 0.05), (0.0, [0.02, 0.0, 0.0], 0.0)])
def test_adaptive_entropy_weight_follows_the_target_and_survives_save_and_load(
    make_session, tmp_path, target, applied, internal
):
    session = make_session(entropy_coef=0.02, use_adaptive_entropy=True, entropy_target=target, entropy_coef_delta=0.01)
    session.run(3, progress=False)
    # Entropy at most the target (100 nats): up by delta every step. Above it (0): the weight falls
    # to entropy_coef_min and the bonus is off from the second step on.
    assert session.history["entropy_coef"].tolist() == pytest.approx(applied)
    entropy = session.engine.optimization.entropy
    assert entropy.coef == pytest.approx(internal)
    assert entropy.last_step_entropy == pytest.approx(session.history["entropy"].iloc[-1], rel=1e-5)
    from grpo_lab import GRPOSession

    restored = GRPOSession.load(session.save(tmp_path / "saved"))
    assert restored.engine.optimization.entropy.state_dict() == entropy.state_dict()
    session.config.use_adaptive_entropy = False  # back to the static weight, not the adapted one
    session.step()
    assert session.history["entropy_coef"].iloc[-1] == pytest.approx(0.02)
    session.config.use_adaptive_entropy = True  # on again: an entropy from before the switch is not followed
    session.step()
    assert session.history["entropy_coef"].iloc[-1] == pytest.approx(0.02)  # not gated by a stale entropy


def test_off_policy_mask_drops_drifted_negative_advantage_completions_of_a_reused_batch(make_session):
    session = make_session(num_iterations=2, learning_rate=0.05, off_policy_mask_threshold=1e-4)
    session.step()
    assert session.history["off_policy_mask/masked_fraction"].tolist() == [0.0]  # first update: no drift yet
    result = session.loss()
    rollout = session.rollout
    index = result.sample_index_B
    mask = rollout.completion_mask_BT[index].float()
    drift = ((rollout.old_logprobs_BT[index] - result.logprobs_BT) * mask).sum(1) / mask.sum(1)
    expected = ((session.advantages_result.advantages_B[index] < 0) & (drift > 1e-4)).float().mean()
    assert 0 < float(expected) < 1
    assert result.metrics["off_policy_mask/masked_fraction"] == pytest.approx(float(expected))


def test_learning_rate_change_takes_effect_and_is_recorded(make_session):
    session = make_session(lr_scheduler_type="constant")
    session.step()
    session.config.learning_rate = 5e-4
    row = session.step()
    assert row["learning_rate"] == 5e-4
    assert session.config_changes == [{"step": 2, "field": "learning_rate", "old": 1e-3, "new": 5e-4}]
    session.config.scale_rewards = False  # normalised to "none": recorded once, as the value in force
    session.step()
    assert session.config_changes[-1] == {"step": 3, "field": "scale_rewards", "old": "group", "new": "none"}
    assert len(session.config_changes) == 2
    session.config.learning_rate = -1.0
    with pytest.raises(ValueError, match="learning_rate"):
        session.step()


def test_a_scheduler_given_in_optimizers_goes_on_when_the_run_lengthens_and_its_shape_cannot_change(task, tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo_lab import GRPOSession
    from tests.conftest import SMALL

    model = AutoModelForCausalLM.from_pretrained(task.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    config = task.config(**{**SMALL, "output_dir": str(tmp_path), "max_steps": 2})
    session = GRPOSession(model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          optimizers=(optimizer, scheduler))
    rows = [session.step()]
    session.config.max_steps = 3
    rows += [session.step(), session.step()]
    assert [row["learning_rate"] for row in rows] == pytest.approx([1e-3, 5e-4, 2.5e-4], rel=1e-6)
    assert session.engine.total_steps() == 3 and session.engine.scheduler is scheduler
    warmup = session.config.warmup_ratio
    session.config.warmup_ratio, session.config.max_steps = 0.5, 4
    with pytest.raises(ValueError, match="warmup_ratio: these configure the schedule grpo_lab builds.*"
                                         "no effect; it was undone"):
        session.step()
    assert (session.config.warmup_ratio, session.config.max_steps) == (warmup, 3)


def test_adamw_settings_changed_between_steps_take_effect(make_session):
    """Two sessions from one seed; in one, weight_decay goes to 0.5 after step 1. Step 2 has the same
    batch and gradient in both, so AdamW's decoupled decay is the whole difference:
    p2(decay) - p2(no decay) = -lr * 0.5 * p1."""
    runs = {}
    for weight_decay in (0.5, 0.0):  # one session after the other: each seeds the random state it samples with
        session = make_session(lr_scheduler_type="constant")
        session.step()
        before = [p.detach().clone() for p in session.model.parameters()]
        session.config.weight_decay, session.config.adam_epsilon = weight_decay, 1e-6
        session.step()
        group = session.engine.optimizer.param_groups[0]
        assert (group["weight_decay"], group["eps"]) == (weight_decay, 1e-6)
        runs[weight_decay] = session, before, [p.detach().clone() for p in session.model.parameters()]
    (decayed_session, before, decayed), (_, before_plain, plain) = runs[0.5], runs[0.0]
    for p1, p1_plain, a, b in zip(before, before_plain, decayed, plain, strict=True):
        assert torch.equal(p1, p1_plain)
        torch.testing.assert_close(a - b, -1e-3 * 0.5 * p1, atol=1e-7, rtol=1e-4)
    assert {c["field"] for c in decayed_session.config_changes} == {"weight_decay", "adam_epsilon"}


def test_run_stops_cleanly_on_keyboard_interrupt(make_session, task):
    calls = {"n": 0}

    def interrupting(completions, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return [0.0] * len(completions)

    session = make_session(reward_funcs=[*task.reward_funcs, interrupting])
    frame = session.run(5, progress=False).to_pandas()
    assert len(frame) == 2 and session.global_step == 2
    assert session.next_stage == "score" and session.rollout is not None  # the completions are kept
    calls["n"] = 10
    session.step()
    assert session.global_step == 3


def test_completions_log_and_evaluate(make_session):
    session = make_session()
    session.run(2, progress=False)
    log = session.completions_log
    assert list(log["step"].unique()) == [1, 2] and len(log) == 16
    metrics = session.evaluate()
    assert set(metrics) >= {"eval_reward", "eval_rewards/correctness_reward/mean", "eval_completions/mean_length"}
    assert 0.0 <= metrics["eval_rewards/correctness_reward/mean"] <= 1.0


def test_reward_functions_get_plain_lists_of_every_column_whatever_the_dataset_format(make_session, task):
    seen = {}

    def record(prompts, completions, answer, **kwargs):
        seen.update(answer=answer, prompts=prompts)
        return [0.0] * len(prompts)

    formatted = task.train_dataset.with_format("numpy", columns=["answer"])
    session = make_session(reward_funcs=[record], train_dataset=formatted)
    session.generate()
    session.score()
    assert type(seen["answer"]) is list and all(type(a) is str for a in seen["answer"])
    assert seen["prompts"] == session.rollout.prompts and isinstance(seen["prompts"][0], list)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_policy_trains_in_training_mode_so_gradient_checkpointing_recomputes(make_session, checkpointing):
    """from_pretrained returns a model in eval mode, where transformers skips checkpointing: the
    engine must switch the policy to training mode, and generation must leave it there."""
    session = make_session(gradient_checkpointing=checkpointing, share_prompt_prefix=False)
    model = session.engine.unwrapped_model
    layer_calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: layer_calls.append(1))
    session.generate()
    session.score()
    session.advantages()
    assert model.training
    before = len(layer_calls)
    session.loss()
    # One forward pass over the micro-batch; with checkpointing the backward pass runs the layer (and
    # its MLP) again.
    assert len(layer_calls) - before == (2 if checkpointing else 1)


def test_pad_to_multiple_of_pads_the_batch_and_leaves_the_results(make_session):
    plain = make_session()
    rows = [plain.step() for _ in range(2)]
    padded = make_session(pad_to_multiple_of=16)  # after the other: sessions share torch's generator
    rollout = padded.generate()
    assert rollout.prompt_ids_BP.shape[1] == 16 and rollout.completion_ids_BT.shape[1] == 16  # 14 and 8 tokens
    padded.score(), padded.advantages(), padded.loss()
    for row, again in zip(rows, [padded.update(), padded.step()], strict=True):  # same completions; rounding aside
        assert {k: v for k, v in again.items() if k != "step_time"} == pytest.approx(
            {k: v for k, v in row.items() if k != "step_time"}, rel=1e-5, abs=1e-7)


def test_step_time_counts_the_stages_and_not_the_time_between_them(make_session):
    import time

    session = make_session(num_iterations=2)
    started = time.perf_counter()
    session.generate()
    time.sleep(0.3)  # a person reading the completions
    session.score(), session.advantages()
    time.sleep(0.3)
    session.loss()
    first = session.update()
    time.sleep(0.3)  # between steps: counts for neither
    session.loss()
    second = session.update()  # the batch used again: loss and update are the step
    wall = time.perf_counter() - started
    assert first["step_time"] > 0 and second["step_time"] > 0
    assert first["step_time"] + second["step_time"] <= wall - 0.9  # the three pauses are in no step


def _header(html: str) -> list[str]:
    import re

    return re.findall(r"<th>([^<]*)</th>", html.split("</thead>")[0])


def test_run_returns_a_summary_that_fits_a_screen_and_stage_tables_lead_with_what_the_stage_added(make_session):
    session = make_session()
    summary = session.run(3, progress=False)
    history = session.history
    pd.testing.assert_frame_equal(summary.to_pandas(), history)
    headline = summary.headline()
    assert list(headline.columns) == ["first", "last", "min", "max"] and "reward" in headline.index
    assert headline.loc["loss", "first"] == history["loss"].iloc[0]
    assert headline.loc["loss", "last"] == history["loss"].iloc[-1]
    assert headline.loc["grad_norm", "max"] == history["grad_norm"].max()
    html = summary._repr_html_()
    assert "ran 3 of 3 optimizer steps, 1 to 3" in html and html.count("<tr") <= 1 + len(headline) <= 9
    assert len(history.columns) > 20  # the table a cell would have shown before

    rollout = session.generate()
    scores, advantages, loss = session.score(), session.advantages(), session.loss()
    assert _header(rollout._repr_html_())[:3] == ["", "group", "prompt"]
    assert _header(scores._repr_html_())[:3] == ["", "group", f"rewards/{scores.reward_names[0]}"]
    assert _header(advantages._repr_html_())[:5] == ["", "group", "reward", "advantage", "group_std_zero"]
    assert _header(loss._repr_html_())[:7] == ["", "group", "ratio", "clipped_fraction", "entropy", "reward",
                                               "advantage"]
    assert set(_header(loss._repr_html_())[1:]) == set(loss.to_pandas().columns)  # reordered, nothing left out
