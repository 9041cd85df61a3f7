"""The experiment layer: undo, fork and what-if (grpo_lab/session/experiments.py, grpo_lab/session/what_if.py)."""

import copy
import re

import pytest
import torch

from grpo_lab.session.stages import StageOrderError
from grpo_lab.state.run_state import rng_state


def _history(session):
    return session.history.drop(columns=["step_time"]).reset_index(drop=True)


def _weights(session):
    return {name: tensor.detach().clone() for name, tensor in session.model.state_dict().items()}


def _same_tensors(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_tensors(x, y) for x, y in zip(a, b))
    return a == b


def test_undo_three_steps_restores_the_run_and_the_next_steps_repeat(make_session):
    session = make_session(undo_steps=3)
    before = (_weights(session), rng_state(), session.engine.sampler.state_dict())
    session.run(3, progress=False)
    first = _history(session)
    assert session.undo(3) == 0 and session.global_step == 0 and session.history.empty
    assert _same_tensors(_weights(session), before[0])
    assert session.engine.optimizer.state_dict()["state"] == {}  # AdamW as before its first step
    assert _same_tensors(session.random_state(), before[1])
    assert session.engine.sampler.state_dict() == before[2]
    session.run(3, progress=False)
    assert _history(session).equals(first)


def test_undo_after_a_stage_drops_that_batch_first(make_session):
    session = make_session()
    session.run(2, progress=False)
    weights = _weights(session)
    session.generate()
    assert session.undo() == 2 and session.next_stage == "generate" and _same_tensors(_weights(session), weights)
    assert session.undo() == 1 and len(session.history) == 1


def test_undo_beyond_its_ring_or_when_off_fails_and_changes_nothing(make_session):
    session = make_session(undo_steps=1)
    session.run(3, progress=False)
    weights, history = _weights(session), _history(session)
    with pytest.raises(ValueError, match=r"undo\(2\) goes back further than the 1 step.*undo_steps"):
        session.undo(2)
    with pytest.raises(ValueError, match="whole number"):
        session.undo(0)
    assert _same_tensors(_weights(session), weights) and _history(session).equals(history)
    session.config.undo_steps = 0
    session.run(1, progress=False)
    with pytest.raises(RuntimeError, match="undo_steps = 2"):
        session.undo()
    assert session.snapshots == []


def test_a_fork_without_edits_stepped_beside_its_parent_stays_bitwise_equal(make_session):
    parent = make_session(max_steps=20)
    parent.run(2, progress=False)
    child = parent.fork("twin")
    assert child.name == "twin" and child.fork_point == 2 and parent.branches == [child]
    for _ in range(10):  # in turns: each draws from its own random state
        parent.step()
        child.step()
    assert _history(child).equals(_history(parent))
    assert _same_tensors(_weights(child), _weights(parent))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(parent.model.parameters(), child.model.parameters()))


def test_sessions_built_together_draw_what_each_would_alone_whichever_runs_first(make_session):
    alone = make_session()
    alone.run(3, progress=False)
    first, second = make_session(), make_session()  # both built before either draws
    second.run(3, progress=False)
    first.run(3, progress=False)
    assert _history(first).equals(_history(alone)) and _history(second).equals(_history(alone))


