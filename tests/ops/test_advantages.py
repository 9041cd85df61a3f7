"""compute_advantages and nanstd."""

import math
import random
import statistics

import pytest
import torch
from torch.testing import assert_close

from grpo_lab.ops import compute_advantages, nanstd

EPS = 1e-4  # added to the std before dividing, as TRL does

# Two groups of G = 4: group 0 has rewards [1, 0, 0, 1], group 1 is constant.
TWO_GROUPS_B1 = torch.tensor([[1.0], [0.0], [0.0], [1.0], [2.0], [2.0], [2.0], [2.0]])


def test_group_scaling_hand_example():
    # Group 0: mean 0.5; deviations +-0.5, squares sum to 4 * 0.25 = 1, sample variance 1 / 3,
    # std sqrt(1/3) = 0.57735 -> A = +-0.5 / (0.57735 + 1e-4) ~= +-0.86588.
    # Group 1: mean 2, std 0 -> A = 0 / (0 + 1e-4) = 0.
    stats = compute_advantages(TWO_GROUPS_B1, num_generations=4, scale_rewards="group")
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    assert a == pytest.approx(0.86588, abs=1e-5)
    assert_close(stats.advantages_B, torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]))
    assert_close(stats.rewards_B, TWO_GROUPS_B1.squeeze(1))
    assert_close(stats.mean_grouped_B, torch.tensor([0.5] * 4 + [2.0] * 4))
    assert_close(stats.std_B, torch.tensor([math.sqrt(1 / 3)] * 4 + [0.0] * 4))
    assert stats.is_std_zero_B.tolist() == [False] * 4 + [True] * 4


def test_batch_scaling_hand_example():
    # Mean stays per group (0.5 and 2); the std is over all 8 rewards [1,0,0,1,2,2,2,2]:
    # batch mean 10/8 = 1.25; squared deviations 2*0.0625 + 2*1.5625 + 4*0.5625 = 5.5;
    # sample variance 5.5 / 7 = 11/14, std sqrt(11/14) ~= 0.886405.
    stats = compute_advantages(TWO_GROUPS_B1, num_generations=4, scale_rewards="batch")
    std = math.sqrt(11 / 14)
    a = 0.5 / (std + EPS)
    assert_close(stats.advantages_B, torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]))
    assert_close(stats.mean_grouped_B, torch.tensor([0.5] * 4 + [2.0] * 4))
    assert_close(stats.std_B, torch.full((8,), std))
    assert not stats.is_std_zero_B.any()


def test_no_scaling_hand_example():
    # A = r - group mean, no division; the reported std is still the group one.
    stats = compute_advantages(TWO_GROUPS_B1, num_generations=4, scale_rewards="none")
    assert_close(stats.advantages_B, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]))
    assert_close(stats.std_B, torch.tensor([math.sqrt(1 / 3)] * 4 + [0.0] * 4))
    assert stats.is_std_zero_B.tolist() == [False] * 4 + [True] * 4


@pytest.mark.parametrize(("alias", "mode"), [(True, "group"), (False, "none")])
def test_boolean_scale_rewards_aliases(alias, mode):
    rewards_BF = torch.tensor([[0.3], [1.2], [0.0], [2.0], [5.0], [4.0]])
    got = compute_advantages(rewards_BF, num_generations=3, scale_rewards=alias)
    want = compute_advantages(rewards_BF, num_generations=3, scale_rewards=mode)
    assert_close(got.advantages_B, want.advantages_B)
    assert_close(got.std_B, want.std_B)


def test_reward_weights_hand_example():
    # r = 0.5 * f1 + 2 * f2 = [0.5 + 4, 0, 1.5 + 2, 0 + 2] = [4.5, 0, 3.5, 2];
    # groups of 2: means 2.25 and 2.75 -> A (no scaling) = [2.25, -2.25, 0.75, -0.75].
    rewards_BF = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 1.0], [0.0, 1.0]])
    stats = compute_advantages(
        rewards_BF, num_generations=2, reward_weights_F=torch.tensor([0.5, 2.0]), scale_rewards="none"
    )
    assert_close(stats.rewards_B, torch.tensor([4.5, 0.0, 3.5, 2.0]))
    assert_close(stats.advantages_B, torch.tensor([2.25, -2.25, 0.75, -0.75]))


