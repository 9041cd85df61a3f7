"""The doctor's rules on hand-made numbers (grpo_lab/doctor/rules.py, tokens.py, memory.py)."""

import torch

from grpo_lab.doctor import memory, rules, tokens
from grpo_lab.doctor.thresholds import resolve
from grpo_lab.core.models import load_tokenizer
from grpo_lab.tasks import TINY_MODEL_DIR


def test_the_suggested_limit_covers_the_ended_lengths_with_headroom():
    # p95 of 1..20 is 19.05; x1.5 = 28.6, above 1.25 x 16 = 20; rounded up to a multiple of 8
    assert rules.suggested_max_completion_length(list(range(1, 21)), 0.2, current=16) == 32
    # short ended completions: at least 25% above the current limit (the cut ones needed more)
    assert rules.suggested_max_completion_length([3, 4], 0.5, current=64) == 80
    assert rules.suggested_max_completion_length([3], 0.95, current=64) == 128  # nearly all cut: twice


def test_with_nearly_all_cut_the_limit_comes_from_the_batch_generated_again_with_a_longer_one():
    lengths_B, cut_B = torch.full((8,), 2), torch.ones(8, dtype=torch.bool)
    def fix(longer):
        (found,) = rules.truncation(lengths_B, cut_B, ["x"] * 8, max_completion_length=2,
                                    mask_truncated_completions=False, longer=longer)
        return found.fix
    assert fix(None).startswith("max_completion_length=4 (nearly all were cut, so the lengths they need are unknown")
    # none cut at 8, ended at 5 to 6: p95 6 x 1.5 = 9, above 1.25 x 2; rounded up to 16
    assert fix(rules.LongerLimitTrial(8, [5, 5, 6, 6, 5, 6, 5, 6], 0.0)).startswith(
        "max_completion_length=16 (nearly all were cut, so the probe's batch was generated again with "
        "max_completion_length=8: the 95th percentile")
    # half still cut at 8: at least 1.25 x 8 = 10 (the cut ones needed more), rounded up to 16
    assert fix(rules.LongerLimitTrial(8, [4, 4, 4, 4], 0.5)).startswith("max_completion_length=16 ")
    # nearly all still cut at 16: twice that, and the EOS findings named
    still = fix(rules.LongerLimitTrial(16, [], 1.0))
    assert still.startswith("max_completion_length=32 (nearly all were cut even when") and "EOS findings" in still


def test_truncation_severity_follows_the_share():
    lengths_B = torch.tensor([4, 4, 4, 4, 4, 4, 4, 4, 4, 8])
    def severity(cut: int):
        found = rules.truncation(lengths_B, torch.arange(10) >= 10 - cut, ["x"] * 10, max_completion_length=8,
                                 mask_truncated_completions=False)
        return found[0].severity if found else None

    assert [severity(0), severity(1), severity(5), severity(6)] == [None, "warning", "warning", "error"]


def test_zero_signal_groups_are_told_apart_by_the_reward_they_tied_at():
    # four groups of two: solved (2, 2), failed (0, 0), tied between (1, 1), and one with signal (0, 2)
    rewards_B = torch.tensor([2.0, 2.0, 0.0, 0.0, 1.0, 1.0, 0.0, 2.0])
    advantages_B = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 1.0])
    group_B = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    prompts = ["a", "a", "b", "b", "c", "c", "d", "d"]
    found = {f.code: f for f in rules.zero_signal_groups(rewards_B, advantages_B, group_B, prompts, pass_threshold=1)}
    assert set(found) == {"groups_too_easy", "groups_too_hard", "groups_tied"}
    assert found["groups_too_easy"].evidence["example prompts"] == ["a"]
    assert found["groups_too_hard"].evidence["example prompts"] == ["b"]
    # 3 of 4 groups without signal reaches ZERO_SIGNAL_WARNING (0.75)
    assert {f.severity for f in found.values()} == {"warning"}
    assert found["groups_too_easy"].evidence["groups with zero advantages"] == "3 of 4 (75%)"
    # a warning proposes dynamic sampling, unless it is on
    assert all("dynamic_sampling=True" in f.fix for f in found.values())
    again = rules.zero_signal_groups(rewards_B, advantages_B, group_B, prompts, pass_threshold=1, dynamic_sampling=True)
    assert not any("dynamic_sampling" in f.fix for f in again)


