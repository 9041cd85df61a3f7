"""Prefix sharing: each distinct prompt runs once, and the logits, gradients and generations are those
of the plain pass. The shipped tiny Llama is the model; a token counter on its embedding layer shows
which pass ran."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from grpo_lab.accel import prefix_sharing
from grpo_lab.accel.prefix_sharing import PrefixSharing, distinct_prompts
from grpo_lab.core.model_calls import full_logits
from grpo_lab.core.models import enable_gradient_checkpointing, load_tokenizer, prepare_tokenizer
from grpo_lab.rollout.hf import generate, sampling_config
from grpo_lab.rollout.prompts import render_prompts
from tests.forward_paths import path_logits

GROUP = 4
"""Completions per prompt in the ``batch`` fixture (tests/conftest.py)."""


def test_distinct_prompts_by_hand():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6], [7, 8, 9], [0, 5, 6]])
    # The last row has the ids of row 0 but its first token is real, not padding: another prompt.
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    first_U, inverse_B = distinct_prompts(ids, mask)
    assert sorted(first_U.tolist()) == [0, 2, 5]
    assert first_U[inverse_B].tolist() == [0, 0, 2, 0, 2, 5]


class TokenCounter:
    """Counts the token positions a model's embedding layer sees."""

    def __init__(self, model):
        self.count = self.calls = 0
        model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += args[0].numel()
        self.calls += 1

    def during(self, fn):
        before = self.count
        result = fn()
        return result, self.count - before


@pytest.fixture
def model(task):
    model = AutoModelForCausalLM.from_pretrained(task.model).train()
    return model, TokenCounter(model)


def _expected_tokens(batch) -> tuple[int, int]:
    """Tokens the embedding sees in the plain pass, and in the shared pass (3 distinct prompts once,
    then every completion's tokens but the last, which predicts nothing)."""
    (B, P), T = batch[0].shape, batch[2].shape[1]
    return B * (P + T), 3 * P + B * (T - 1)


def _logprob_sum(logits_BTV, completion_ids, completion_mask):
    logprobs_BT = torch.log_softmax(logits_BTV, -1).gather(-1, completion_ids[..., None])[..., 0]
    return (logprobs_BT * completion_mask).sum()


def _logits_and_grads(model, fn, completion_ids, completion_mask):
    model.zero_grad()
    logits = fn()
    _logprob_sum(logits, completion_ids, completion_mask).backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def test_shared_prompts_give_the_plain_logits_and_gradients_with_fewer_tokens(model, batch):
    model, counter = model
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    sharing = PrefixSharing()
    (plain, plain_grads), plain_tokens = counter.during(
        lambda: _logits_and_grads(model, lambda: full_logits(model, *batch), completion_ids, completion_mask))
    (shared, shared_grads), shared_tokens = counter.during(
        lambda: _logits_and_grads(model, lambda: path_logits(sharing, model, *batch)[0], completion_ids,
                                  completion_mask))

    assert (plain_tokens, shared_tokens) == _expected_tokens(batch)
    mask = completion_mask.bool()
    assert shared.shape == plain.shape
    torch.testing.assert_close(shared[mask], plain[mask], atol=1e-5, rtol=1e-5)
    scale = max(g.abs().max() for g in plain_grads)
    for got, expected in zip(shared_grads, plain_grads):
        torch.testing.assert_close(got / scale, expected / scale, atol=1e-5, rtol=0)
    assert sharing.disabled_reason == {}