def test_a_fork_applies_its_edits_and_leaves_the_parent_as_it_was(make_session, tmp_path):
    parent = make_session()
    parent.run(1, progress=False)
    child = parent.fork(learning_rate=3e-4)
    assert child.name == "session-1" and child.config.learning_rate == 3e-4 and parent.config.learning_rate == 1e-3
    assert child.config_changes == [{"step": 2, "field": "learning_rate", "old": 1e-3, "new": 3e-4}]
    child.step()
    assert child.history["learning_rate"].iloc[-1] != parent.history["learning_rate"].iloc[-1]
    with pytest.raises(AttributeError, match="no field 'learning_rat'"):
        parent.fork(learning_rat=1.0)
    with pytest.raises(ValueError, match="num_generations"):
        parent.fork(num_generations=2)  # built once: a fork cannot change it
    assert parent.branches == [child] and parent.global_step == 1
    script = child.export_script(tmp_path / "fork" / "train.py").read_text()
    assert "learning_rate=0.0003" in script
    with pytest.warns(UserWarning, match=r"learning_rate=0.001 is already this session's value") as caught:
        same = parent.fork("same-rate", learning_rate=1e-3)
    assert caught[0].filename == __file__  # pointed at the caller's line
    assert repr(parent.branches) == f"[{child!r}, {same!r}]" and "name='same-rate'" in repr(same)
    assert repr(child).startswith("GRPOSession(name='session-1', step=2")  # stepped once after the fork
    with pytest.warns(UserWarning, match=r"learning_rate=0.001 is already this session's value; the other edits"):
        mixed = parent.fork("mixed", learning_rate=1e-3, temperature=0.7)
    assert mixed.config.temperature == 0.7


def test_a_lora_fork_shares_the_base_model_and_copies_the_adapter(task, tmp_path):
    from peft import LoraConfig

    from grpo_lab import GRPOSession
    from tests.conftest import SMALL

    config = task.config(**{**SMALL, "output_dir": str(tmp_path / "out")})
    parent = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                         peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    parent.run(1, progress=False)
    child = parent.fork()
    pairs = list(zip(parent.model.named_parameters(), child.model.named_parameters()))
    assert all(a is b for (name, a), (_, b) in pairs if "lora_" not in name)  # the frozen base: one copy
    adapters = [(a, b) for (name, a), (_, b) in pairs if "lora_" in name]
    assert adapters and all(a.data_ptr() != b.data_ptr() and torch.equal(a, b) for a, b in adapters)
    child.step()
    parent.step()
    assert _history(child).equals(_history(parent))
    child.save(tmp_path / "fork")
    loaded = GRPOSession.load(tmp_path / "fork")
    assert _history(loaded).equals(_history(child))


def _pending(session):
    return (session.rollout.completion_ids_BT, session.scores.rewards_BF, session.advantages_result.advantages_B)


def test_what_if_leaves_the_session_as_it_was_and_matches_its_own_loss(make_session):
    session = make_session(temperature=1.5)
    session.run(1, progress=False)
    session.generate(), session.score(), session.advantages()
    own = session.loss()
    grads = [p.grad.clone() for p in session.model.parameters()]
    before = (_weights(session), session.random_state(), [t.clone() for t in _pending(session)], _history(session))
    found = session.what_if([{"loss_type": "dapo"}, {"loss_type": "dapo", "epsilon": 0.2}, {"loss_type": "grpo"},
                             {"scale_rewards": "batch"}])
    assert _same_tensors(_weights(session), before[0]) and _same_tensors(session.random_state(), before[1])
    assert _same_tensors(list(_pending(session)), before[2]) and _history(session).equals(before[3])
    assert all(torch.equal(p.grad, g) for p, g in zip(session.model.parameters(), grads))
    table = found.to_pandas()
    assert list(table["loss_type"]) == ["dapo", "dapo", "grpo", "dapo"]  # the session's own value where not varied
    assert table["loss"][0] == own.loss
    own_norm = float(torch.cat([g.flatten() for g in grads]).double().norm())
    assert table["grad_norm"][0] == pytest.approx(own_norm, rel=1e-12)
    assert (0, 1) in found.equal and found.cosine.iloc[0, 1] == pytest.approx(1.0)
    assert session.update()["loss"] == own.loss  # the pending gradients are still loss()'s


def test_what_if_flags_loss_types_equal_exactly_where_their_formulas_agree(make_session):
    session = make_session(temperature=1.5)  # one micro-batch per step: dapo and bnpo divide by the same tokens
    session.generate(), session.score()
    found = session.what_if(loss_type=["dapo", "bnpo", "grpo"])
    lengths = session.rollout.completion_lengths_B
    assert (0, 1) in found.equal
    assert lengths.unique().numel() > 1  # completions of several lengths: grpo's per-sequence mean weighs them apart
    assert (0, 2) not in found.equal and (1, 2) not in found.equal