def test_one_reward_value_over_the_whole_probe_is_judged_by_the_pass_threshold():
    tied = dict(advantages_B=torch.zeros(4), group_B=torch.tensor([0, 0, 1, 1]), prompts=["a"] * 4)
    (every,) = rules.zero_signal_groups(torch.full((4,), 0.5), pass_threshold=1.0, **tied)
    assert every.code == "groups_too_hard" and every.severity == "error"
    assert "dynamic_sampling" not in every.fix  # no group has a signal: more rounds would find none either
    assert [f.code for f in rules.zero_signal_groups(torch.full((4,), 0.5), pass_threshold=0.5, **tied)] == [
        "groups_too_easy"]


def test_reward_rules_on_hand_made_values():
    group_B = torch.tensor([0, 0, 1, 1])
    nan = float("nan")
    rewards_BF = torch.tensor([[1.0, 0.3, nan, 0.0], [0.0, 0.3, nan, 0.0], [1.0, 0.3, nan, 1.0],
                               [0.0, 0.3, nan, 1.0]])
    names = ["varies", "constant", "none", "per_prompt"]
    found = rules.rewards(rewards_BF, group_B, names, ["p"] * 4, declared_max={"varies": 1.0, "per_prompt": 2.0})
    assert [(f.code, f.severity) for f in found] == [
        ("reward_constant", "info"), ("reward_always_none", "error"), ("reward_between_prompts_only", "warning"),
        ("reward_below_maximum", "info")]
    assert "the maximum seen is 1" in found[3].message and found[3].evidence["values seen"] == "0 x2, 1 x2"


def test_zero_advantage_micro_batches_and_the_vllm_gap():
    advantages_B = torch.tensor([0.0, 0.0, 0.5, -0.5, 0.0, 0.0])
    (finding,) = rules.zero_advantage_micro_batches(advantages_B, micro_batch_size=2, skip_backward=False)
    assert finding.severity == "warning" and finding.evidence["micro-batches with all advantages 0"] == "2 of 3 (67%)"
    assert "skip_zero_advantage_backward=True" in finding.fix
    assert rules.zero_advantage_micro_batches(advantages_B, micro_batch_size=3, skip_backward=True) == []
    assert rules.sampling_gap(None, None) == [] and rules.sampling_gap(0.01, 0.2) == []
    (gap,) = rules.sampling_gap(0.12, 1.5)
    assert gap.code == "vllm_logprob_gap" and gap.evidence["sampling/sampling_logp_difference/mean"] == 0.12


def test_the_memory_forecast_warns_only_past_what_is_available():
    reading = memory.MemoryReading("cpu", baseline=2**30, peak=2**30 + 2**28, available=2**30, method="test")
    # growth 0.25 GiB x (512 / 128) = 1 GiB, plus 0.5 GiB of optimizer state: 1.5 GiB > 1 GiB available
    (finding,) = memory.memory_forecast(reading, probe_length=128, worst_length=512, optimizer_bytes=2**29)
    assert finding.code == "memory_forecast" and finding.evidence["forecast"] == "1.50 GiB"
    assert memory.memory_forecast(reading, probe_length=128, worst_length=256, optimizer_bytes=0) == []


def test_the_memory_watch_measures_an_allocation_on_the_cpu():
    from grpo_lab.accel import release_freed_memory

    # a session built earlier in this process keeps freed memory for reuse (keep_freed_cpu_memory), from
    # which the block could be served without the process growing: hand it back first
    release_freed_memory()
    with memory.MemoryWatch(torch.device("cpu")) as watch:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        watch.sample()
    del block
    reading = watch.reading
    assert reading.peak - reading.baseline >= 60 * 2**20 and reading.available > 0


def test_chat_parts_of_the_shipped_template():
    tokenizer = load_tokenizer(str(TINY_MODEL_DIR))
    parts = tokens.chat_parts(tokenizer)
    assert parts == tokens.ChatParts("<|im_start|>assistant\n", "<|im_start|>assistant\n", "<|im_end|>")
    prompted = ["<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"]
    assert tokens.generation_prompt(parts, prompted, conversational=True) == []
    # a template that writes more before a finished assistant message than its generation prompt (Qwen3's
    # empty think block): prompts ending with the generation prompt are right
    thinking = tokens.ChatParts("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n", None)
    assert tokens.generation_prompt(thinking, prompted, conversational=True) == []
    (unprompted,) = tokens.generation_prompt(parts, ["<|im_start|>user\n1+1=<|im_end|>\n"], conversational=True)
    assert "add_generation_prompt=True" in unprompted.fix and "rendered without" in unprompted.message