def test_every_batch_takes_the_same_two_calls(model, batch):
    """Under DDP, FSDP or ZeRO-3 each forward call may synchronise the processes, so the number of
    calls must not depend on what a process's batch holds: one-token completions, or no prompt shared."""
    model, counter = model
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    one_token = (prompt_ids, prompt_mask, completion_ids[:, :1], completion_mask[:, :1])
    one_each = tuple(t[::GROUP] for t in batch)
    sharing = PrefixSharing()
    with torch.no_grad():
        for args in (batch, one_token, one_each):
            before = counter.calls
            shared = path_logits(sharing, model, *args)[0]
            assert counter.calls - before == 2
            torch.testing.assert_close(shared, full_logits(model, *args), atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_in_training_mode_runs_the_plain_pass(model, batch):
    """transformers drops the cache of a checkpointed layer in training mode: sharing must not be tried."""
    model, counter = model
    plain, shared = _expected_tokens(batch)
    enable_gradient_checkpointing(model, {"use_reentrant": False})
    sharing = PrefixSharing()
    with torch.no_grad():
        logits, tokens = counter.during(lambda: path_logits(sharing, model, *batch)[0])
        torch.testing.assert_close(logits, full_logits(model, *batch))
        assert tokens == plain
        model.eval()  # no checkpointing in eval mode: shared again
        assert counter.during(lambda: path_logits(sharing, model, *batch)[0])[1] == shared


def test_torch_checkpoint_wrappers_and_randomness_in_training_mode_run_the_plain_pass(model, batch):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model, counter = model
    plain, shared = _expected_tokens(batch)
    sharing = PrefixSharing()
    tokens = lambda: counter.during(lambda: path_logits(sharing, model, *batch)[0])[1]  # noqa: E731
    layers = model.model.layers
    original = layers[0]
    layers[0] = checkpoint_wrapper(original)  # what accelerate's FSDP activation checkpointing does
    with torch.no_grad():
        assert tokens() == plain
        layers[0] = original
        model.config.attention_dropout = 0.1  # Llama drops out inside attention, without a Dropout module
        assert tokens() == plain
        model.config.attention_dropout = 0.0
        model.config.router_jitter_noise = 0.01  # mixture-of-experts routers jitter in training mode
        assert tokens() == plain
        model.config.router_jitter_noise = 0.0
        model.config.ffn_config = {"moe_jitter_eps": 0.01}  # DBRX keeps it in a nested config
        assert tokens() == plain
        model.config.ffn_config = {"moe_jitter_eps": 0.0}
        assert tokens() == shared


def test_sharing_off_runs_the_plain_pass(model, batch):
    model, counter = model
    with torch.no_grad():
        _, tokens = counter.during(lambda: path_logits(PrefixSharing(), model, *batch, enabled=False)[0])
    assert tokens == _expected_tokens(batch)[0]


def test_a_sliding_window_cache_is_not_shared_and_the_reason_is_kept(batch):
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, sliding_window=4, max_position_embeddings=64)
    model = MistralForCausalLM(config).eval()
    counter = TokenCounter(model)
    sharing = PrefixSharing()
    with torch.no_grad(), pytest.warns(UserWarning, match="sharing is off for this model: .*DynamicSlidingWindowLayer"):
        logits = path_logits(sharing, model, *batch)[0]
    with torch.no_grad():
        torch.testing.assert_close(logits, full_logits(model, *batch))
        assert "DynamicSlidingWindowLayer" in sharing.disabled_reason[id(model)]
        _, tokens = counter.during(lambda: path_logits(sharing, model, *batch)[0])
    assert tokens == _expected_tokens(batch)[0]  # no second attempt at the shared pass


