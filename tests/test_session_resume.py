"""save() / load(): a loaded session continues exactly as the original would have."""

import json
import subprocess
import sys

from dataclasses import replace

import pandas as pd
import pytest
import torch

from grpo_lab import GRPOSession
from grpo_lab.state.checkpoint import load_saved_weights

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _comparable(history: pd.DataFrame) -> pd.DataFrame:
    return history.drop(columns=["step_time"]).reset_index(drop=True)


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_resume_in_a_new_process_equals_an_uninterrupted_run(make_session, tmp_path):
    uninterrupted = make_session(num_iterations=2)
    uninterrupted.run(5, progress=False)

    first = make_session(num_iterations=2)
    first.run(3, progress=False)  # stops in the middle of a batch that feeds two optimizer steps
    assert first.next_stage == "loss"
    first.save(tmp_path / "checkpoint")
    script = (
        "import sys; from grpo_lab import GRPOSession\n"
        "s = GRPOSession.load(sys.argv[1]); s.run(2, progress=False)\n"
        "s.history.to_json(sys.argv[2]); s.model.save_pretrained(sys.argv[3])\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "checkpoint"), str(tmp_path / "h.json"), str(tmp_path / "m")],
        check=True, cwd=ROOT,
    )
    resumed = pd.read_json(tmp_path / "h.json")
    pd.testing.assert_frame_equal(_comparable(resumed), _comparable(uninterrupted.history), check_dtype=False)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    for name, value in _weights(uninterrupted.model).items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_save_between_stages_keeps_the_pending_results(make_session, tmp_path):
    original = make_session()
    original.generate()
    original.score()
    original.save(tmp_path / "mid")
    loaded = GRPOSession.load(tmp_path / "mid")
    assert loaded.next_stage == "advantages"
    assert loaded.rollout.completion_texts == original.rollout.completion_texts
    a, b = original.step(), loaded.step()
    assert {k: v for k, v in a.items() if k != "step_time"} == {k: v for k, v in b.items() if k != "step_time"}


def _constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def test_loading_a_half_used_batch_with_other_reward_functions_says_which_scored_it(make_session, task, tmp_path):
    original = make_session(num_iterations=2)
    original.step()  # the batch feeds one more optimizer step
    original.save(tmp_path / "half")
    with pytest.warns(UserWarning, match=r"inside a generation batch scored by "
                                         r"\['correctness_reward', 'format_reward'\]; "
                                         r"its remaining 1 optimizer step\(s\) train on those scores"):
        loaded = GRPOSession.load(tmp_path / "half", reward_funcs=[*task.reward_funcs, _constant_reward])
    assert loaded.scores.reward_names == ["correctness_reward", "format_reward"]
    loaded.step()
    assert loaded.step()["rewards/_constant_reward/mean"] == 1.0  # the next batch is scored by all three


def test_a_checkpoint_that_pickled_its_state_is_refused_with_how_to_go_on(make_session, tmp_path):
    """Checkpoints of earlier versions pickled numpy's random state: loading them would unpickle."""
    import numpy as np

    from grpo_lab.state.checkpoint import STATE_FILE

    target = make_session().save(tmp_path / "old")
    state = torch.load(target / STATE_FILE, weights_only=True)
    state["per_process"][0]["rng"]["numpy"] = np.random.get_state()
    torch.save(state, target / STATE_FILE)
    with pytest.raises(ValueError, match=r"holds objects other than tensors.*numpy.*"
                                         r"GRPOSession\('.*old', \.\.\.\)"):
        GRPOSession.load(target)


def test_save_is_atomic_and_load_rejects_incomplete_checkpoints(make_session, tmp_path):
    session = make_session()
    session.step()
    target = session.save(tmp_path / "ckpt")
    assert json.loads((target / "summary.json").read_text())["global_step"] == 1
    (target / "COMPLETE").unlink()
    try:
        GRPOSession.load(target)
    except FileNotFoundError as error:
        assert "not a complete grpo_lab checkpoint" in str(error)
    else:
        raise AssertionError("an incomplete checkpoint was accepted")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt")]  # no temporary leftovers


