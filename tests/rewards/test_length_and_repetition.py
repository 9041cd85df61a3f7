"""Length rewards and the repetition penalty, with values worked out by hand."""

import pickle

import pytest

from grpo_lab.rewards import (
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    target_length_penalty,
)


def ids(length):
    return [7] * length


def test_soft_overlong_punishment_in_its_three_regions():
    punish = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    # free up to 100 - 20 = 80 tokens; then (80 - L) / 20; past 100 tokens -1
    lengths = [0, 50, 80, 81, 90, 95, 100, 101, 500]
    expected = [0.0, 0.0, 0.0, -0.05, -0.5, -0.75, -1.0, -1.0, -1.0]
    assert punish(completion_ids=[ids(n) for n in lengths]) == pytest.approx(expected)
    assert punish.__name__ == "soft_overlong_punishment_reward"


def test_soft_overlong_punishment_without_a_cache():
    punish = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=0)
    assert punish(completion_ids=[ids(10), ids(11)]) == [0.0, -1.0]


def test_target_length_penalty():
    penalty = target_length_penalty(target=100, scale=50)
    # -min(|L - 100| / 50, 1)
    lengths = [100, 75, 125, 90, 0, 300]
    assert penalty(completion_ids=[ids(n) for n in lengths]) == pytest.approx([0.0, -0.5, -0.5, -0.2, -1.0, -1.0])
    default_scale = target_length_penalty(target=10)  # scale = target
    assert default_scale(completion_ids=[ids(5), ids(10), ids(20), ids(40)]) == pytest.approx([-0.5, 0.0, -1.0, -1.0])
    with pytest.raises(ValueError):
        target_length_penalty(target=0)
    with pytest.raises(ValueError):
        target_length_penalty(target=10, scale=-1)
    with pytest.raises(ValueError, match="positive finite"):
        target_length_penalty(target=float("inf"))


@pytest.mark.parametrize("factory, message", [
    (lambda: get_cosine_scaled_reward(max_len=0), "max_len must be a positive whole number"),
    (lambda: get_cosine_scaled_reward(max_len=10, max_value_correct=float("nan")), "finite numbers"),
    (lambda: get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=20), "from 0 to max_completion_len"),
    (lambda: get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=-1), "from 0 to max_completion_len"),
    (lambda: get_soft_overlong_punishment(max_completion_len=0, soft_punish_cache=0), "max_completion_len must be"),
])
def test_length_reward_factories_refuse_impossible_values_when_built(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_repetition_penalty_on_a_hand_counted_text():
    text = "the cat sat the cat sat the cat"
    vocabulary = {}
    token_ids = [vocabulary.setdefault(word, len(vocabulary)) for word in text.split()]  # one id per word
    # 8 words: 6 trigrams (the cat sat)(cat sat the)(sat the cat)(the cat sat)(cat sat the)(sat the cat),
    # 3 distinct: 1 - 3/6 = 0.5 of them repeated
    penalty = get_repetition_penalty_reward(ngram_size=3, max_penalty=-1.0)
    assert penalty(completion_ids=[token_ids]) == pytest.approx([-0.5])
    assert get_repetition_penalty_reward(3, -2.0)(completion_ids=[token_ids]) == pytest.approx([-1.0])
    # 4 distinct words: 2 trigrams, both distinct; 2 words: no trigram at all
    assert penalty(completion_ids=[[1, 2, 3, 4], [1, 2]]) == [0.0, 0.0]
    # 5 equal ids, bigrams: 4, one distinct: 1 - 1/4
    assert get_repetition_penalty_reward(2)(completion_ids=[[5] * 5]) == pytest.approx([-0.75])


def test_repetition_penalty_refuses_a_positive_penalty_and_pickles():
    with pytest.raises(ValueError, match="max_penalty"):
        get_repetition_penalty_reward(max_penalty=0.5)
    with pytest.raises(ValueError, match="ngram_size"):
        get_repetition_penalty_reward(ngram_size=0)
    penalty = pickle.loads(pickle.dumps(get_repetition_penalty_reward(2)))
    assert penalty.__name__ == "repetition_penalty_reward"
    assert penalty(completion_ids=[[5] * 5]) == pytest.approx([-0.75])


def test_length_rewards_pickle():
    for reward in (get_soft_overlong_punishment(10, 4), target_length_penalty(8, scale=4)):
        copy = pickle.loads(pickle.dumps(reward))
        assert copy.__name__ == reward.__name__
        assert copy(completion_ids=[ids(8), ids(12)]) == reward(completion_ids=[ids(8), ids(12)])