def test_nan_rewards_are_skipped_in_the_weighted_sum():
    # NaN (a function returned None) drops out of the sum: r = [1, 2, NaN (no function scored it), 3 + 1];
    # the unscored completion stays out of the group's mean, 7/3, and gets advantage 0 (TRL 1.16's rule):
    # A (no scaling) = [1 - 7/3, 2 - 7/3, 0, 4 - 7/3] = [-4/3, -1/3, 0, 5/3].
    nan = float("nan")
    rewards_BF = torch.tensor([[1.0, nan], [nan, 2.0], [nan, nan], [3.0, 1.0]])
    stats = compute_advantages(rewards_BF, num_generations=4, scale_rewards="none")
    assert_close(stats.rewards_B, torch.tensor([1.0, 2.0, nan, 4.0]), equal_nan=True)
    assert_close(stats.advantages_B, torch.tensor([-4 / 3, -1 / 3, 0.0, 5 / 3]))


@pytest.mark.parametrize("mode", ["group", "batch"])
def test_an_unscored_completion_stays_out_of_the_standard_deviation(mode):
    # r = [0, 1, NaN | 2, 2, 2]. group: group 0's scored values 0, 1 -> mean 0.5, sample std 1/sqrt2, so
    # A = +-0.5 / (1/sqrt2 + eps); group 1 is tied -> 0. batch: the five scored values 0, 1, 2, 2, 2 have
    # mean 7/5 and sample variance (1.96 + 0.16 + 3 * 0.36) / 4 = 0.8, and each is centred on its group's mean.
    nan = float("nan")
    rewards_BF = torch.tensor([[0.0], [1.0], [nan], [2.0], [2.0], [2.0]])
    stats = compute_advantages(rewards_BF, num_generations=3, scale_rewards=mode)
    std = 1 / math.sqrt(2) if mode == "group" else math.sqrt(0.8)
    assert_close(stats.advantages_B, torch.tensor([-0.5 / (std + EPS), 0.5 / (std + EPS), 0.0, 0.0, 0.0, 0.0]))


def test_normalize_then_sum_gives_an_unscored_completion_advantage_zero_and_leaves_it_out():
    # f = [1, 0, NaN | 3, 1, 1] in groups of 3 (one function): group 0's scored 1, 0 -> z = +-0.5 / (1/sqrt2 + eps)
    # = +-a; group 1: mean 5/3, sample std sqrt(4/3) -> z = [4/3, -2/3, -2/3] / (sqrt(4/3) + eps). The batch
    # statistics of the five sums (NaN left out) normalize them; the unscored row gets 0, its reward NaN.
    nan = float("nan")
    rewards_BF = torch.tensor([[1.0], [0.0], [nan], [3.0], [1.0], [1.0]])
    a = 0.5 / (1 / math.sqrt(2) + EPS)
    g = math.sqrt(4 / 3) + EPS
    z = torch.tensor([a, -a, (4 / 3) / g, (-2 / 3) / g, (-2 / 3) / g], dtype=torch.float64)
    expected = ((z - z.mean()) / (z.std() + EPS)).tolist()
    stats = compute_advantages(rewards_BF, num_generations=3, multi_objective_aggregation="normalize_then_sum")
    assert_close(stats.advantages_B, torch.tensor(expected[:2] + [0.0] + expected[2:]))
    assert_close(stats.rewards_B, torch.tensor([1.0, 0.0, nan, 3.0, 1.0, 1.0]), equal_nan=True)