def test_load_into_a_given_model_copies_the_saved_weights_into_that_model(make_session, task, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from grpo_lab.state.checkpoint import _copy_saved_tensors

    uninterrupted = make_session()
    uninterrupted.run(3, progress=False)
    first = make_session()
    first.run(2, progress=False)
    first.save(tmp_path / "checkpoint")
    model = AutoModelForCausalLM.from_pretrained(task.model)

    def second_model(*args, **kwargs):
        raise AssertionError("the saved tensors are copied in; no second model is built")

    with monkeypatch.context() as patch:
        patch.setattr(LlamaForCausalLM, "from_pretrained", second_model)
        resumed = GRPOSession.load(tmp_path / "checkpoint", model=model)
    assert resumed.model is model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    resumed.run(1, progress=False)
    pd.testing.assert_frame_equal(_comparable(resumed.history), _comparable(uninterrupted.history), check_dtype=False)
    for name, value in _weights(uninterrupted.model).items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0, msg=name)

    # Saved untied (the same names and shapes, one more tensor): a tied model cannot hold both, and is
    # left untouched.
    untied_dir = tmp_path / "untied"
    untied = AutoModelForCausalLM.from_pretrained(task.model, tie_word_embeddings=False)
    with torch.no_grad():
        untied.lm_head.weight.add_(1.0)
    untied.save_pretrained(untied_dir)
    tied = AutoModelForCausalLM.from_pretrained(task.model)
    before = _weights(tied)
    with pytest.raises(ValueError, match=r"stores lm_head.weight and model.embed_tokens.weight separately, "
                                         r"but the model given to load it into ties them"):
        _copy_saved_tensors(tied, untied_dir)
    assert all(torch.equal(value, before[name]) for name, value in tied.state_dict().items())
    # Saved tied, loaded untied: the file lacks lm_head.weight, so transformers' loading fills it in.
    assert not _copy_saved_tensors(untied, tmp_path / "checkpoint")
    load_saved_weights(untied, tmp_path / "checkpoint")
    saved_embedding = first.model.model.embed_tokens.weight
    for weight in (untied.model.embed_tokens.weight, untied.lm_head.weight):
        torch.testing.assert_close(weight, saved_embedding, rtol=0, atol=0)


def test_a_lora_session_resumes_exactly(task, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.conftest import SMALL

    def make():
        config = task.config(**{**SMALL, "output_dir": str(tmp_path / "out"), "learning_rate": 5e-3})
        lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
        return GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                           peft_config=lora)

    uninterrupted = make()
    uninterrupted.run(4, progress=False)
    first = make()
    first.run(2, progress=False)
    first.save(tmp_path / "checkpoint")
    with pytest.raises(ValueError, match=r"holds a PEFT adapter, "
                                         r"but the model given to load it into is not a PEFT model"):
        GRPOSession.load(tmp_path / "checkpoint", model=AutoModelForCausalLM.from_pretrained(task.model))
    other = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match=r"does not fit the PEFT model given to load it into \(unexpected: \[.*k_proj"):
        GRPOSession.load(tmp_path / "checkpoint",
                         model=get_peft_model(AutoModelForCausalLM.from_pretrained(task.model), other))
    resumed = GRPOSession.load(tmp_path / "checkpoint")  # the saved adapter comes back as a PEFT model
    resumed.run(2, progress=False)
    pd.testing.assert_frame_equal(_comparable(resumed.history), _comparable(uninterrupted.history), check_dtype=False)
    for name, value in _weights(uninterrupted.model).items():
        if "lora_" in name:
            torch.testing.assert_close(resumed.model.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_load_with_a_changed_build_time_field_takes_it_and_refuses_a_new_layout_mid_batch(make_session, task, tmp_path):
    from transformers import AutoModelForCausalLM

    session = make_session()
    session.step()
    session.save(tmp_path / "between")
    args = replace(session.config, gradient_checkpointing=True, max_steps=session.config.max_steps + 4)
    loaded = GRPOSession.load(tmp_path / "between", args=args)
    assert loaded.model.is_activation_checkpointing
    loaded.step()  # the new value is the one the session was built with, so the step runs
    changes = {change["field"]: change for change in loaded.config_changes}
    assert changes["gradient_checkpointing"] == {"step": 2, "field": "gradient_checkpointing",
                                                 "old": False, "new": True}
    assert changes["max_steps"]["new"] == session.config.max_steps + 4

    with pytest.raises(ValueError, match=r"seed=7: .*saved with seed=0, which its random state.*carry"):
        GRPOSession.load(tmp_path / "between", args=replace(session.config, seed=7))
    model = AutoModelForCausalLM.from_pretrained(task.model)
    fresh = _weights(model)
    with pytest.raises(ValueError, match=r"gradient_checkpointing changed, but the model given to load .* keeps them"):
        GRPOSession.load(tmp_path / "between", model=model, args=args)
    assert all(torch.equal(value, fresh[name]) for name, value in model.state_dict().items())  # refused before loading
    with pytest.raises(ValueError, match=r"data_seed=5: .*saved with data_seed=None"):
        GRPOSession.load(tmp_path / "between", args=replace(session.config, data_seed=5))
    same_order = replace(session.config, data_seed=session.config.seed, shuffle_dataset=None)
    assert GRPOSession.load(tmp_path / "between", args=same_order).config.data_seed == session.config.seed
    session.config.num_generations = 2  # an edit the session refuses is refused by save too, not saved
    with pytest.raises(ValueError, match="num_generations cannot change after the session is built"):
        session.save(tmp_path / "refused")
    assert session.config.num_generations == 4 and not (tmp_path / "refused").exists()
    session.generate()
    session.save(tmp_path / "mid_batch")
    with pytest.raises(ValueError, match=r"middle of a generation batch, and num_generations changed"):
        GRPOSession.load(tmp_path / "mid_batch", args=replace(session.config, num_generations=2))
