"""grpo_lab's sampling loop draws, under one seed, the tokens ``model.generate`` draws, for the
sampling settings it supports; any other setting goes to ``model.generate``."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from grpo_lab.accel import decoding
from grpo_lab.accel.prefix_sharing import PrefixSharing
from grpo_lab.core.models import load_tokenizer, prepare_tokenizer
from grpo_lab.rollout.hf import generate, sampling_config
from grpo_lab.rollout.prompts import render_prompts


@pytest.fixture(scope="module")
def model_and_tokenizer(task):
    return AutoModelForCausalLM.from_pretrained(task.model), prepare_tokenizer(load_tokenizer(task.model))


@pytest.fixture(scope="module")
def texts(task, model_and_tokenizer):
    """6 prompts of different lengths, 8 copies each (GRPO groups)."""
    prompts = render_prompts([task.train_dataset[i]["prompt"] for i in range(5)], model_and_tokenizer[1]) + ["7+8="]
    return [text for text in prompts for _ in range(8)]


def _draw(model, tokenizer, texts, settings, *, compact, sharing=True, seed=3):
    torch.manual_seed(seed)
    return generate(model, tokenizer, texts, settings, PrefixSharing() if sharing else None, compact=compact)


@pytest.mark.parametrize("sampling", [
    dict(),  # temperature 1, no top-k or top-p: the benchmarks' and TRL's defaults
    dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05),
    dict(do_sample=False),
])
@pytest.mark.parametrize("sharing", [True, False])
def test_the_loop_draws_the_tokens_generate_draws(model_and_tokenizer, texts, sampling, sharing):
    model, tokenizer = model_and_tokenizer
    settings = sampling_config(tokenizer, max_new_tokens=8, **sampling)
    assert decoding.unsupported_reason(model, settings) is None
    expected = _draw(model, tokenizer, texts, settings, compact=False, sharing=sharing)
    got = _draw(model, tokenizer, texts, settings, compact=True, sharing=sharing)
    assert torch.equal(got.completion_ids_BT, expected.completion_ids_BT)
    assert torch.equal(got.completion_mask_BT, expected.completion_mask_BT)
    assert torch.equal(got.is_truncated_B, expected.is_truncated_B)
    # Not a trivial batch: rows end at different lengths, and another seed draws other tokens.
    lengths = expected.completion_mask_BT.sum(1)
    assert lengths.min() < lengths.max()
    if sampling.get("do_sample", True):
        other = _draw(model, tokenizer, texts, settings, compact=True, sharing=sharing, seed=4)
        assert not torch.equal(other.completion_ids_BT, got.completion_ids_BT)


def test_rows_that_never_finish_stop_at_max_new_tokens(model_and_tokenizer, texts):
    model, tokenizer = model_and_tokenizer
    settings = sampling_config(tokenizer, max_new_tokens=3)
    got = _draw(model, tokenizer, texts, settings, compact=True)
    assert got.completion_ids_BT.shape == (len(texts), 3)
    assert torch.equal(got.completion_ids_BT, _draw(model, tokenizer, texts, settings, compact=False).completion_ids_BT)


@pytest.mark.parametrize("extra, reason", [
    (dict(repetition_penalty=1.2), "repetition_penalty needs model.generate"),
    (dict(generation_kwargs={"no_repeat_ngram_size": 2}),
     "the generation settings no_repeat_ngram_size need model.generate"),
    (dict(generation_kwargs={"num_beams": 2, "typical_p": 0.9}),
     "the generation settings num_beams, typical_p need model.generate"),
    (dict(generation_kwargs={"use_cache": False}), "use_cache=False asks model.generate to recompute every step"),
    (dict(cache_implementation="static"), "the generation settings cache_implementation need model.generate"),
])
def test_other_generation_settings_go_to_generate(model_and_tokenizer, texts, extra, reason):
    model, tokenizer = model_and_tokenizer
    settings = sampling_config(tokenizer, max_new_tokens=4, **extra)
    assert decoding.unsupported_reason(model, settings) == reason
    got = _draw(model, tokenizer, texts[:8], settings, compact=True)  # model.generate, both times
    assert torch.equal(got.completion_ids_BT,
                       _draw(model, tokenizer, texts[:8], settings, compact=False).completion_ids_BT)


def test_the_models_generation_defaults_fill_only_what_the_settings_leave_unset(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    settings = sampling_config(tokenizer, max_new_tokens=4)  # sets repetition_penalty=1.0 itself
    saved = model.generation_config
    try:
        model.generation_config = GenerationConfig(repetition_penalty=1.05, top_k=20, max_length=20)
        assert decoding.unsupported_reason(model, settings) is None
        assert decoding.effective_settings(model, settings)["top_k"] == 0
        model.generation_config = GenerationConfig(min_p=0.1, no_repeat_ngram_size=3)
        assert decoding.effective_settings(model, settings)["min_p"] == 0.1  # unset (None) in the settings
        assert decoding.unsupported_reason(model, settings) == (
            "the generation settings no_repeat_ngram_size need model.generate"
        )
    finally:
        model.generation_config = saved


def test_warpers_follow_generates_order(model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    settings = dict(vars(sampling_config(tokenizer, max_new_tokens=4, temperature=0.5, top_k=3, top_p=0.5, min_p=0.1)))
    names = [type(warper).__name__ for warper in decoding.warpers(settings)]
    assert names == ["TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper"]
    plain = dict(vars(sampling_config(tokenizer, max_new_tokens=4)))
    assert len(decoding.warpers(plain)) == 0


def test_settings_left_unset_take_generates_defaults(model_and_tokenizer, texts):
    """A bare GenerationConfig leaves top_k unset, which generate fills with transformers' 50; the loop
    must do the same. Settings given their default value (num_beams=1) stay with the loop."""
    model, tokenizer = model_and_tokenizer
    settings = GenerationConfig(do_sample=True, max_new_tokens=6, num_beams=1, pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id)
    assert decoding.unsupported_reason(model, settings) is None
    assert decoding.effective_settings(model, settings)["top_k"] == 50
    got = _draw(model, tokenizer, texts, settings, compact=True)
    assert torch.equal(got.completion_ids_BT, _draw(model, tokenizer, texts, settings, compact=False).completion_ids_BT)


def test_without_a_pad_token_finished_rows_are_filled_with_eos_as_generate_does(model_and_tokenizer, texts):
    model, tokenizer = model_and_tokenizer
    settings = sampling_config(tokenizer, max_new_tokens=8)
    settings.pad_token_id = None
    ids, mask = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).values()
    saved, model.generation_config = model.generation_config, GenerationConfig()  # no pad token anywhere
    try:
        model.eval()
        torch.manual_seed(0)
        got = decoding.sample(model, ids, mask, settings)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # generate's note that it pads with the EOS token
            expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=settings)[:, ids.shape[1]:]
    finally:
        model.generation_config = saved
    assert (got == tokenizer.eos_token_id).sum(1).max() > 1, "some rows should be padded after their EOS"
    assert torch.equal(got, expected)
