"""The live rules' arithmetic on hand-made history rows (grpo_lab/doctor/live.py)."""

import pytest

from grpo_lab.doctor import Finding
from grpo_lab.doctor.live import (
    Diagnosis,
    LiveWatch,
    clip_ratio_climbing,
    dynamic_sampling_exhausted,
    entropy_collapse,
    importance_ratio_drift,
    kl_climbing,
    length_rewarded,
    truncation,
    zero_signal,
)
from grpo_lab.doctor.thresholds import DEFAULTS, resolve

REPEAT_AFTER_STEPS = DEFAULTS.repeat_after_steps


def _rows(**series):
    """One row per step from equal-length lists of metric values."""
    length = len(next(iter(series.values())))
    return [{"step": i + 1, **{name: values[i] for name, values in series.items()}} for i in range(length)]


def test_truncation_is_raised_after_five_steps_in_a_row_at_the_doctors_thresholds():
    assert truncation(_rows(**{"completions/clipped_ratio": [1.0] * 4}), max_completion_length=8) == []
    # a step under 10% breaks the streak: the last four alone are not enough
    assert truncation(_rows(**{"completions/clipped_ratio": [0.5, 0.05, 0.5, 0.5, 0.5, 0.5]}),
                      max_completion_length=8) == []
    (warning,) = truncation(_rows(**{"completions/clipped_ratio": [0.1, 0.2, 0.3, 0.2, 0.2]}),
                            max_completion_length=8)
    assert warning.finding.severity == "warning" and warning.measure == pytest.approx(0.2)  # mean of the five
    assert warning.finding.code == "truncation_in_training"
    assert "max_completion_length=8" in warning.finding.message and "cut off" in warning.finding.message
    assert warning.finding.fix.startswith("max_completion_length=16")
    (error,) = truncation(_rows(**{"completions/clipped_ratio": [0.6] * 5}), max_completion_length=8)
    assert error.finding.severity == "error" and error.finding.evidence["step"] == 5


def test_all_groups_tied_is_an_error_after_five_steps_in_a_row():
    assert zero_signal(_rows(frac_reward_zero_std=[1.0, 1.0, 1.0, 1.0, 0.5])) == []
    (diagnosis,) = zero_signal(_rows(frac_reward_zero_std=[0.5, 1, 1, 1, 1, 1], reward=[0, 0, 0, 0, 0, 0]))
    finding = diagnosis.finding
    assert (finding.code, finding.severity) == ("no_signal_steps", "error")
    assert finding.evidence["steps in a row"] == 5 and diagnosis.measure == 5
    assert "every advantage was 0" in finding.message and "num_generations" in finding.fix


def test_dynamic_sampling_running_out_of_rounds_is_a_warning_after_five_steps_in_a_row():
    filled = "dynamic_sampling/frac_groups_filled"
    assert dynamic_sampling_exhausted(_rows(**{filled: [0.5, 0.5, 0.0, 0.5, 0.5, 0.5, 0.5]})) == []
    assert dynamic_sampling_exhausted(_rows(frac_reward_zero_std=[1.0] * 6)) == []  # dynamic sampling off
    (diagnosis,) = dynamic_sampling_exhausted(_rows(**{
        filled: [0.0, 0.25, 0.5, 0.25, 0.5, 0.5], "dynamic_sampling/rounds": [3, 10, 10, 10, 10, 10],
        "dynamic_sampling/frac_groups_dropped_too_easy": [0.9] * 6,
        "dynamic_sampling/frac_groups_dropped_too_hard": [0.05] * 6}))
    finding = diagnosis.finding
    assert (finding.code, finding.severity) == ("dynamic_sampling_exhausted", "warning")
    assert diagnosis.measure == pytest.approx(0.4)  # (0.25 + 0.5 + 0.25 + 0.5 + 0.5) / 5
    assert finding.evidence["too easy / too hard"] == "90% / 5%" and "after 10 rounds" in finding.message
    assert "dynamic_sampling_max_rounds" in finding.fix


def test_importance_ratio_drift_under_async_generation_names_the_lag():
    rows = _rows(**{"sampling/importance_sampling_ratio/mean": [0.7] * 5, "async_generation/staleness": [1.0] * 5})
    (diagnosis,) = importance_ratio_drift(rows)
    finding = diagnosis.finding
    assert finding.code == "importance_ratio_drift" and finding.evidence["async_generation/staleness"] == 1.0
    assert "1 optimizer step(s) old (async_generation)" in finding.message
    assert finding.fix.startswith("A lower learning_rate") and "async_generation=False" in finding.fix
    (synchronous,) = importance_ratio_drift(_rows(**{"sampling/importance_sampling_ratio/mean": [0.7] * 5}))
    assert "async_generation" not in synchronous.finding.message + synchronous.finding.fix


