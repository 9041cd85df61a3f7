"""rollout_func: a user's function generates the completions (multi-turn, environments), with
env_mask tokens kept as context but not trained on; session.sample() as its building block."""

import sys
import types

import pytest
import torch

from grpo_lab import GRPOSession, GRPOTrainer
from grpo_lab.export import ExportError
from grpo_lab.views import data
from tests.conftest import SMALL, run_exported_step

FEEDBACK = " ok "


def single_turn(prompts, session):
    """What the backend does, by way of session.sample()."""
    out = session.sample(prompts)
    return {"prompt_ids": out["prompt_ids"], "completion_ids": out["completion_ids"], "logprobs": out["logprobs"]}


def two_turns(prompts, session):
    """A first answer, an environment's fixed reply (env_mask 0), then a second answer to it."""
    first = session.sample(prompts)
    reply = session.tokenizer.encode(FEEDBACK, add_special_tokens=False)
    second = session.sample([p + c + reply for p, c in zip(first["prompt_ids"], first["completion_ids"])])
    pairs = list(zip(first["completion_ids"], second["completion_ids"]))
    return {
        "prompt_ids": first["prompt_ids"],
        "completion_ids": [c + reply + d for c, d in pairs],
        "logprobs": None,
        "env_mask": [[1] * len(c) + [0] * len(reply) + [1] * len(d) for c, d in pairs],
        "first_answer": first["texts"],
    }