def test_eos_pad_and_stop_rules_on_hand_made_tokens():
    ids_BT, mask_BT = torch.tensor([[5, 6, 2, 0], [5, 2, 2, 2]]), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    kwargs = dict(names={2: "<eos>", 7: "<eot>"}, is_truncated_B=torch.tensor([False, False]), max_completion_length=4)
    assert tokens.eos_emitted(ids_BT, mask_BT, eos_ids={2}, end_of_turn_id=7, **kwargs) == []
    (missing,) = tokens.eos_emitted(ids_BT, mask_BT, eos_ids={9}, end_of_turn_id=2, **kwargs)
    assert missing.severity == "error" and "Set tokenizer.eos_token = '<eos>'" in missing.fix
    assert tokens.pad_is_eos(2, {2}, ids_BT, mask_BT, custom_rollout=False) == []  # generation cuts at the first EOS
    (pad,) = tokens.pad_is_eos(2, {2}, ids_BT, mask_BT, custom_rollout=True)
    assert pad.severity == "warning" and pad.evidence["completions ending in 2+ pad/EOS tokens"] == 1
    assert tokens.stop_strings(["</answer>"], ["<answer>3</answer>"], stopped_early=0, truncated_share=0) == []
    (stop,) = tokens.stop_strings(["###"], ["<answer>3</answer>"], stopped_early=0, truncated_share=0.5)
    assert stop.code == "stop_never_matched" and stop.severity == "warning"
    assert tokens.stop_strings(["###"], ["<answer>3"], stopped_early=1, truncated_share=0.5) == []


def test_the_probe_rules_read_the_thresholds_they_are_given():
    lengths_B, cut_B = torch.tensor([4] * 8 + [8] * 2), torch.arange(10) >= 8  # 20% truncated
    kwargs = dict(max_completion_length=8, mask_truncated_completions=False)
    assert rules.truncation(lengths_B, cut_B, ["x"] * 10, **kwargs)[0].severity == "warning"
    assert rules.truncation(lengths_B, cut_B, ["x"] * 10, **kwargs,
                            thresholds=resolve({"truncation_warning": 0.25})) == []
    (error,) = rules.truncation(lengths_B, cut_B, ["x"] * 10, **kwargs,
                                thresholds=resolve({"truncation_warning": 0.1, "truncation_error": 0.15}))
    assert error.severity == "error"
    # the suggested limit: twice the limit from nearly_all_truncated, else the percentile with its headroom
    assert rules.suggested_max_completion_length([4], 0.2, 8, resolve({"nearly_all_truncated": 0.2})) == 16
    assert rules.suggested_max_completion_length(list(range(1, 21)), 0.2, 16,
                                                 resolve({"length_percentile": 50, "length_headroom": 3})) == 32
    advantages_B = torch.tensor([0.0, 0.0, 0.5, -0.5, 0.5, -0.5])  # one micro-batch of three all zero
    assert rules.zero_advantage_micro_batches(advantages_B, micro_batch_size=2, skip_backward=True)[0].severity \
        == "info"
    assert rules.zero_advantage_micro_batches(advantages_B, micro_batch_size=2, skip_backward=True,
                                              thresholds=resolve({"zero_micro_batch_warning": 0.3}))[0].severity \
        == "warning"
    assert rules.sampling_gap(0.03, 0.1) == []
    (gap,) = rules.sampling_gap(0.03, 0.1, thresholds=resolve({"logp_gap_warning": 0.02}))
    assert gap.evidence["threshold"] == 0.02 and "(above 0.02)" in gap.message
    stop = dict(stopped_early=0, truncated_share=0.2)
    assert tokens.stop_strings(["###"], ["abc"], **stop)[0].severity == "warning"
    assert tokens.stop_strings(["###"], ["abc"], **stop,
                               thresholds=resolve({"truncation_warning": 0.3}))[0].severity == "info"


def test_zero_signal_groups_read_their_warning_threshold():
    rewards_B, group_B = torch.tensor([2.0, 2.0, 0.0, 2.0]), torch.tensor([0, 0, 1, 1])
    advantages_B = torch.tensor([0.0, 0.0, -1.0, 1.0])  # one group of two without signal: 50%
    found = rules.zero_signal_groups(rewards_B, advantages_B, group_B, ["a"] * 4, pass_threshold=1)
    assert [f.severity for f in found] == ["info"]
    found = rules.zero_signal_groups(rewards_B, advantages_B, group_B, ["a"] * 4, pass_threshold=1,
                                     thresholds=resolve({"zero_signal_warning": 0.5}))
    assert [f.severity for f in found] == ["warning"]