def test_entropy_collapse_compares_the_latest_steps_with_the_first():
    # early mean 1.0; latest mean (0.3 + 0.2 + 0.1) / 3 = 0.2, under 0.25 x 1.0
    (diagnosis,) = entropy_collapse(_rows(entropy=[1.0, 1.0, 1.0, 0.3, 0.2, 0.1]))
    assert diagnosis.finding.severity == "warning" and diagnosis.finding.code == "entropy_collapse"
    assert diagnosis.finding.evidence["entropy now"] == pytest.approx(0.2)
    assert diagnosis.measure == pytest.approx(5.0)  # early / now
    assert "entropy_coef" in diagnosis.finding.fix
    assert entropy_collapse(_rows(entropy=[1.0, 1.0, 1.0, 0.3, 0.3, 0.3])) == []  # 30% of early
    assert entropy_collapse(_rows(entropy=[1.0, 0.1, 0.1, 0.1])) == []  # too few steps to tell


def test_kl_climbing_needs_beta_the_level_and_the_factor():
    rows = _rows(kl=[0.05, 0.05, 0.05, 0.2, 0.2, 0.2])  # 0.2 >= 0.1 and >= 1.5 x 0.05
    assert kl_climbing(rows, beta=0.0) == []
    (diagnosis,) = kl_climbing(rows, beta=0.04)
    assert diagnosis.finding.evidence["kl before"] == pytest.approx(0.05)
    assert diagnosis.finding.evidence["kl now"] == pytest.approx(0.2)
    assert "beta=0.04" in diagnosis.finding.message and "raise beta" in diagnosis.finding.fix
    assert kl_climbing(_rows(kl=[0.15] * 6), beta=0.04) == []  # high but steady
    assert kl_climbing(_rows(kl=[0.01, 0.01, 0.01, 0.05, 0.05, 0.05]), beta=0.04) == []  # rising but low


def test_clip_ratio_climbing():
    (diagnosis,) = clip_ratio_climbing(_rows(**{"clip_ratio/region_mean": [0.1, 0.1, 0.1, 0.3, 0.3, 0.3]}))
    assert (diagnosis.finding.code, diagnosis.finding.severity) == ("clip_ratio_climbing", "warning")
    assert "10% to 30%" in diagnosis.finding.message and "learning_rate" in diagnosis.finding.fix
    assert clip_ratio_climbing(_rows(**{"clip_ratio/region_mean": [0.0] * 6})) == []


def test_importance_ratio_drift_only_with_vllm_metrics():
    name = "sampling/importance_sampling_ratio/mean"
    assert importance_ratio_drift(_rows(reward=[1.0] * 6)) == []  # no vLLM
    (diagnosis,) = importance_ratio_drift(_rows(**{name: [0.7] * 5}))
    assert diagnosis.finding.code == "importance_ratio_drift" and diagnosis.measure == pytest.approx(0.3)
    assert "--dtype" in diagnosis.finding.fix
    assert importance_ratio_drift(_rows(**{name: [0.7, 0.7, 0.7, 0.7, 0.95]})) == []


def test_a_reward_that_rises_with_length_while_correctness_does_not():
    rows = _rows(reward=[0.2, 0.2, 0.2, 0.8, 0.8, 0.8], **{
        "completions/mean_length": [10, 10, 10, 20, 20, 20],
        "rewards/correctness_reward/mean": [0.3, 0.3, 0.3, 0.3, 0.3, 0.3],
        "rewards/format_reward/mean": [0.0, 0.0, 0.0, 0.5, 0.5, 0.5]})
    (diagnosis,) = length_rewarded(rows)
    finding = diagnosis.finding
    assert (finding.code, finding.severity) == ("reward_rising_with_length", "warning")
    assert "'correctness_reward'" in finding.message and "may be learning to write more" in finding.message
    assert finding.evidence["rewards/correctness_reward/mean early/now"] == "0.3/0.3"
    assert diagnosis.measure == pytest.approx(2.0)
    rising = [dict(row, **{"rewards/correctness_reward/mean": 0.3 + 0.1 * i}) for i, row in enumerate(rows)]
    assert length_rewarded(rising) == []  # the correct answers rose too
    assert length_rewarded([{k: v for k, v in row.items() if "correctness" not in k} for row in rows]) == []
    steady = [dict(row, **{"completions/mean_length": 12}) for row in rows]
    assert length_rewarded(steady) == []


def test_the_rate_limit_raises_again_on_worsening_a_higher_severity_or_after_the_repeat_steps():
    watch = LiveWatch()

    def diagnosis(severity="warning", measure=1.0):
        return Diagnosis(Finding("x", severity, "m"), measure)

    assert watch.due(diagnosis(), 1)
    assert not watch.due(diagnosis(measure=1.4), 2)  # less than 1.5 x the measure last raised
    assert watch.due(diagnosis(measure=1.5), 3)
    assert watch.due(diagnosis("error", 1.5), 4)  # worse severity
    assert not watch.due(diagnosis("error", 1.5), 4 + REPEAT_AFTER_STEPS - 1)
    assert watch.due(diagnosis("error", 1.5), 4 + REPEAT_AFTER_STEPS)