def test_normalize_then_sum_hand_example():
    # f1 = [1, 0 | 1, 1], f2 = [0, 2 | 4, 0], G = 2. For two values the sample std is |x - y| / sqrt(2).
    # group 0: f1 mean 0.5, std 1/sqrt2 -> z1 = +-0.5 / (1/sqrt2 + eps) = +-p
    #          f2 mean 1,   std sqrt2   -> z2 = -+1 / (sqrt2 + eps)     = -+q
    # group 1: f1 constant, std 0       -> z1 = 0 / eps = 0
    #          f2 mean 2,   std 2 sqrt2 -> z2 = +-2 / (2 sqrt2 + eps)  = +-s
    # r = [p - q, q - p, s, -s] has mean 0, sample variance (2 (p - q)^2 + 2 s^2) / 3 = v,
    # A = r / (sqrt(v) + eps) (batch statistics).
    rewards_BF = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 4.0], [1.0, 0.0]])
    p = 0.5 / (1 / math.sqrt(2) + EPS)
    q = 1.0 / (math.sqrt(2) + EPS)
    s = 2.0 / (2 * math.sqrt(2) + EPS)
    r = [p - q, q - p, s, -s]
    std = math.sqrt((2 * (p - q) ** 2 + 2 * s**2) / 3)
    stats = compute_advantages(rewards_BF, num_generations=2, multi_objective_aggregation="normalize_then_sum")
    assert_close(stats.rewards_B, torch.tensor([1.0, 2.0, 5.0, 1.0]))  # the plain sums, what `reward` logs
    assert_close(stats.mean_grouped_B, torch.zeros(4), atol=1e-6, rtol=0)
    assert_close(stats.std_B, torch.full((4,), std))
    assert_close(stats.advantages_B, torch.tensor([x / (std + EPS) for x in r]))


def test_normalize_then_sum_ignores_nan_per_function():
    # f2 applies only to completions 1 and 3 (one group of 4): nanmean 2, values [1, 3],
    # sample std sqrt(2) -> z2 = [-, -1/(sqrt2+eps), -, +1/(sqrt2+eps)], NaN entries skipped.
    # f1 = [0, 0, 0, 4]: mean 1, deviations [-1, -1, -1, 3], sample variance 12/3 = 4, std 2
    # -> z1 = [-1, -1, -1, 3] / (2 + eps). Weights 1 -> r = z1 + z2 (NaN dropped).
    nan = float("nan")
    rewards_BF = torch.tensor([[0.0, nan], [0.0, 1.0], [0.0, nan], [4.0, 3.0]])
    z2 = 1 / (math.sqrt(2) + EPS)
    z1 = [x / (2 + EPS) for x in (-1, -1, -1, 3)]
    expected_r = [z1[0], z1[1] - z2, z1[2], z1[3] + z2]
    stats = compute_advantages(rewards_BF, num_generations=4, multi_objective_aggregation="normalize_then_sum")
    r = torch.tensor(expected_r, dtype=torch.float64)
    assert_close(stats.advantages_B, ((r - r.mean()) / (r.std() + EPS)).float())
    assert_close(stats.rewards_B, torch.tensor([0.0, 1.0, 0.0, 7.0]))