def test_what_if_refuses_bad_settings_and_changes_nothing(make_session):
    session = make_session()
    with pytest.raises(StageOrderError, match="session.generate"):
        session.what_if(loss_type="grpo")
    session.generate(), session.score()
    weights = _weights(session)
    with pytest.raises(ValueError, match="temperature is not among them.*fork"):
        session.what_if(temperature=[0.5, 1.0])
    with pytest.raises(ValueError, match="loss_type='cispo'.*epsilon_high=5.0"):
        session.what_if(loss_type=["dapo", "cispo"])
    with pytest.raises(TypeError, match="list of settings or keyword values"):
        session.what_if([{"loss_type": "grpo"}], beta=0.1)
    with pytest.raises(ValueError, match=r"what_if\(beta=\[\]\).*holds none"):
        session.what_if(beta=[], epsilon=[0.2])
    assert _same_tensors(_weights(session), weights) and session.next_stage == "advantages"


def test_the_curves_follow_an_undo(make_session):
    from grpo_lab.views.curves import CurvesView

    session = make_session()
    view = CurvesView(session)
    session.run(3, progress=False)
    assert view.curves.steps == 3
    session.undo(2)
    assert view.curves.steps == 1
    session.run(1, progress=False)
    reward = next(s for p in view.curves.panels for s in p.series if s.name == "reward")
    assert list(reward.x) == [1, 2] and view.curves.steps == 2
    view.close()


def test_a_saved_fork_keeps_its_name_and_fork_point_for_comparisons(make_session, tmp_path):
    from grpo_lab import GRPOSession, compare

    parent = make_session()
    parent.run(1, progress=False)
    child = parent.fork("low-lr", learning_rate=1e-4)
    child.run(1, progress=False)
    child.save(tmp_path / "fork")
    loaded = GRPOSession.load(tmp_path / "fork")
    assert (loaded.name, loaded.fork_point) == ("low-lr", 1)
    view = compare(parent, tmp_path / "fork")
    assert [run.name for run in view.runs] == ["run 1", "low-lr"] and view.runs[1].fork_point == 1
    view.close()