def test_a_session_warns_once_about_a_cache_it_cannot_share(make_session, task):
    """Generation and the log-prob passes use the trainer's one PrefixSharing: the model is tried,
    and warned about, once."""
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, sliding_window=4, max_position_embeddings=64)
    session = make_session(model=MistralForCausalLM(config), processing_class=load_tokenizer(task.model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session.generate(), session.score(), session.advantages(), session.loss()
    assert [str(w.message) for w in caught if "sharing is off" in str(w.message)] == [
        "Prompt prefix sharing is off for this model: the model's cache has DynamicSlidingWindowLayer layers "
        "(sliding-window or recurrent state). The plain pass runs."
    ]


def test_generation_with_a_shared_prompt_cache_samples_the_same_tokens(task, model):
    model, counter = model
    tokenizer = prepare_tokenizer(load_tokenizer(task.model))
    texts = [t for t in render_prompts([task.train_dataset[i]["prompt"] for i in range(4)], tokenizer)
             for _ in range(8)]
    settings = sampling_config(tokenizer, max_new_tokens=8)
    runs = {}
    for sharing in (None, PrefixSharing()):
        torch.manual_seed(0)
        runs[sharing is not None] = counter.during(lambda: generate(model, tokenizer, texts, settings, sharing))
    (plain, plain_tokens), (shared, shared_tokens) = runs[False], runs[True]
    assert torch.equal(shared.completion_ids_BT, plain.completion_ids_BT)
    assert torch.equal(shared.completion_mask_BT, plain.completion_mask_BT)
    assert model.training, "generate() puts the model back in training mode"
    P = plain.prompt_ids_BP.shape[1]
    # The pre-fill of 32 prompts becomes 4 distinct prompts without their last token, then that token for 32.
    assert plain_tokens - shared_tokens == 32 * P - (4 * (P - 1) + 32)


NEEDS_OWN_CACHE = [dict(num_return_sequences=2), dict(cache_implementation="dynamic"), dict(num_beams=2)]


@pytest.mark.parametrize("setting", NEEDS_OWN_CACHE)
def test_generation_settings_that_need_their_own_cache_run_without_sharing(task, model, setting):
    """Set in the model's own generation config (which generate() falls back to) or passed in."""
    model, _ = model
    tokenizer = prepare_tokenizer(load_tokenizer(task.model))
    prompts = render_prompts([task.train_dataset[i]["prompt"] for i in range(2)], tokenizer)
    texts = [text for text in prompts for _ in range(4)]
    for key, value in setting.items():
        setattr(model.generation_config, key, value)
    for extra in ({}, setting):
        settings = sampling_config(tokenizer, max_new_tokens=4, generation_kwargs=extra)
        torch.manual_seed(0)
        plain = generate(model, tokenizer, texts, settings)
        torch.manual_seed(0)
        shared = generate(model, tokenizer, texts, settings, PrefixSharing())
        assert torch.equal(shared.completion_ids_BT, plain.completion_ids_BT)


def test_the_session_loss_is_the_same_with_and_without_sharing(make_session):
    session = make_session(num_generations=4, per_device_train_batch_size=8)
    counter = TokenCounter(session.engine.unwrapped_model)
    session.generate()
    session.score()
    session.advantages()
    results = {}
    for enabled in (True, False):
        session.config.share_prompt_prefix = enabled
        result, tokens = counter.during(session.loss)
        grads = [p.grad.clone() for p in session.engine.unwrapped_model.parameters()]
        results[enabled] = result, tokens, grads
    (shared, shared_tokens, shared_grads), (plain, plain_tokens, plain_grads) = results[True], results[False]
    assert shared_tokens < plain_tokens
    assert shared.loss == pytest.approx(plain.loss, rel=1e-5, abs=1e-7)
    scale = max(g.abs().max() for g in plain_grads)
    for got, expected in zip(shared_grads, plain_grads):
        torch.testing.assert_close(got / scale, expected / scale, atol=1e-5, rtol=0)


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_the_old_policy_pass_takes_the_training_pass_path_so_the_first_ratio_is_exactly_one(
    make_session, gradient_checkpointing
):
    """Shared (no checkpointing) or plain (checkpointing), the old-policy log-probs and the training
    pass's must be computed the same way: on the first of num_iterations, ratio = exp(0) = 1 exactly."""
    session = make_session(num_generations=4, per_device_train_batch_size=8, num_iterations=2,
                           gradient_checkpointing=gradient_checkpointing)
    rollout, _, _ = session.generate(), session.score(), session.advantages()
    result = session.loss()
    mask = rollout.completion_mask_BT.bool()
    assert torch.equal(result.logprobs_BT[mask], rollout.old_logprobs_BT[mask])
    assert torch.equal(result.ratio_BT[mask], torch.ones_like(result.ratio_BT[mask]))


def test_rotary_scaling_that_depends_on_the_call_length_runs_the_plain_pass(monkeypatch):
    """Dynamic NTK scaling picks its frequencies from the longest position a call sees: a prompt run
    alone (positions up to 9 here, under the 12 the model was trained on) is rotated unlike the same
    prompt inside its 16-position row, so sharing it would change the logits."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, head_dim=16, max_position_embeddings=12, pad_token_id=0,
                         rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    model = LlamaForCausalLM(config).eval()
    prompt_ids = torch.randint(3, 290, (2, 10)).repeat_interleave(GROUP, 0)
    completion_ids = torch.randint(3, 290, (2 * GROUP, 6))
    args = (model, prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids))
    sharing = PrefixSharing()
    assert sharing.skip_reason(model) == (
        "dynamic rotary scaling depends on each call's length (a prompt run alone is scaled otherwise)"
    )
    with torch.no_grad():
        plain = full_logits(*args)
        assert torch.equal(path_logits(sharing, *args, compact=True)[0], plain)
    monkeypatch.setattr(prefix_sharing, "_length_dependent_rope", lambda model: None)
    with torch.no_grad():  # what sharing would have given: the prompt alone runs in a call of its own
        shared = path_logits(sharing, *args)[0]
    assert (shared - plain).abs().max() > 1e-4