def test_group_advantages_sum_to_zero_in_every_mode():
    generator = torch.Generator().manual_seed(0)
    rewards_BF = torch.rand(24, 3, generator=generator)
    for mode in ("group", "batch", "none"):
        stats = compute_advantages(rewards_BF, num_generations=6, scale_rewards=mode)
        assert_close(stats.advantages_B.view(4, 6).sum(1), torch.zeros(4), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
def test_equal_rewards_give_zero_advantages(mode):
    rewards_BF = torch.full((6, 2), 0.7)
    stats = compute_advantages(rewards_BF, num_generations=3, scale_rewards=mode)
    assert torch.equal(stats.advantages_B, torch.zeros(6))
    assert stats.is_std_zero_B.all()


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
def test_a_group_of_equal_rewards_whose_float_mean_rounds_away_gets_zero_advantages(mode):
    # every completion scores 1 + 1 - 0.19 + 1 = 2.81; the float32 mean of eight 2.81s is not 2.81,
    # and (2.81 - mean) / (std + 1e-4), with std ~2.5e-7, would be ~2.4e-3 instead of 0
    rewards_BF = torch.tensor([[1.0, 1.0, -0.19, 1.0]] * 8 + [[0.0, 1.0, 0.0, 0.0]] * 4 + [[1.0, 1.0, 0.0, 0.0]] * 4)
    total_B = rewards_BF.sum(1)
    assert total_B[:8].mean() != total_B[0]  # the rounding this test is about
    stats = compute_advantages(rewards_BF, num_generations=8, scale_rewards=mode)
    assert torch.equal(stats.advantages_B[:8], torch.zeros(8))
    # the second group still gets its advantages: rewards 1 and 2, mean 1.5, group std sqrt(2/7)
    spread = {"group": math.sqrt(2 / 7) + EPS, "batch": statistics.stdev(total_B.tolist()) + EPS, "none": 1.0}[mode]
    assert_close(stats.advantages_B[8:], torch.tensor([-0.5] * 4 + [0.5] * 4) / spread)
    if mode != "batch":
        assert stats.is_std_zero_B.tolist() == [True] * 8 + [False] * 8


def test_normalize_then_sum_gives_zero_to_a_function_whose_rewards_are_equal_in_a_group():
    # group 0: function 0 gives 2.81 to all 32 completions, function 1 alternates 0, 1;
    # group 1: the functions alternate 0, 1 and 1, 0, so their normalized rewards cancel
    alternating = torch.tensor([0.0, 1.0] * 16)
    rewards_BF = torch.cat([torch.stack([torch.full((32,), 2.81), alternating], 1),
                            torch.stack([alternating, 1 - alternating], 1)])
    assert torch.nanmean(rewards_BF.view(2, 32, 2), dim=1)[0, 0] != 2.81  # the float mean rounds away
    stats = compute_advantages(rewards_BF, num_generations=32, multi_objective_aggregation="normalize_then_sum")
    # z = (r - 0.5) / (sqrt(8/31) + 1e-4) for an alternating function; function 0 adds exactly 0 in
    # group 0 (not the rounding error over 1e-4, which would shift group 0 against group 1)
    z = 0.5 / (math.sqrt(8 / 31) + EPS)
    summed = torch.cat([alternating * 2 * z - z, torch.zeros(32)])
    assert_close(stats.advantages_B, (summed - summed.mean()) / (summed.std() + EPS))


def _loop_reference(rewards, weights, G, mode):
    """Plain-Python advantages: weighted NaN-skipping sums, then per-group loops."""
    totals = [sum(w * x for w, x in zip(weights, row) if not math.isnan(x)) for row in rewards]
    batch_std = statistics.stdev(totals)
    out = []
    for start in range(0, len(totals), G):
        group = totals[start:start + G]
        mean = sum(group) / G
        std = statistics.stdev(group) if mode == "group" else batch_std
        for value in group:
            out.append(value - mean if mode == "none" else (value - mean) / (std + EPS))
    return out


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
def test_vectorised_matches_loop_reference(mode):
    rng = random.Random(1234)
    G, num_groups, F = 5, 4, 3
    rewards = [[rng.uniform(-2, 2) for _ in range(F)] for _ in range(G * num_groups)]
    for i, j in [(0, 1), (7, 0), (7, 2), (13, 1)]:
        rewards[i][j] = float("nan")
    weights = [1.0, 0.5, -2.0]
    stats = compute_advantages(
        torch.tensor(rewards, dtype=torch.float64), num_generations=G,
        reward_weights_F=torch.tensor(weights), scale_rewards=mode,
    )
    expected = torch.tensor(_loop_reference(rewards, weights, G, mode), dtype=torch.float32)
    assert_close(stats.advantages_B, expected, atol=1e-5, rtol=1e-5)


def _mean_std(values):
    """Mean and sample std of the numbers among ``values`` (std 0 for fewer than two)."""
    numbers = [v for v in values if not math.isnan(v)]
    if not numbers:
        return math.nan, math.nan
    return statistics.fmean(numbers), statistics.stdev(numbers) if len(numbers) > 1 else 0.0


def _trl_reference(rewards, weights, G, mode, aggregation):
    """TRL 1.16's advantages in plain Python: a row no function scored has no reward, stays out of
    every statistic and gets advantage 0; normalize_then_sum normalizes each function within its
    group, sums, then normalizes over the batch (scale_rewards unused)."""
    scored = [any(not math.isnan(x) for x in row) for row in rewards]

    def weighted(rows):
        return [sum(w * x for w, x in zip(weights, row) if not math.isnan(x)) if ok else math.nan
                for row, ok in zip(rows, scored)]

    if aggregation == "normalize_then_sum":
        normalized = [list(row) for row in rewards]
        for start in range(0, len(rewards), G):
            for f in range(len(weights)):
                mean, std = _mean_std([rewards[i][f] for i in range(start, start + G)])
                for i in range(start, start + G):
                    normalized[i][f] = (rewards[i][f] - mean) / (std + EPS)
        sums = weighted(normalized)
        mean, std = _mean_std(sums)
        return [0.0 if math.isnan(v) else (v - mean) / (std + EPS) for v in sums]
    totals = weighted(rewards)
    batch_std = _mean_std(totals)[1]
    out = []
    for start in range(0, len(totals), G):
        group = totals[start:start + G]
        mean, std = _mean_std(group)
        std = std if mode == "group" else batch_std
        for value in group:
            advantage = value - mean if mode == "none" else (value - mean) / (std + EPS)
            out.append(0.0 if math.isnan(advantage) else advantage)
    return out


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("mode", ["group", "batch", "none"])
def test_every_scaling_and_aggregation_with_none_rewards_unscored_rows_and_ties(mode, aggregation):
    nan = float("nan")
    rewards = [
        [1.0, 2.0], [nan, nan], [3.0, nan], [0.5, -1.0],  # an unscored row, a partly scored one
        [2.0, 1.0], [2.0, 1.0], [2.0, 1.0], [2.0, 1.0],  # a tie (integers: no rounding in either)
        [nan, nan], [nan, nan], [4.0, 0.0], [nan, nan],  # one scored completion in its group
        [-1.0, 3.0], [2.5, 0.5], [0.0, nan], [1.5, 1.0],
    ]
    weights = [1.0, 0.5]
    stats = compute_advantages(torch.tensor(rewards), num_generations=4, reward_weights_F=torch.tensor(weights),
                               scale_rewards=mode, multi_objective_aggregation=aggregation)
    expected = _trl_reference(rewards, weights, 4, mode, aggregation)
    assert_close(stats.advantages_B, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert stats.advantages_B[[1, 8, 9, 11]].eq(0).all()
    if aggregation == "sum_then_normalize":  # GDPO's batch step moves a tied group's zero sums off 0
        assert stats.advantages_B[4:8].eq(0).all()
    unscored = torch.tensor([i in (1, 8, 9, 11) for i in range(16)])
    assert torch.isnan(stats.rewards_B[unscored]).all()
    raw = [sum(w * x for w, x in zip(weights, row) if not math.isnan(x)) for row in rewards]
    assert_close(stats.rewards_B[~unscored], torch.tensor(raw)[~unscored])  # the raw weighted sum, either way


def test_invalid_arguments_raise():
    rewards_BF = torch.zeros(6, 1)
    with pytest.raises(ValueError):
        compute_advantages(rewards_BF, num_generations=4)
    with pytest.raises(ValueError):
        compute_advantages(rewards_BF, num_generations=3, scale_rewards="sequence")
    with pytest.raises(ValueError):
        compute_advantages(rewards_BF, num_generations=3, multi_objective_aggregation="max")


def test_nanstd_ignores_nan_and_uses_bessel_correction():
    nan = float("nan")
    # [1, 3] -> mean 2, squares 1 + 1 = 2, / (2 - 1) -> std sqrt(2); [5] alone -> 0.
    values = torch.tensor([[1.0, nan, 3.0], [nan, 5.0, nan]])
    assert_close(nanstd(values, dim=1), torch.tensor([math.sqrt(2), 0.0]))
    assert nanstd(values).item() == pytest.approx(statistics.stdev([1.0, 3.0, 5.0]))
    assert nanstd(values, dim=1, keepdim=True).shape == (2, 1)


def test_rewards_equal_after_float32_rounding_and_all_none_groups_count_as_without_signal():
    """Differences from TRL (docs/explanations/differences.md): 0.1 + 0.2 and 0.3 are one float32
    number, so the first group is tied (TRL leaves noise advantages of ~6e-4 and does not count it);
    the second group's rewards are all None (TRL's NaN std is not close to 0, so it does not count it either)."""
    rewards_BF = torch.tensor([[0.1 + 0.2], [0.3], [0.3], [float("nan")], [float("nan")], [float("nan")]])
    stats = compute_advantages(rewards_BF, num_generations=3)
    assert torch.equal(stats.advantages_B, torch.zeros(6))
    assert stats.is_std_zero_B.tolist() == [True] * 6
