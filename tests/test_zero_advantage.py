"""skip_zero_advantage_backward: a micro-batch whose advantages are all zero runs no backward pass,
and the run is exactly the one that running it would have given."""

import json
import os
import subprocess

import pytest
import torch

from grpo_lab.tasks.addition import completion_text
from tests.conftest import launch_two

GROUPS = dict(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=4, weight_decay=0.1,
              temperature=3.0)
"""Four groups per optimizer step, one per micro-batch; weight decay, so that an optimizer step given no
gradient at all (rather than a zero one) would show in the weights; a temperature at which the shipped
model's completions of one prompt differ."""


def parity_reward(completions, answer, **kwargs):
    """The same reward for every completion of a prompt whose answer is even (its group's advantages
    are zero); a checksum of the completion's text otherwise."""
    return [1.0 if int(a) % 2 == 0 else float(sum(map(ord, completion_text(c))) % 7)
            for c, a in zip(completions, answer, strict=True)]


def _zero_micro_batches(advantages_B: torch.Tensor, size: int) -> int:
    return int((advantages_B.reshape(-1, size) == 0).all(1).sum())


def _steps(session, rewards: list) -> list[dict]:
    """One optimizer step per reward function in ``rewards`` (a batch reused by ``num_iterations`` keeps
    the reward it was scored with): advantages, loss result, gradients, weights."""
    steps = []
    for reward in rewards:
        if session.next_stage == "generate":
            session.reward_funcs = [reward]
            session.generate(), session.score(), session.advantages()
        advantages, result = session.advantages_result, session.loss()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in session.model.named_parameters()}
        session.update()
        weights = {n: p.detach().clone() for n, p in session.model.named_parameters()}
        steps.append(dict(advantages=advantages.advantages_B.clone(), result=result, grads=grads, weights=weights))
    return steps


def _assert_same_step(skipping: dict, running: dict) -> None:
    assert torch.equal(skipping["advantages"], running["advantages"])
    assert skipping["grads"].keys() == running["grads"].keys()
    for name, grad in running["grads"].items():
        other = skipping["grads"][name]
        assert (grad is None) == (other is None), name
        assert grad is None or torch.equal(grad, other), name
    for name, weight in running["weights"].items():
        assert torch.equal(weight, skipping["weights"][name]), name
    metrics = dict(skipping["result"].metrics)
    assert metrics.pop("backward_skipped_fraction") == skipping["result"].backward_skipped / 4
    assert "backward_skipped_fraction" not in running["result"].metrics  # logged only where skipping can apply
    assert metrics == pytest.approx(running["result"].metrics, rel=1e-6, abs=1e-9)
    assert torch.allclose(skipping["result"].logprobs_BT, running["result"].logprobs_BT, rtol=0, atol=1e-6)


# A reused batch (num_iterations=2) has importance ratios other than 1 in its second step.
@pytest.mark.parametrize("options", [
    dict(), dict(loss_type="grpo", num_iterations=2, delta=1.5),
    dict(loss_type="cispo", num_iterations=2, epsilon_high=5.0),
    dict(loss_type="sapo", num_iterations=2), dict(loss_type="vespo", num_iterations=2),
    dict(loss_type="luspo", num_iterations=2, importance_sampling_level="sequence"),
    dict(num_iterations=2, top_entropy_quantile=0.5, off_policy_mask_threshold=0.5),
], ids=["dapo", "grpo_delta", "cispo", "sapo", "vespo", "luspo_sequence", "masks"])
def test_zero_advantage_micro_batches_skip_their_backward_and_the_steps_are_unchanged(make_session, options):
    rewards = [parity_reward] * 4
    skipping = _steps(make_session(**GROUPS, **options), rewards)
    running = _steps(make_session(**GROUPS, **options, skip_zero_advantage_backward=False), rewards)
    skipped = [step["result"].backward_skipped for step in skipping]
    assert skipped == [_zero_micro_batches(step["advantages"], 4) for step in skipping]
    assert 0 < sum(skipped) < 4 * len(rewards)  # both kinds of micro-batch occurred
    assert [step["result"].backward_skipped for step in running] == [0] * len(rewards)
    most = skipping[skipped.index(max(skipped))]["result"]
    assert "micro-batches had zero advantages and no backward pass" in repr(most)
    for skipping_step, running_step in zip(skipping, running, strict=True):
        _assert_same_step(skipping_step, running_step)


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def test_a_step_with_no_gradient_at_all_gives_the_zero_gradient_running_it_would_have(make_session):
    # The first step runs one backward pass (which parameters it reaches is not known before one
    # has run); a later all-zero step runs none and the optimizer still decays and moves the weights.
    rewards = [constant_reward, parity_reward, constant_reward]
    skipping = _steps(make_session(**GROUPS), rewards)
    running = _steps(make_session(**GROUPS, skip_zero_advantage_backward=False), rewards)
    assert [step["result"].backward_skipped for step in skipping] == [
        3, _zero_micro_batches(skipping[1]["advantages"], 4), 4,
    ]
    assert all(grad is None or not grad.any() for grad in skipping[2]["grads"].values())
    assert any(not torch.equal(skipping[2]["weights"][n], w) for n, w in skipping[1]["weights"].items())
    for skipping_step, running_step in zip(skipping, running, strict=True):
        _assert_same_step(skipping_step, running_step)


