"""A session's state dict holds everything it needs to continue exactly, and checkpoints carry a
format version."""

import torch
import pytest

from grpo_lab.state.checkpoint import STATE_FILE
from grpo_lab.state.run_state import FORMAT_VERSION
from tests.golden.runs import weights_digest


def _rows(session, first):
    return [{k: v for k, v in row.items() if k != "step_time"} for row in session.record.history[first:]]


def _continue(session, steps):
    first = len(session.record.history)
    for _ in range(steps):
        session.step()
    return _rows(session, first), weights_digest(session.model)


@pytest.mark.parametrize("overrides", [{}, {"num_iterations": 2, "beta": 0.04}], ids=["defaults", "two-iterations-kl"])
def test_loading_a_state_dict_continues_exactly_as_the_session_would_have(make_session, overrides):
    session = make_session(**overrides)
    session.step()
    if session.next_stage == "generate":
        session.generate(), session.score()  # a half-used batch: scored, advantages still to come
    stage = session.next_stage  # two iterations: the batch's second optimizer step, at loss()
    state = session.state_dict()
    rows, weights = _continue(session, 3)
    session.load_state_dict(state)
    assert session.next_stage == stage and len(session.history) == 1
    assert _continue(session, 3) == (rows, weights)


def test_a_state_dict_is_a_copy_that_training_does_not_change(make_session):
    session = make_session()
    session.step()
    state = session.state_dict()
    name, kept = next(iter(state["engine"]["model"].items()))
    before = kept.clone()
    moments = [s["exp_avg"].clone() for s in state["engine"]["optimizer"]["state"].values()]
    session.run(2, progress=False)
    assert torch.equal(state["engine"]["model"][name], before)
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(state["engine"]["optimizer"]["state"].values(), moments))
    assert len(state["records"]["history"]) == 1 and state["format_version"] == FORMAT_VERSION


def test_a_lora_state_dict_holds_the_adapter_only(task, tmp_path):
    from peft import LoraConfig

    from grpo_lab import GRPOSession
    from tests.conftest import SMALL

    session = GRPOSession(task.model, task.reward_funcs, train_dataset=task.train_dataset,
                          args=task.config(**{**SMALL, "output_dir": str(tmp_path / "out")}),
                          peft_config=LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    session.step()
    state = session.state_dict()
    assert state["engine"]["model"] and all("lora_" in name for name in state["engine"]["model"])
    rows, weights = _continue(session, 2)
    session.load_state_dict(state)
    assert _continue(session, 2) == (rows, weights)


def _rewrite_version(directory, version):
    state = torch.load(directory / STATE_FILE, weights_only=False)
    if version is None:
        state.pop("format_version")
    else:
        state["format_version"] = version
    torch.save(state, directory / STATE_FILE)


def test_checkpoints_carry_their_format_version_and_a_newer_one_is_refused(make_session, tmp_path):
    from grpo_lab import GRPOSession

    session = make_session()
    session.step()
    saved = session.save(tmp_path / "saved")
    assert torch.load(saved / STATE_FILE, weights_only=False)["format_version"] == FORMAT_VERSION
    _rewrite_version(saved, None)  # a checkpoint written before the version was recorded: version 0
    assert GRPOSession.load(saved).global_step == 1
    _rewrite_version(saved, FORMAT_VERSION + 1)
    with pytest.raises(ValueError, match=rf"checkpoint format version {FORMAT_VERSION + 1}; this grpo_lab reads "
                                         rf"versions 0 to {FORMAT_VERSION}\. It was written by a newer grpo_lab"):
        GRPOSession.load(saved)


def test_copied_gives_deepcopys_state_dict_with_tensors_of_its_own():
    from grpo_lab.state.run_state import copied

    exp_avg = torch.arange(4.0)
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": exp_avg}},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "foreach": None}], "note": {"a"}}
    copy = copied(state)
    exp_avg.add_(1.0)  # the optimizer's next step changes its state in place
    assert copy["state"][0]["exp_avg"].tolist() == [0.0, 1.0, 2.0, 3.0] and float(copy["state"][0]["step"]) == 3.0
    assert copy["param_groups"] == state["param_groups"] and copy["param_groups"] is not state["param_groups"]
    assert type(copy["param_groups"][0]["betas"]) is tuple and copy["note"] == {"a"}
    assert copy["note"] is not state["note"]  # other values deep-copied


def test_an_undo_point_counts_its_own_tensors_not_the_records_it_shares(make_session):
    session = make_session(undo_steps=2)
    session.step()
    first = session.snapshots[-1].nbytes
    trainable = sum(p.numel() * p.element_size() for p in session.model.parameters() if p.requires_grad)
    assert first >= 3 * trainable  # the weights and AdamW's two moments, at the least
    session.run(3, progress=False)
    assert session.snapshots[-1].nbytes == first  # three more history rows and logged batches: no more tensors
