"""Reward functions: calling them the way TRL does, and reward models."""

from grpo_lab.rewards.preparation import check_reward_signatures, prepare_reward_funcs
from grpo_lab.rewards.runner import RewardFunctionError, RewardLogs, score_completions

__all__ = ["RewardFunctionError", "RewardLogs", "check_reward_signatures", "prepare_reward_funcs", "score_completions"]