def test_a_skipped_micro_batch_whose_loss_is_not_finite_makes_the_update_skip_as_running_it_would(make_session):
    outcomes = []
    for skip in (True, False):
        session = make_session(**GROUPS, skip_zero_advantage_backward=skip)
        _steps(session, [parity_reward])
        session.reward_funcs = [constant_reward]
        session.generate(), session.score(), session.advantages()
        with torch.no_grad():  # after sampling: the log-probs of the loss pass are not finite
            session.model.model.norm.weight.fill_(float("nan"))
        skipped = session.loss().backward_skipped
        with pytest.warns(UserWarning, match="the gradient is not finite"):
            outcomes.append((skipped, session.update()["update_skipped"]))
    assert outcomes == [(4, 1.0), (0, 1.0)]


@pytest.mark.parametrize("overrides",
                         [dict(beta=0.04), dict(entropy_coef=0.01), dict(skip_zero_advantage_backward=False)],
                         ids=["kl", "entropy_bonus", "off"])
def test_a_kl_term_or_an_entropy_bonus_gives_zero_advantages_a_gradient_so_nothing_is_skipped(make_session, overrides):
    session = make_session(**GROUPS, **overrides)
    (step,) = _steps(session, [parity_reward])  # the policy moves away from the reference
    (step,) = _steps(session, [constant_reward])
    assert not step["advantages"].any()
    assert step["result"].backward_skipped == 0  # all 4 would be skipped otherwise
    has_gradient = any(grad is not None and grad.any() for grad in step["grads"].values())
    assert has_gradient == ("skip_zero_advantage_backward" not in overrides)


TWO_PROCESSES = """
import json, sys
import torch
from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.tasks import default_task
from grpo_lab.tasks.addition import completion_text


def parity_reward(completions, answer, **kwargs):
    return [1.0 if int(a) % 2 == 0 else float(sum(map(ord, completion_text(c))) % 7)
            for c, a in zip(completions, answer)]


out, skip = sys.argv[1], sys.argv[2] == "skip"
task = default_task()
config = GRPOConfig(output_dir=out, max_steps=3, save_steps=100, num_generations=4, per_device_train_batch_size=4,
                    gradient_accumulation_steps=4, max_completion_length=4, learning_rate=1e-3, weight_decay=0.1,
                    seed=0, disable_tqdm=True, skip_zero_advantage_backward=skip)
trainer = GRPOTrainer(task.model, [parity_reward], args=config, train_dataset=task.train_dataset)
seen = []
trainer.session.on(lambda stage, result: seen.append(
    [result.backward_skipped, int((result.advantages.advantages_B.reshape(-1, 4) == 0).all(1).sum()),
     bool((result.advantages.advantages_B[-4:] == 0).all())]) if stage == "loss" else None)
trainer.train()
rank = trainer.accelerator.process_index
with open(f"{out}/seen-{rank}.json", "w") as report:
    json.dump(seen, report)
torch.save({n: p.detach().clone() for n, p in trainer.session.model.named_parameters()}, f"{out}/weights-{rank}.pt")
trainer.close()
"""


@pytest.mark.slow
def test_two_processes_skip_only_before_the_micro_batch_that_averages_the_gradients(tmp_path):
    (tmp_path / "run.py").write_text(TWO_PROCESSES)
    launch = launch_two("--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no")
    for mode in ("skip", "run"):
        done = subprocess.run([*launch, str(tmp_path / "run.py"), str(tmp_path / mode), mode], capture_output=True,
                              text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
    seen = [json.loads((tmp_path / "skip" / f"seen-{rank}.json").read_text()) for rank in (0, 1)]
    for skipped, zero, last_zero in (step for rank in seen for step in rank):
        assert skipped == zero - last_zero  # all but the last micro-batch, whose backward averages over processes
    assert sum(step[0] for rank in seen for step in rank) > 0
    running = torch.load(tmp_path / "run" / "weights-0.pt")
    for rank in (0, 1):  # every process's copy: one that skipped its update alone would drift apart
        skipping = torch.load(tmp_path / "skip" / f"weights-{rank}.pt")
        assert skipping.keys() == running.keys()
        assert all(torch.equal(skipping[name], running[name]) for name in running)


def test_mixture_of_experts_models_run_every_backward_pass(make_session, tiny_moe):
    # a backward pass gives each expert its tokens reach a zero gradient, which AdamW acts on
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2MoeConfig

    from grpo_lab.core.models import routes_to_experts

    assert routes_to_experts(AutoModelForCausalLM.from_pretrained(tiny_moe))
    assert routes_to_experts(type("M", (), {"config": Qwen2MoeConfig()}))
    assert not routes_to_experts(type("M", (), {"config": LlamaConfig()}))
    session = make_session(model=tiny_moe, reward_funcs=[constant_reward], **GROUPS, router_aux_loss_coef=0.0)
    (step,) = _steps(session, [constant_reward])
    assert not step["advantages"].any() and step["result"].backward_skipped == 0
