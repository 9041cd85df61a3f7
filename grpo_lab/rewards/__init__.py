"""Reward functions: calling them the way TRL does, reward models, and ready-made reward functions
(math correctness, format, length, repetition, code run against tests)."""

from grpo_lab.rewards.code_rewards import code_reward, python_code
from grpo_lab.rewards.code_sandbox import run_in_sandbox
from grpo_lab.rewards.extraction import completion_text, last_boxed, last_number, tagged
from grpo_lab.rewards.format_rewards import tag_count_reward, think_format_reward
from grpo_lab.rewards.length_rewards import (
    get_cosine_scaled_reward,
    get_soft_overlong_punishment,
    target_length_penalty,
)
from grpo_lab.rewards.math_rewards import accuracy_reward, reasoning_accuracy_reward
from grpo_lab.rewards.preparation import check_reward_signatures, prepare_reward_funcs
from grpo_lab.rewards.repetition import get_repetition_penalty_reward
from grpo_lab.rewards.runner import RewardFunctionError, RewardLogs, score_completions

__all__ = [
    "RewardFunctionError",
    "RewardLogs",
    "accuracy_reward",
    "check_reward_signatures",
    "code_reward",
    "completion_text",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "last_boxed",
    "last_number",
    "prepare_reward_funcs",
    "python_code",
    "reasoning_accuracy_reward",
    "run_in_sandbox",
    "score_completions",
    "tag_count_reward",
    "tagged",
    "target_length_penalty",
    "think_format_reward",
]
