"""The views' data layer shows the session's own numbers."""

import math

import pytest
import torch

from grpo_lab.views import batch, data


@pytest.fixture(scope="module")
def stepped(task, tmp_path_factory):
    from grpo_lab import GRPOSession
    from tests.conftest import SMALL

    config = task.config(**{**SMALL, "output_dir": str(tmp_path_factory.mktemp("out"))})
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset)
    session.run(2, progress=False)
    session.generate(), session.score(), session.advantages(), session.loss()
    return session


def test_latest_table_matches_stage_results(stepped):
    frame = data.latest_table(batch.current_batch(stepped))
    adv = stepped.advantages_result
    assert frame["advantage"].tolist() == pytest.approx(adv.advantages_B.tolist())
    assert frame["rewards/correctness_reward"].tolist() == pytest.approx(stepped.scores.rewards_BF[:, 0].tolist())
    trained = stepped.loss_result.sample_index_B.tolist()
    assert frame.loc[trained, "entropy"].notna().all()


def test_group_flags_mark_equal_reward_groups(stepped):
    frame = data.latest_table(batch.current_batch(stepped))
    flags = data.group_flags(frame)
    assert len(flags) == len(set(stepped.rollout.group_index_B.tolist()))
    expected = [bool(stepped.advantages_result.is_std_zero_B[stepped.rollout.group_index_B == g].all())
                for g in flags["group"]]
    assert flags["std_zero"].tolist() == expected


def test_reward_summary_and_none_share():
    class Scores:
        reward_names = ["a", "b"]
        rewards_BF = torch.tensor([[1.0, float("nan")], [3.0, 2.0], [5.0, 4.0], [7.0, float("nan")]])

    summary = data.reward_summary(Scores()).set_index("function")
    # a: mean (1+3+5+7)/4 = 4, sample std sqrt(((9+1+1+9))/3) = sqrt(20/3) = 2.5820
    assert summary.loc["a", "mean"] == 4.0 and summary.loc["a", "std"] == pytest.approx(2.5820, abs=1e-4)
    assert summary.loc["b", "none_share"] == 0.5 and summary.loc["b", "min"] == 2.0
    # correlation over the rows where both are present: (3,2), (5,4) -> perfectly correlated
    assert data.reward_correlation(Scores()).matrix.loc["a", "b"] == pytest.approx(1.0)


def test_token_values_are_the_loss_tensors(stepped):
    result = stepped.loss_result
    position = int(result.sample_index_B[1])
    mask = stepped.rollout.completion_mask_BT[position].bool()
    tokens = data.token_values(stepped, position, "logprob")
    assert len(tokens) == int(mask.sum())
    assert [v for _, v in tokens] == pytest.approx(result.logprobs_BT[1][: len(tokens)].tolist())
    product = [v for _, v in data.token_values(stepped, position, "advantage_x_ratio")]
    expected = (result.ratio_BT[1] * stepped.advantages_result.advantages_B[position])[: len(tokens)]
    assert product == pytest.approx(expected.tolist())
    assert "".join(t for t, _ in tokens) == stepped.tokenizer.decode(stepped.rollout.completion_ids_BT[position][mask])
    with pytest.raises(ValueError, match="quantity must be one of"):
        data.token_values(stepped, position, "nope")


def test_vllm_logprob_gap_is_trainer_minus_sampler_on_completion_tokens():
    class Rollout:
        old_logprobs_BT = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, -0.2]])
        sampling_logprobs_BT = torch.tensor([[-0.7, -0.9, -2.0], [-0.4, -1.0, -5.0]])
        generated_mask_BT = torch.tensor([[1, 0, 1], [1, 1, 0]])  # [0, 1]: inserted by an environment

    gap_BT = data.vllm_logprob_gap(Rollout())
    # -0.5 + 0.7 = 0.2, environment token -> NaN, -2 + 2 = 0; -0.1 + 0.4 = 0.3, -3 + 1 = -2, padding -> NaN
    assert gap_BT[0, ::2].tolist() == pytest.approx([0.2, 0.0]) and math.isnan(gap_BT[0, 1])
    assert gap_BT[1, :2].tolist() == pytest.approx([0.3, -2.0]) and math.isnan(gap_BT[1, 2])
    assert "vllm_logprob_gap" in data.token_quantities(Rollout())
    Rollout.sampling_logprobs_BT = None  # completions from transformers
    assert "vllm_logprob_gap" not in data.token_quantities(Rollout()) and "logprob" in data.token_quantities(None)
    with pytest.raises(ValueError, match="use_vllm=True"):
        data.vllm_logprob_gap(Rollout())


def test_token_values_show_the_sampling_gap_of_completion_tokens_only(stepped, monkeypatch):
    rollout = stepped.rollout
    B, T = rollout.completion_ids_BT.shape
    mask_BT = torch.ones(B, T, dtype=rollout.completion_mask_BT.dtype)
    mask_BT[0, 5:] = 0  # the last tokens of completion 0 are padding
    monkeypatch.setattr(rollout, "completion_mask_BT", mask_BT)
    monkeypatch.setattr(rollout, "old_logprobs_BT", torch.full((B, T), -1.0))
    # emulated vLLM log-probs -1.0 - 0.1 t: the gap -1 - (-1 - 0.1 t) = 0.1 t
    monkeypatch.setattr(rollout, "sampling_logprobs_BT", -1.0 - 0.1 * torch.arange(T).float().expand(B, T))
    tokens = data.token_values(stepped, 0, "vllm_logprob_gap")
    assert [v for _, v in tokens] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert "".join(t for t, _ in tokens) == stepped.tokenizer.decode(rollout.completion_ids_BT[0][:5])
