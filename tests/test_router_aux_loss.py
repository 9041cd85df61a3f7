"""router_aux_loss_coef: a mixture-of-experts model's load-balancing loss in the objective, as TRL adds it."""

import pytest
import torch

from grpo_lab import GRPOConfig


def constant_reward(completions, **kwargs):
    """Every advantage zero: the policy loss is 0 and the step's loss is the load-balancing term alone."""
    return [1.0] * len(completions)


def _own_aux_losses(session, micro_batches: list) -> list[float]:
    """The model's own load-balancing loss over each micro-batch's whole sequences."""
    rollout = session.rollout
    losses = []
    with torch.no_grad():
        for index_B in micro_batches:
            ids = torch.cat([rollout.prompt_ids_BP[index_B], rollout.completion_ids_BT[index_B]], dim=1)
            mask = torch.cat([rollout.prompt_mask_BP[index_B], rollout.completion_mask_BT[index_B]], dim=1)
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            out = session.model(input_ids=ids, attention_mask=mask, position_ids=positions, output_router_logits=True)
            losses.append(float(out.aux_loss))
    return losses


def test_the_load_balancing_loss_is_added_with_its_weight_over_the_accumulation_steps_and_logged(make_session, tiny_moe):
    session = make_session(model=tiny_moe, reward_funcs=[constant_reward], num_generations=4,
                           per_device_train_batch_size=4, gradient_accumulation_steps=2)
    session.generate(), session.score()
    assert not session.advantages().advantages_B.any()
    expected = _own_aux_losses(session, [torch.arange(0, 4), torch.arange(4, 8)])
    mean = sum(expected) / 2
    gate = dict(session.model.named_parameters())["model.layers.0.mlp.gate.weight"]

    result = session.loss()  # None: the model config's weight, 0.001
    assert session.model.config.router_aux_loss_coef == 0.001
    assert result.metrics["aux_loss"] == pytest.approx(mean, rel=1e-5)
    assert result.loss == pytest.approx(0.001 * mean, rel=1e-5)  # sum over micro-batches of w x aux / 2

    session.config.router_aux_loss_coef = 0.5  # recomputed with the new weight
    result = session.loss()
    assert result.loss == pytest.approx(0.5 * mean, rel=1e-5) and gate.grad is not None and gate.grad.any()

    session.config.router_aux_loss_coef = 0.0
    result = session.loss()
    assert "aux_loss" not in result.metrics and result.loss == 0.0
    assert gate.grad is None or not gate.grad.any()


def test_with_the_load_balancing_loss_the_old_policy_pass_takes_the_training_pass_path(make_session, tiny_moe):
    # whole sequences in both, so that the first iteration's ratio is exactly 1
    session = make_session(model=tiny_moe, num_iterations=2, router_aux_loss_coef=0.01)
    session.generate(), session.score(), session.advantages()
    result = session.loss()
    assert "aux_loss" in result.metrics
    assert torch.equal(result.ratio_BT, torch.ones_like(result.ratio_BT))


def test_a_weight_for_a_model_without_router_logits_or_below_zero_is_refused(make_session):
    with pytest.raises(ValueError, match="not a mixture-of-experts model that returns router logits"):
        make_session(router_aux_loss_coef=0.01)
    assert "aux_loss" not in make_session(router_aux_loss_coef=0.0).step()
    with pytest.raises(ValueError, match="router_aux_loss_coef must be >= 0"):
        GRPOConfig(router_aux_loss_coef=-0.1)
