"""Live findings on real short runs: raised after the optimizer step whose history shows them, once
per cause, as "finding" events, and kept with doctor()'s in session.findings (grpo_lab/doctor/live.py,
grpo_lab/session/findings.py)."""

from tests.test_doctor import always


def _codes(findings):
    return [(finding.code, finding.severity, finding.evidence.get("step")) for finding in findings]


def test_the_demo_configuration_raises_nothing_above_info_in_doctor_or_over_its_100_steps(task, tmp_path):
    from grpo_lab import GRPOSession

    config = task.config(output_dir=str(tmp_path))
    assert config.max_steps == 100  # what `grpo-lab demo` runs
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset)
    assert session.doctor().above("info") == []
    session.run(100, progress=False)
    assert [f for f in session.live_findings if f.severity != "info"] == [], _codes(session.live_findings)


def test_tied_groups_and_truncation_are_raised_at_the_fifth_step_in_a_row(make_session):
    session = make_session(reward_funcs=[always(0.0)], max_completion_length=2, max_steps=6)
    preflight = session.doctor()
    heard = []
    session.on(lambda event, payload: heard.append(payload) if event == "finding" else None)
    session.run(6, progress=False)
    assert _codes(session.live_findings) == [("no_signal_steps", "error", 5), ("truncation_in_training", "error", 5)]
    assert heard == session.live_findings  # one event each, and the sixth step raised nothing again
    tied, cut = session.live_findings
    assert tied.evidence["steps in a row"] == 5 and "learned nothing" in tied.message
    assert cut.evidence["completions/clipped_ratio, mean of 5 steps"] == 1.0
    assert cut.fix.startswith("max_completion_length=4")
    # doctor()'s findings and the live ones together, most severe first
    assert sorted(session.findings.codes) == sorted(preflight.codes + ["no_signal_steps", "truncation_in_training"])
    assert session.findings[0].severity == "error"


def test_a_large_learning_rate_collapses_entropy_and_climbs_the_kl(make_session):
    session = make_session(learning_rate=1e-2, beta=0.1, num_iterations=2, max_steps=6)
    session.run(6, progress=False)
    raised = {finding.code: finding for finding in session.live_findings}
    assert raised["entropy_collapse"].severity == "warning"
    assert raised["entropy_collapse"].evidence["entropy now"] < 0.25 * raised["entropy_collapse"].evidence[
        "entropy early"]
    kl = raised["kl_climbing"]
    assert kl.severity == "warning" and kl.evidence["kl now"] >= 1.5 * kl.evidence["kl before"]
    assert "raise beta" in kl.fix


def test_undo_takes_back_the_findings_of_the_steps_it_undoes_and_they_are_raised_again(make_session):
    session = make_session(reward_funcs=[always(0.0)], max_completion_length=2, max_steps=8, undo_steps=2)
    session.run(5, progress=False)
    raised = _codes(session.live_findings)
    assert raised == [("no_signal_steps", "error", 5), ("truncation_in_training", "error", 5)]
    session.undo(1)
    assert session.live_findings == [] and session.findings == []
    session.run(1, progress=False)  # step 5 again: five steps in a row once more, and the rate limit forgot them
    assert _codes(session.live_findings) == raised
    session.run(1, progress=False)
    assert _codes(session.live_findings) == raised  # step 6 repeats nothing


def test_a_saved_session_keeps_its_findings_and_their_rate_limit(make_session, tmp_path):
    from grpo_lab import GRPOSession

    session = make_session(reward_funcs=[always(0.0)], max_completion_length=2, max_steps=8)
    session.doctor()
    session.run(5, progress=False)
    path = session.save(tmp_path / "saved")
    loaded = GRPOSession.load(path, reward_funcs=[always(0.0)])
    assert loaded.findings == session.findings and loaded.live_findings == session.live_findings
    loaded.run(1, progress=False)
    assert _codes(loaded.live_findings) == _codes(session.live_findings)  # not raised again at step 6


def test_a_reward_for_length_rises_while_correctness_does_not(make_session):
    def correctness_reward(completions, **kwargs):  # the task made too hard for this model: never correct
        return [0.0] * len(completions)

    def verbosity(completion_ids, **kwargs):  # pays for length alone
        return [len(ids) / 32 for ids in completion_ids]

    session = make_session(reward_funcs=[correctness_reward, verbosity], max_completion_length=32, max_steps=12)
    session.run(12, progress=False)
    raised = [f for f in session.live_findings if f.code == "reward_rising_with_length"]
    assert raised, _codes(session.live_findings)
    finding = raised[0]
    assert finding.severity == "warning" and "'correctness_reward'" in finding.message
    early, now = (float(v) for v in finding.evidence["completions/mean_length early/now"].split("/"))
    assert now >= 1.5 * early
    assert finding.evidence["rewards/correctness_reward/mean early/now"] == "0/0"
    assert "reward_weights" in finding.fix and "max_completion_length" in finding.fix


def test_the_configs_thresholds_apply_to_the_live_rules_from_the_next_step(make_session):
    session = make_session(reward_funcs=[always(0.0)], max_completion_length=2, max_steps=4,
                           doctor_thresholds={"persistent_steps": 2})
    session.run(2, progress=False)
    assert _codes(session.live_findings) == [("no_signal_steps", "error", 2), ("truncation_in_training", "error", 2)]
    cut = session.live_findings[1]
    assert "the last 2 steps" in cut.message and cut.evidence["completions/clipped_ratio, mean of 2 steps"] == 1.0
    # an edit between steps: the next step's rules read it (the warning threshold, in the evidence)
    session.config.doctor_thresholds = {"persistent_steps": 2, "repeat_after_steps": 1, "truncation_warning": 0.5}
    session.run(1, progress=False)
    assert _codes(session.live_findings)[2:] == [("no_signal_steps", "error", 3),
                                                 ("truncation_in_training", "error", 3)]
    assert session.live_findings[3].evidence["threshold"] == 0.5


def test_a_learning_rate_warming_up_over_reused_batches_climbs_the_clip_ratio(make_session):
    # four optimizer steps per generation batch, a tight clipping range and a learning rate rising each
    # step: the later steps move the policy further past the range (a high temperature keeps the
    # policy from collapsing onto single tokens, where nothing would be clipped)
    session = make_session(learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=10, num_iterations=4,
                           epsilon=0.02, temperature=2.0, per_device_train_batch_size=16, max_steps=10)
    session.run(10, progress=False)
    raised = [f for f in session.live_findings if f.code == "clip_ratio_climbing"]
    assert raised, _codes(session.live_findings)
    evidence = raised[0].evidence
    now, before = evidence["clip_ratio/region_mean now"], evidence["clip_ratio/region_mean before"]
    assert now >= 0.2 and now >= 1.5 * before and raised[0].severity == "warning"
    assert "Lower learning_rate" in raised[0].fix
