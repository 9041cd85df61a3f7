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


def test_the_load_balancing_loss_is_added_with_its_weight_over_the_accumulation_steps_and_logged(
    make_session, tiny_moe
):
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


def test_a_weight_set_between_steps_on_a_model_without_router_logits_is_undone(make_session):
    session = make_session()
    session.config.router_aux_loss_coef = 0.01
    with pytest.raises(ValueError, match="no load-balancing loss to weight.*The edit was undone"):
        session.generate()
    assert session.config.router_aux_loss_coef is None
    assert "loss" in session.step()


def test_a_weighted_model_that_returns_no_load_balancing_loss_fails_the_loss_stage_with_the_fix(
    make_session, task, tmp_path
):
    # Llama 4's text model declares router logits and a weight but returns no aux_loss
    from transformers import AutoTokenizer, Llama4ForCausalLM, Llama4TextConfig

    tokenizer = AutoTokenizer.from_pretrained(task.model)
    config = Llama4TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              num_local_experts=4, num_experts_per_tok=1, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    Llama4ForCausalLM(config).save_pretrained(tmp_path / "llama4")
    tokenizer.save_pretrained(tmp_path / "llama4")
    session = make_session(model=str(tmp_path / "llama4"), max_completion_length=4)
    session.generate(), session.score(), session.advantages()
    with pytest.raises(ValueError, match=r"\(0.001, the model config\).*returns none.*Set router_aux_loss_coef=0"):
        session.loss()
    session.config.router_aux_loss_coef = 0.0
    assert "aux_loss" not in session.loss().metrics


def test_zero_advantage_micro_batches_run_their_backward_pass_while_the_load_balancing_loss_is_weighted(
    make_session, tiny_moe
):
    # its gradient does not vanish with the advantages; the model's experts are not what stops the skip here
    skipped = {}
    for weight in (None, 0.0):
        session = make_session(model=tiny_moe, reward_funcs=[constant_reward], num_generations=4,
                               per_device_train_batch_size=4, gradient_accumulation_steps=4,
                               router_aux_loss_coef=weight)
        session.engine.routes_to_experts = False
        session.generate(), session.score(), session.advantages()
        skipped[weight] = session.loss().backward_skipped
    assert skipped == {None: 0, 0.0: 3}


def test_a_model_whose_config_turns_router_logits_on_shares_prompts_when_unweighted(make_session, tiny_moe, tmp_path):
    # such a model computes its load-balancing loss in every call, against that call's attention mask,
    # which a call continuing a shared prompt's cache does not match: prefix sharing turns it off
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_moe)
    model.config.output_router_logits = True
    model.save_pretrained(tmp_path / "moe")
    AutoTokenizer.from_pretrained(tiny_moe).save_pretrained(tmp_path / "moe")
    for weight, logged in ((0.0, False), (None, True)):
        session = make_session(model=str(tmp_path / "moe"), num_iterations=2, router_aux_loss_coef=weight)
        rows = [session.step() for _ in range(2)]  # the old policy's pass, then the reused batch
        assert all(("aux_loss" in row) == logged for row in rows)