def test_persistent_steps_and_the_warning_threshold_are_the_ones_given():
    rows = _rows(**{"completions/clipped_ratio": [0.3, 0.3]})
    assert truncation(rows, max_completion_length=8) == []  # two steps: short of the default five
    (diagnosis,) = truncation(rows, max_completion_length=8, thresholds=resolve({"persistent_steps": 2}))
    finding = diagnosis.finding
    assert finding.evidence["step"] == 2 and "the last 2 steps" in finding.message
    assert finding.evidence["completions/clipped_ratio, mean of 2 steps"] == pytest.approx(0.3)
    assert finding.evidence["threshold"] == DEFAULTS.truncation_warning  # the value in force
    higher = resolve({"persistent_steps": 2, "truncation_warning": 0.4})
    assert truncation(rows, max_completion_length=8, thresholds=higher) == []
    lower = resolve({"persistent_steps": 2, "truncation_warning": 0.2, "truncation_error": 0.25})
    (diagnosis,) = truncation(rows, max_completion_length=8, thresholds=lower)
    assert diagnosis.finding.severity == "error" and diagnosis.finding.evidence["threshold"] == 0.2


def test_every_live_rule_reads_the_thresholds_it_is_given():
    assert zero_signal(_rows(frac_reward_zero_std=[1, 1, 1]), resolve({"persistent_steps": 3}))
    collapsing = _rows(entropy=[1.0, 0.5, 0.4])
    assert entropy_collapse(collapsing) == []
    (diagnosis,) = entropy_collapse(collapsing, resolve({"early_steps": 1, "recent_steps": 1,
                                                         "entropy_collapse_fraction": 0.5}))
    assert diagnosis.finding.evidence["threshold"] == "0.5 x early"
    kl = _rows(kl=[0.05, 0.05, 0.05, 0.08, 0.08, 0.08])  # under 0.1, and 1.6 x the steps before
    assert kl_climbing(kl, beta=0.1) == []
    (diagnosis,) = kl_climbing(kl, beta=0.1, thresholds=resolve({"kl_warning": 0.07}))
    assert diagnosis.finding.evidence["threshold"] == 0.07
    assert kl_climbing(kl, beta=0.1, thresholds=resolve({"kl_warning": 0.07, "climb_factor": 2})) == []
    clipped = _rows(**{"clip_ratio/region_mean": [0.1, 0.2]})  # too few steps for the default 3 + 3
    assert clip_ratio_climbing(clipped) == []
    assert clip_ratio_climbing(clipped, resolve({"recent_steps": 1, "clip_ratio_warning": 0.15}))
    drift = _rows(**{"sampling/importance_sampling_ratio/mean": [0.9] * 5})
    assert importance_ratio_drift(drift) == []  # 0.1 from 1: within the default 0.2
    (diagnosis,) = importance_ratio_drift(drift, resolve({"importance_ratio_drift": 0.05}))
    assert diagnosis.finding.evidence["threshold"] == 0.05 and "more than 0.05 from 1" in diagnosis.finding.message


def test_the_length_rule_reads_the_correctness_names_and_its_factors():
    rows = _rows(reward=[0.2, 0.2, 0.2, 0.8, 0.8, 0.8], **{
        "completions/mean_length": [10, 10, 10, 14, 14, 14],
        "rewards/score/mean": [0.3] * 6, "rewards/format_reward/mean": [0.0, 0.0, 0.0, 0.5, 0.5, 0.5]})
    assert length_rewarded(rows) == []  # no reward named as correctness, and 1.4 x longer only
    named = resolve({"correctness_names": ["Score"], "length_growth": 1.4})
    (diagnosis,) = length_rewarded(rows, named)
    assert "'score'" in diagnosis.finding.message
    assert length_rewarded(rows, resolve({"correctness_names": ["score"], "reward_rise": 0.7})) == []


def test_the_rate_limit_reads_its_thresholds():
    thresholds = resolve({"repeat_after_steps": 2, "worsened_by": 3})
    watch = LiveWatch()
    diagnosis = Diagnosis(Finding("x", "warning", "m"), 1.0)
    assert watch.due(diagnosis, 1, thresholds)
    assert not watch.due(diagnosis._replace(measure=2.9), 2, thresholds)  # under 3 x
    assert watch.due(diagnosis._replace(measure=3.0), 3, thresholds)
    assert watch.due(diagnosis._replace(measure=3.0), 5, thresholds)  # two steps on
    rows = _rows(frac_reward_zero_std=[1, 1])
    found = LiveWatch().new_findings(rows, beta=0.0, max_completion_length=8,
                                     thresholds=resolve({"persistent_steps": 2}))
    assert [finding.code for finding in found] == ["no_signal_steps"]