def test_what_if_token_weights_are_the_losses_derivatives_by_hand(make_session):
    session = make_session(temperature=1.5)  # one micro-batch of 8, on-policy: every ratio is 1
    session.generate(), session.score()
    found = session.what_if(loss_type=["dapo", "grpo"])
    advantages = session.advantages().advantages_B[found.sample_index_B]
    mask = session.rollout.generated_mask_BT[found.sample_index_B].float()
    # dapo: L = -sum_bt m A_b r_bt / N with N the step's tokens; d L / d log pi_bt = -m A_b / N (r = 1)
    dapo = -mask * advantages[:, None] / mask.sum()
    # grpo: L = -mean_b sum_t m A_b r_bt / |y_b|; d L / d log pi_bt = -m A_b / (|y_b| B)
    grpo = -mask * advantages[:, None] / (mask.sum(1, keepdim=True) * len(mask))
    torch.testing.assert_close(found.token_weights[0], dapo, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(found.token_weights[1], grpo, rtol=1e-5, atol=1e-8)
    html = found._repr_html_()
    # the table holds what tells the settings apart; what is alike is one line under it
    header = re.search(r"<thead>(.*?)</thead>", html, re.S).group(1)
    assert re.findall(r"<th>([^<]+)</th>", header) == ["loss_type", "loss", "grad_norm"]
    assert "The same for every setting: advantage_abs_mean" in html and "entropy" in html
    assert "−d loss / d log-prob (red: made likelier, blue: made less likely, white: 0)" in html
    assert html.count("grpo-token") > 10
    # the colours of every signed token view: a token of a completion with a positive advantage is made
    # likelier by the update, and red, as in the completions view's advantage x ratio
    shown = len(found.sample_index_B)
    rows = re.findall(r"<div><code>[^<]*</code>: (.*?)</div>", found.heatmap(completions=shown))
    assert len(rows) == shown * 2
    for row, advantage in enumerate(advantages.tolist()):
        if advantage == 0:
            continue
        colours = {colour for colour, alpha in re.findall(r"background:rgba\((\d+,\d+,\d+),([\d.]+)\)", rows[2 * row])
                   if float(alpha) > 0}  # transparent: a token the update does not move
        assert colours == {"214,39,40" if advantage > 0 else "31,119,180"}, (row, advantage)
    from grpo_lab.views.render import SIGNED_COLOURS, token_legend
    from grpo_lab.views.data import TokenScale

    assert SIGNED_COLOURS in token_legend("advantage_x_ratio", TokenScale(-1.0, 1.0, "diverging"))


def test_what_if_lookahead_steps_each_setting_and_puts_the_session_back(make_session):
    session = make_session(temperature=1.5)
    session.run(1, progress=False)
    session.generate(), session.score()
    before = (_weights(session), session.random_state(), copy.deepcopy(session.engine.optimizer.state_dict()["state"]),
              session.engine.scheduler.state_dict(), session.global_step)
    found = session.what_if(loss_type=["dapo", "grpo"], lookahead=True).to_pandas()
    assert _same_tensors(_weights(session), before[0]) and _same_tensors(session.random_state(), before[1])
    assert _same_tensors(session.engine.optimizer.state_dict()["state"], before[2])
    assert session.engine.scheduler.state_dict() == before[3] and session.global_step == before[4]
    assert (found["lookahead/kl"] > 0).all()
    # a step against the loss makes the positive-advantage completions likelier than the negative ones
    assert (found["lookahead/logprob_change_positive"] > found["lookahead/logprob_change_negative"]).all()


def test_the_dashboard_overlays_a_sessions_forks_on_request(make_session):
    from grpo_lab.views.dashboard import Dashboard

    session = make_session()
    session.name = "main"
    session.run(1, progress=False)
    dashboard = Dashboard(session)
    assert dashboard.forks.toggle.layout.display == "none"  # nothing to overlay yet
    child = session.fork("b")
    assert dashboard.forks.toggle.layout.display is None and "(1)" in dashboard.forks.toggle.description
    dashboard.forks.toggle.value = True
    assert dashboard.forks.view.names == ["main", "b"] and dashboard.curves.layout.display == "none"
    session.fork("c")
    assert dashboard.forks.view.names == ["main", "b", "c"]
    child.step()
    dashboard.forks.toggle.value = False
    assert dashboard.forks.view is None and dashboard.curves.layout.display is None
    dashboard.close()


def test_load_state_dict_drops_the_undo_points_taken_before_it(make_session):
    session = make_session()
    session.run(2, progress=False)
    state = session.state_dict()
    session.run(2, progress=False)
    session.load_state_dict(state)
    with pytest.raises(ValueError, match="further than the 0 step"):
        session.undo()
    session.run(1, progress=False)
    assert session.undo() == 2 and session.global_step == 2  # back to the loaded state, not to step 3


def test_a_snapshot_that_cannot_be_taken_turns_undo_off_and_the_step_stands(task, make_session):
    def keeps_a_function(completions, log_extra, **kwargs):
        log_extra("checker", [lambda: 0] * len(completions))  # an object a copy of the half-used batch cannot hold
        return [0.0] * len(completions)

    session = make_session(reward_funcs=[*task.reward_funcs, keeps_a_function], steps_per_generation=2)
    with pytest.warns(UserWarning, match="Undo is off for this session: the snapshot after step 1 failed"):
        session.step()
    assert session.global_step == 1 and len(session.history) == 1 and session.snapshots == []
    session.step()
    with pytest.raises(RuntimeError, match="snapshot after step 1 failed"):
        session.undo()