def second_answer_digits(completions, first_answer, **kwargs):
    """Reads the rollout function's extra key: digits written after the environment's reply."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(sum(ch.isdigit() for ch in text.split(FEEDBACK, 1)[-1])) for text in texts]


def _session(task, tmp_path, rollout_func, reward_funcs=None, **overrides):
    config = task.config(**{**SMALL, "output_dir": str(tmp_path / "out"), **overrides})
    return GRPOSession(task.model, task.reward_funcs if reward_funcs is None else reward_funcs, args=config,
                       train_dataset=task.train_dataset, rollout_func=rollout_func)


def test_a_rollout_function_sampling_like_the_backend_trains_identically(task, tmp_path):
    plain = _session(task, tmp_path / "a", None)  # one after the other: sessions share torch's generator
    rows = [plain.step() for _ in range(2)]
    custom = _session(task, tmp_path / "b", single_turn)
    for row in rows:
        assert ({k: v for k, v in row.items() if k != "step_time"}
                == {k: v for k, v in custom.step().items() if k != "step_time"})
    assert plain.completions_log.equals(custom.completions_log)
    for p, q in zip(plain.model.parameters(), custom.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_environment_tokens_are_context_but_not_trained(task, tmp_path):
    session = _session(task, tmp_path, two_turns, reward_funcs=[second_answer_digits], temperature=3.0)
    rollout = session.generate()
    reply = len(session.tokenizer.encode(FEEDBACK, add_special_tokens=False))
    assert rollout.env_mask_BT is not None and rollout.columns["first_answer"]
    lengths = rollout.completion_mask_BT.sum(1) - reply
    assert torch.equal(rollout.completion_lengths_B, lengths)
    session.score()
    advantages = session.advantages()
    assert advantages.advantages_B.abs().sum() > 0, "the check needs advantages that are not all zero"
    result = session.loss()
    grads = {n: p.grad.clone() for n, p in session.model.named_parameters() if p.grad is not None}

    # By hand: dapo with ratio 1 has the gradient of -sum(A_i * logp_it over generated tokens) / their count,
    # the log-probs from one plain pass over the whole sequence (environment tokens included as context).
    model = session.model
    model.zero_grad(set_to_none=True)
    ids = torch.cat([rollout.prompt_ids_BP, rollout.completion_ids_BT], 1)
    mask = torch.cat([rollout.prompt_mask_BP, rollout.completion_mask_BT], 1)
    P = rollout.prompt_ids_BP.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    logprobs = (torch.log_softmax(logits[:, P - 1:-1].float() / 3.0, -1)
                .gather(-1, rollout.completion_ids_BT[..., None])[..., 0])
    generated = rollout.generated_mask_BT.float()
    by_hand = -(advantages.advantages_B[:, None] * logprobs * generated).sum() / generated.sum()
    by_hand.backward()
    assert result.loss == pytest.approx(-float((advantages.advantages_B * generated.sum(1)).sum() / generated.sum()),
                                        abs=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    values = data.token_values(session, 0, "logprob")
    first = rollout.env_mask_BT[0].tolist().index(0)  # the environment's reply
    assert [v is None for _, v in values[first:first + reply]] == [True] * reply and values[0][1] is not None
    table = session.advantages_result.to_pandas()  # the extra key is a column of the tables and of the log
    assert table["first_answer"].tolist() == rollout.columns["first_answer"] and "env_mask" not in table
    assert session.update()["completions/mean_length"] == pytest.approx(float(lengths.float().mean()))
    assert session.completions_log["first_answer"].tolist() == rollout.columns["first_answer"]


def test_sample_takes_token_ids_as_it_takes_texts(task, tmp_path):
    session = _session(task, tmp_path, None)
    prompts = [task.train_dataset[i]["prompt"] for i in range(3)]
    torch.manual_seed(0)
    from_messages = session.sample(prompts)
    torch.manual_seed(0)
    from_ids = session.sample(from_messages["prompt_ids"])
    assert from_ids == from_messages
    assert from_ids["logprobs"] is None and all(from_ids["texts"])
    with pytest.raises(ValueError, match="one kind"):
        session.sample([[5, 6], "12+3="])
    with pytest.raises(ValueError, match=r"wrap one prompt's token ids in a list, sample\(\[ids\]\)"):
        session.sample(from_ids["prompt_ids"][0])
    with pytest.raises(ValueError, match=r"prompt 1, whose token id 999 at position 1 "
                                         r"is outside the model's vocabulary"):
        session.sample([[5, 6], [7, 999]])
    with pytest.raises(ValueError, match=r"prompt 0 is a float: '1.5'"):
        session.sample([1.5])
    with pytest.raises(ValueError, match=r"max_new_tokens must be an int from 1 to max_completion_length \(8\); "
                                         r"got True"):
        session.sample(["12+3="], max_new_tokens=True)


def _returning(**output):
    def rollout(prompts, session):
        base = single_turn(prompts, session)
        return {**base, **{k: v(base) if callable(v) else v for k, v in output.items()}}
    return rollout


@pytest.mark.parametrize("output, message", [
    (dict(prompt_ids=lambda b: b["prompt_ids"][1:]), r"'prompt_ids' with 7 entries; it must hold one entry per prompt"),
    (dict(completion_ids=lambda b: [c + [10**6] for c in b["completion_ids"]]),
     r"completion_ids\[0\], whose token id 1000000 at position \d+ is outside the model's vocabulary \[0, 286\)"),
    (dict(completion_ids=lambda b: torch.ones(8, 6, dtype=torch.long)),
     r"'completion_ids' as a 2-D Tensor: return one list per"),
    (dict(completion_ids=lambda b: [c + [0, 0] for c in b["completion_ids"]]),
     r"completion_ids\[0\] ending with the pad token \(0\)"),
    (dict(prompt_ids=lambda b: [[]] * 8), r"prompt_ids\[0\] = \[\]: each entry must be a non-empty list"),
    (dict(logprobs=lambda b: [[0.0]] * 8), r"logprobs\[0\].*one log-prob \(a finite float\) per token"),
    (dict(env_mask=lambda b: [[2] * len(c) for c in b["completion_ids"]]), r"env_mask\[0\].*flag \(0 or 1\)"),
    (dict(answer=lambda b: ["1"] * 8), r"returned 'answer', which reward functions already receive"),
    (dict(logprobs=lambda b: [[float("nan")] * len(c) for c in b["completion_ids"]]), r"logprobs\[0\].*a finite float"),
    (dict(tool_calls=lambda b: [[{"name": "add"}]] * 8), r"'tool_calls' with \[\{'name': 'add'\}\]: it is a count"),
    (dict(completion_ids=lambda b: [[5] * 130] * 8),
     r"130 completion tokens \(entry 0\), more than the model's 128 positions"),
])
def test_bad_output_is_refused_and_the_batch_is_not_lost(task, tmp_path, output, message):
    session = _session(task, tmp_path, _returning(**output))
    sampler = session.engine.sampler.state_dict()
    with pytest.raises(ValueError, match=message):
        session.generate()
    assert session.engine.sampler.state_dict() == sampler


def appends_to_prompts(prompts, session):
    for prompt in prompts:
        prompt.append({"role": "assistant", "content": "changed"})
    return single_turn(prompts, session)


def test_the_function_gets_a_copy_of_the_prompts(task, tmp_path):
    rollout = _session(task, tmp_path, appends_to_prompts).generate()
    assert all(len(prompt) == 1 for prompt in rollout.prompts)


def test_token_ids_as_numpy_or_tensors_are_taken(task, tmp_path):
    import numpy as np

    converted = _returning(prompt_ids=lambda b: [np.array(p) for p in b["prompt_ids"]],
                           completion_ids=lambda b: [torch.tensor(c) for c in b["completion_ids"]])
    rollout = _session(task, tmp_path, converted).generate()
    assert rollout.completion_lengths_B.min() > 0


def test_an_env_mask_that_trains_nothing_is_pointed_out(task, tmp_path):
    nothing = _returning(env_mask=lambda b: [[0] * len(c) for c in b["completion_ids"]])
    with pytest.warns(UserWarning, match="marks no token of this batch as the model's"):
        _session(task, tmp_path, nothing).generate()


def calls_generate(prompts, session):
    return session.generate()


def test_missing_keys_and_non_dicts_are_refused(task, tmp_path):
    with pytest.raises(ValueError, match=r"returned no 'logprobs'.*logprobs may be None"):
        _session(task, tmp_path, lambda prompts, session: {"prompt_ids": [], "completion_ids": []}).generate()
    with pytest.raises(TypeError, match="must return a dict"):
        _session(task, tmp_path, lambda prompts, session: [1]).generate()
    with pytest.raises(TypeError, match="rollout_func must be a function"):
        _session(task, tmp_path, "two_turns")
    with pytest.raises(TypeError, match=r"must take two arguments, \(prompts, session\); <lambda>\(prompts\) does not"):
        _session(task, tmp_path, lambda prompts: {})
    session = _session(task, tmp_path, calls_generate)
    sampler = session.engine.sampler.state_dict()
    with pytest.raises(RuntimeError, match=r"called from inside the rollout function: "
                                           r"sample .* session.sample\(prompts\)"):
        session.generate()
    assert session.engine.sampler.state_dict() == sampler


def test_reward_functions_are_checked_against_the_returned_keys(task, tmp_path):
    session = _session(task, tmp_path, single_turn, reward_funcs=[second_answer_digits])  # built: keys unknown yet
    session.generate()
    with pytest.raises(TypeError, match=r"'second_answer_digits' requires first_answer, which no call passes"):
        session.score()


def test_evaluate_uses_the_rollout_function(task, tmp_path):
    session = _session(task, tmp_path, two_turns, reward_funcs=[second_answer_digits])
    metrics = session.evaluate(task.eval_dataset.select(range(4)))
    assert metrics["eval_rewards/second_answer_digits/mean"] > 0  # its first_answer= came from the rollout function


def test_save_load_keeps_an_importable_rollout_function(task, tmp_path):
    session = _session(task, tmp_path, two_turns)
    session.step()
    session.save(tmp_path / "saved")
    loaded = GRPOSession.load(tmp_path / "saved")
    assert loaded.rollout_func is two_turns
    assert loaded.step()["step"] == 2

    local = _session(task, tmp_path / "local", _returning())
    local.save(tmp_path / "local_saved")
    with pytest.raises(ValueError, match=r"rollout function saved in .* could not be stored.*"
                                         r"pass it again.*rollout_func=\.\.\."):
        GRPOSession.load(tmp_path / "local_saved")
    assert GRPOSession.load(tmp_path / "local_saved", rollout_func=single_turn).rollout_func is single_turn

    # Defined where a new process will not find it (a notebook's __main__, a module since renamed).
    scratch = types.ModuleType("scratch_rollouts")
    exec("def gone(prompts, session):\n    return session.sample(prompts)", scratch.__dict__)
    sys.modules["scratch_rollouts"] = scratch
    try:
        _session(task, tmp_path / "gone", scratch.gone).save(tmp_path / "gone_saved")
    finally:
        del sys.modules["scratch_rollouts"]
    with pytest.raises(ValueError, match=r"cannot be found in this process .*"
                                         r"pass it again: GRPOSession.load\(path, rollout_func=\.\.\.\)"):
        GRPOSession.load(tmp_path / "gone_saved")


def test_a_half_used_batch_with_environment_tokens_resumes_exactly(task, tmp_path):
    whole = _session(task, tmp_path / "whole", two_turns, reward_funcs=[second_answer_digits],
                     temperature=3.0, num_iterations=2)
    rows = [whole.step() for _ in range(2)]
    assert whole.batch_step == 0  # both updates used the one batch
    first = _session(task, tmp_path / "half", two_turns, reward_funcs=[second_answer_digits],
                     temperature=3.0, num_iterations=2)
    first.step()
    assert first.batch_step == 1 and first.rollout.env_mask_BT is not None  # the batch is kept for its second update
    first.save(tmp_path / "half_saved")
    resumed = GRPOSession.load(tmp_path / "half_saved")
    second = resumed.step()
    assert ({k: v for k, v in second.items() if k != "step_time"}
            == {k: v for k, v in rows[1].items() if k != "step_time"})


def test_trainer_takes_a_rollout_function_and_resumes_with_it(task, tmp_path):
    config = task.config(**{**SMALL, "output_dir": str(tmp_path / "out"), "max_steps": 2, "save_steps": 1})
    trainer = GRPOTrainer(task.model, [second_answer_digits], args=config, train_dataset=task.train_dataset,
                          rollout_func=two_turns)
    trainer.train()
    last = trainer.session.last_metrics
    assert trainer.session.rollout_func is two_turns and trainer.session.global_step == 2
    trainer.close()
    config = task.config(**{**SMALL, "output_dir": str(tmp_path / "again"), "max_steps": 2, "save_steps": 1})
    again = GRPOTrainer(task.model, [second_answer_digits], args=config, train_dataset=task.train_dataset,
                        rollout_func=two_turns)
    again.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    resumed = again.session.last_metrics
    assert again.session.rollout_func is two_turns
    assert {k: v for k, v in resumed.items() if k != "step_time"} == {k: v for k, v in last.items() if k != "step_time"}
    again.close()


def test_export_carries_the_rollout_function(task, tmp_path):
    session = _session(task, tmp_path, two_turns, reward_funcs=[second_answer_digits], max_steps=1)
    script = session.export_script(tmp_path / "train.py")
    first = session.step()
    text = script.read_text()
    assert "rollout_func=two_turns," in text and "from tests.test_rollout_func import" in text
    assert run_exported_step(script, tmp_path) == {k: v for k, v in first.items() if k != "step_time"}
    with pytest.raises(ExportError, match=r"Rollout function is a lambda.*def my_rollout\(prompts, session\)"):
        _session(task, tmp_path / "l",
                 lambda prompts, session: single_turn(prompts, session)).export_script(tmp_path / "x.py")
