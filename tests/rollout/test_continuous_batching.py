"""use_transformers_continuous_batching: generation by transformers' continuous batching engine."""

import pytest
import torch

from grpo_lab import GRPOConfig

# A cache of a fixed size: by default the engine takes half the host's free memory, which makes a test's
# cost depend on what else the machine runs (minutes where a parallel test run leaves gigabytes free).
SMALL_CACHE = {"num_blocks": 16, "max_batch_tokens": 512}


@pytest.mark.slow  # the engine takes seconds to start on a CPU
def test_a_session_generates_with_continuous_batching_and_trains(make_session):
    session = make_session(use_transformers_continuous_batching=True,
                           transformers_continuous_batching_config=SMALL_CACHE)
    rollout = session.generate()
    lengths = rollout.completion_mask_BT.sum(1)
    assert rollout.completion_mask_BT.shape[1] <= session.config.max_completion_length
    assert torch.equal(rollout.completion_mask_BT,
                       (torch.arange(rollout.completion_mask_BT.shape[1]) < lengths[:, None]).long())
    eos = session.tokenizer.eos_token_id
    for ids, length, truncated in zip(rollout.completion_ids_BT, lengths, rollout.is_truncated_B, strict=True):
        assert bool(truncated) == (int(ids[length - 1]) != eos)  # ended by EOS, or cut at the limit
        assert (ids[length:] == session.tokenizer.pad_token_id).all()
    assert rollout.completion_texts[0].startswith("<answer>")  # the shipped model's answers, not noise
    session.score(), session.advantages(), session.loss()
    assert session.update()["update_skipped"] == 0.0


@pytest.mark.slow
def test_continuous_batching_applies_the_sampling_settings_as_generate_does(make_session):
    # top_k=1 leaves one token to draw: both engines then pick each step's most likely token, where
    # temperature 3 alone would draw noise from the shipped model
    engine, loop = (make_session(top_k=1, temperature=3.0, use_transformers_continuous_batching=cb,
                                 transformers_continuous_batching_config=SMALL_CACHE if cb else None).generate()
                    for cb in (True, False))
    assert engine.completion_texts == loop.completion_texts
    assert torch.equal(engine.completion_ids_BT, loop.completion_ids_BT)


def test_continuous_batching_settings_are_checked_when_the_config_is_built():
    with pytest.warns(FutureWarning, match="use_transformers_paged is deprecated"):
        config = GRPOConfig(use_transformers_paged=True)
    assert config.use_transformers_continuous_batching and not config.use_transformers_paged
    with pytest.raises(ValueError, match="both choose the generation engine"):
        GRPOConfig(use_transformers_continuous_batching=True, use_vllm=True)
    with pytest.raises(ValueError, match="use_transformers_continuous_batching is False, so nothing would read it"):
        GRPOConfig(transformers_continuous_batching_config={"max_memory_percent": 0.3})
    with pytest.raises(ValueError, match="unexpected keyword argument 'nope'"):
        GRPOConfig(use_transformers_continuous_batching=True, transformers_continuous_batching_config={"nope": 1})
    assert GRPOConfig(use_transformers_continuous_batching=True).continuous_batching_config().max_memory_percent == 0.5
    for unsupported, named in [(dict(repetition_penalty=1.2), "repetition_penalty=1.2"),
                               (dict(cache_implementation="static"), "cache_implementation='static'"),
                               (dict(generation_kwargs={"num_return_sequences": 2}),
                                "generation_kwargs['num_return_sequences']"),
                               (dict(transformers_continuous_batching_config={"seed": 1}),
                                "reseeds the whole process")]:
        with pytest.raises(ValueError, match=f"cannot apply .*{named}".replace("[", r"\[").replace("(", r"\(")):
            GRPOConfig(use_transformers_continuous_batching=True, **unsupported)
    GRPOConfig(use_transformers_continuous_batching=True, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05,
               generation_kwargs={"do_sample": True})
