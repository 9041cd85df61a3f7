"""The compact forward pass gives transformers' logits and gradients (up to float rounding): on the
shipped Llama, on small random Qwen2 and Qwen3 models (grouped-query attention, biases, query/key
norms) and through a LoRA adapter; models it cannot run are named and take transformers' path."""

import warnings
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from grpo_lab.accel import compact_forward
from grpo_lab.accel.prefix_sharing import PrefixSharing
from grpo_lab.core.model_calls import full_logits
from grpo_lab.core.models import load_tokenizer
from tests.forward_paths import path_logits

SMALL_MODEL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0)


def _dense_logits(model, batch, **kwargs):
    """(B, T, V) logits from ``PrefixSharing.logits``: zeros where the compact pass computes none."""
    logits, slots_N = path_logits(PrefixSharing(), model, *batch, **kwargs)
    if slots_N is None:
        return logits
    B, T = batch[2].shape
    return logits.new_zeros(B * T, logits.shape[-1]).index_copy(0, slots_N, logits).view(B, T, -1)


def _logits_and_grads(model, batch, *, compact: bool):
    model.zero_grad()
    logits_BTV = _dense_logits(model, batch, compact=compact)
    completion_ids, completion_mask = batch[2], batch[3]
    logprobs_BT = torch.log_softmax(logits_BTV, -1).gather(-1, completion_ids[..., None])[..., 0]
    (logprobs_BT * completion_mask).sum().backward()
    return logits_BTV.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_gradients_close(got: dict, expected: dict, *, rtol: float) -> None:
    """Equal up to float32 rounding: the compact pass skips padding, so its sums over tokens add the
    same terms in another order."""
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=rtol, atol=1e-5 * float(grad.abs().max()), msg=name)


def _small(config_class, model_class, **overrides):
    torch.manual_seed(0)
    return model_class(config_class(**{**SMALL_MODEL, **overrides})).train()


def test_the_shipped_model_gets_transformers_logits_and_gradients(task, batch):
    model = AutoModelForCausalLM.from_pretrained(task.model).train()
    assert compact_forward.unsupported_reason(model) is None
    transformers_logits, transformers_grads = _logits_and_grads(model, batch, compact=False)
    compact_logits, compact_grads = _logits_and_grads(model, batch, compact=True)
    mask = batch[3].bool()  # the logits after a completion's end predict nothing and are not compared
    torch.testing.assert_close(compact_logits[mask], transformers_logits[mask], rtol=1e-6, atol=1e-5)
    _assert_gradients_close(compact_grads, transformers_grads, rtol=1e-5)


def test_the_compact_pass_runs_no_position_that_predicts_padding(task, batch):
    """The head sees each distinct prompt's last position and, per completion of n tokens, the n - 1
    positions that predict its later tokens: one row of logits per kept token, at its position."""
    model = AutoModelForCausalLM.from_pretrained(task.model).eval()
    rows = []
    model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    with torch.no_grad():
        logits_NV, slots_N = path_logits(PrefixSharing(), model, *batch, compact=True)
    prompt_ids, completion_mask = batch[0], batch[3]
    distinct = len(torch.unique(prompt_ids, dim=0))
    assert rows == [distinct + int((completion_mask.sum(1) - 1).sum())] == [3 + 3 * (5 + 0 + 2 + 4)]
    assert logits_NV.shape == (int(completion_mask.sum()), model.config.vocab_size)
    assert torch.equal(slots_N.sort().values, completion_mask.flatten().nonzero().squeeze(1))


def test_a_mask_with_a_hole_or_an_empty_completion_is_scored_right(task, batch):
    """The packed pass assumes right-padded masks: one with a hole takes the two-call pass instead.
    An empty completion (all zeros) gets no slot."""
    model = AutoModelForCausalLM.from_pretrained(task.model).eval()
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    holed = completion_mask.clone()
    holed[0, 2] = 0
    empty = completion_mask.clone()
    empty[1] = 0
    with torch.no_grad():
        for mask in (holed, empty):
            args = (prompt_ids, prompt_mask, completion_ids, mask)
            logits, slots_N = path_logits(PrefixSharing(), model, *args, compact=True)
            expected = full_logits(model, *args)
            if mask is holed:
                assert slots_N is None  # the two-call pass
                torch.testing.assert_close(logits[mask == 1], expected[mask == 1], rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(slots_N.sort().values, mask.flatten().nonzero().squeeze(1))
                torch.testing.assert_close(logits, expected.flatten(0, 1)[slots_N], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_qwen_models_get_transformers_logits_and_gradients(batch, architecture):
    if architecture == "qwen2":
        model = _small(Qwen2Config, Qwen2ForCausalLM)  # q/k/v projections with biases
    else:
        model = _small(Qwen3Config, Qwen3ForCausalLM)  # RMSNorm on each query and key head
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert compact_forward.unsupported_reason(model) is None
    transformers_logits, transformers_grads = _logits_and_grads(model, batch, compact=False)
    compact_logits, compact_grads = _logits_and_grads(model, batch, compact=True)
    mask = batch[3].bool()
    torch.testing.assert_close(compact_logits[mask], transformers_logits[mask], rtol=1e-5, atol=1e-5)
    _assert_gradients_close(compact_grads, transformers_grads, rtol=1e-4)


def test_decoding_products_of_large_weights_are_taken_weight_first_and_only_those():
    """A decoding step on a CPU takes the product of a bias-free float32 weight of
    WEIGHT_FIRST_MIN_BYTES or more as (W @ x^T)^T, a transposed view, with the module's values up to
    rounding; anything else calls the module, so that its bias, hooks and dtype apply."""
    torch.manual_seed(0)
    big = torch.nn.Linear(512, 512, bias=False)
    assert big.weight.numel() * 4 >= compact_forward.WEIGHT_FIRST_MIN_BYTES
    hidden = torch.randn(16, 1, 512)
    with torch.no_grad():
        taken = compact_forward._linear(big, hidden, weight_first=True)
        assert taken.shape == (16, 1, 512) and not taken.is_contiguous()
        torch.testing.assert_close(taken, big(hidden), rtol=1e-5, atol=1e-6)
        assert compact_forward._linear(big, hidden, weight_first=False).is_contiguous()
        small = torch.nn.Linear(512, 128, bias=False)
        assert small.weight.numel() * 4 < compact_forward.WEIGHT_FIRST_MIN_BYTES
        assert compact_forward._linear(small, hidden, weight_first=True).is_contiguous()
        assert compact_forward._linear(torch.nn.Linear(512, 512), hidden, weight_first=True).is_contiguous()  # bias
        assert compact_forward._linear(big.to(torch.bfloat16), hidden.bfloat16(), weight_first=True).is_contiguous()
        calls = []
        hooked = torch.nn.Linear(512, 512, bias=False)
        hooked.register_forward_hook(lambda module, args, output: calls.append(output.shape))
        compact_forward._linear(hooked, hidden, weight_first=True)
        assert calls == [(16, 1, 512)]


def test_a_model_with_large_weights_decodes_with_transformers_logits():
    """Decoding steps of a Llama whose projections reach WEIGHT_FIRST_MIN_BYTES (its head does not)
    give transformers' logits for the whole sequences, up to float rounding."""
    model = _small(LlamaConfig, LlamaForCausalLM, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64).eval()
    sizes = {name: p.numel() * 4 for name, p in model.named_parameters() if p.dim() == 2}
    threshold = compact_forward.WEIGHT_FIRST_MIN_BYTES
    assert sizes["model.layers.0.mlp.up_proj.weight"] >= threshold > sizes["lm_head.weight"]
    generator = torch.Generator().manual_seed(1)
    ids_BS = torch.randint(3, 300, (6, 9), generator=generator)
    valid_BS = torch.ones(6, 9, dtype=torch.bool)
    valid_BS[:3, :2] = False  # left padding
    positions_BS = (valid_BS.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        expected_BSV = model(input_ids=ids_BS, attention_mask=valid_BS.long()).logits
        cache = compact_forward.new_cache(model)
        compact_forward.forward(model, ids_BS[:, :6], positions_BS[:, :6], valid_BS, cache, 0, last_only=True)
        for step in range(6, 9):
            logits_BV = compact_forward.forward(model, ids_BS[:, step:step + 1], positions_BS[:, step:step + 1],
                                                valid_BS, cache, step, last_only=True)
            torch.testing.assert_close(logits_BV, expected_BSV[:, step], rtol=1e-5, atol=1e-5)
        with torch.profiler.profile() as profile:
            compact_forward.forward(model, ids_BS[:, 8:], positions_BS[:, 8:], valid_BS, cache, 8, last_only=True)
    # A weight-first query is made contiguous: otherwise attention falls back to the math kernel
    kernels = {event.name for event in profile.events() if "scaled_dot_product" in event.name}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in kernels
    assert "aten::_scaled_dot_product_attention_math" not in kernels


def test_a_lora_adapter_applies_in_the_compact_pass(task, batch):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(task.model)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                            init_lora_weights=False)).train()
    assert compact_forward.unsupported_reason(model) is None
    with torch.no_grad():
        with model.disable_adapter():
            without_adapter = _dense_logits(model, batch, compact=True)
        expected = full_logits(model, *batch)
    transformers_logits, transformers_grads = _logits_and_grads(model, batch, compact=False)
    compact_logits, compact_grads = _logits_and_grads(model, batch, compact=True)
    mask = batch[3].bool()
    assert (without_adapter[mask] - expected[mask]).abs().max() > 1e-2, "the adapter should change the logits"
    torch.testing.assert_close(compact_logits[mask], transformers_logits[mask], rtol=1e-5, atol=1e-5)
    assert all("lora_" in name for name in compact_grads)
    _assert_gradients_close(compact_grads, transformers_grads, rtol=1e-4)


def test_models_it_cannot_run_are_named_and_take_transformers_path(task, batch):
    from peft import PrefixTuningConfig, get_peft_model

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=1, n_head=2, bos_token_id=1,
                                          eos_token_id=2)).eval()
    assert compact_forward.unsupported_reason(gpt2) == (
        "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel is not one of transformers' LlamaForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM"
    )

    class MyLlama(LlamaForCausalLM):  # a subclass may change forward()
        pass

    assert "MyLlama is not one of" in compact_forward.unsupported_reason(MyLlama(LlamaConfig(**SMALL_MODEL)))
    hooked = AutoModelForCausalLM.from_pretrained(task.model)
    hooked.model.layers[1].register_forward_hook(lambda module, args, output: output)
    assert compact_forward.unsupported_reason(hooked) == (
        "forward hooks on model.layers.1 would not run (only its submodules are called)"
    )
    fewer = AutoModelForCausalLM.from_pretrained(task.model)
    fewer.config.num_hidden_layers = 2
    assert compact_forward.unsupported_reason(fewer) == "the model has 4 layers, its config num_hidden_layers=2"
    sliding = _small(Qwen2Config, Qwen2ForCausalLM, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert compact_forward.unsupported_reason(sliding) == "the model has sliding-window attention layers"
    prefix = get_peft_model(AutoModelForCausalLM.from_pretrained(task.model),
                            PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    assert "prompt-learning" in compact_forward.unsupported_reason(prefix)
    shipped = AutoModelForCausalLM.from_pretrained(task.model)
    shipped.model.norm.weight.data = torch.empty(0)  # as a ZeRO-3 partition looks outside its forward
    assert "sharded" in compact_forward.unsupported_reason(shipped)
    with torch.no_grad():  # a model it cannot run still gets its logits, from transformers
        mask = batch[3].bool()
        torch.testing.assert_close(_dense_logits(gpt2, batch, compact=True)[mask],
                                   full_logits(gpt2, *batch)[mask], rtol=1e-5, atol=1e-5)


def test_left_padding_that_sees_nothing_attends_to_itself():
    valid_BS = torch.tensor([[False, False, True, True], [True, True, True, True]])
    mask_B1LS = compact_forward.attention_mask(valid_BS, 0, 4)
    assert mask_B1LS.shape == (2, 1, 4, 4)
    assert mask_B1LS[0, 0].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert mask_B1LS[1, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    # Continuing at position 2 (one call after another): the new positions see the earlier ones.
    assert compact_forward.attention_mask(valid_BS, 2, 4)[0, 0].int().tolist() == [[0, 0, 1, 0], [0, 0, 1, 1]]


def test_a_session_trains_the_same_with_either_forward_pass(make_session):
    """Generation draws the same tokens and the loss pass gets the same logits up to float rounding, so
    two sessions from one seed, one on each path, take the same steps: the same completions and
    rewards, the same loss metrics to 1e-5, the same weights."""
    runs = []
    for compact in (True, False):
        session = make_session(compact_forward=compact, max_steps=3)
        assert compact_forward.unsupported_reason(session.model) is None  # the compact path is the one switched
        results = [session.step() for _ in range(3)]
        runs.append((results, session.model))
    (compact_results, compact_model), (plain_results, plain_model) = runs
    for compact_step, plain_step in zip(compact_results, plain_results):
        compact_step.pop("step_time"), plain_step.pop("step_time")
        assert compact_step.keys() == plain_step.keys()
        sampled = [name for name in plain_step if name.startswith(("reward", "completions/", "num_tokens"))]
        assert len(sampled) > 5 and all(compact_step[name] == plain_step[name] for name in sampled)
        assert compact_step == pytest.approx(plain_step, rel=1e-5, abs=1e-7)
    for (name, compact_param), plain_param in zip(compact_model.named_parameters(), plain_model.parameters()):
        # AdamW turns a rounding difference in a near-zero gradient into up to a step of the learning
        # rate (1e-3); 1e-5 is 1% of it (the largest difference seen: 4e-6; the mean: 2e-9)
        torch.testing.assert_close(compact_param, plain_param, rtol=1e-5, atol=1e-5, msg=name)


def test_log_probs_of_the_kept_tokens_only_and_zeros_after_each_end(make_session):
    """The engine scores the compact pass's kept tokens (a row of N logits) and spreads the results
    back to (B, T): the plain pass's values where the mask keeps a token, zeros after the end."""
    session = make_session()
    rollout = session.generate()
    mask = rollout.completion_mask_BT.bool()
    assert not mask.all(), "the batch should hold completions of different lengths"
    index_B = torch.arange(len(rollout))
    results = {}
    for compact in (True, False):
        session.engine.config.compact_forward = compact
        with torch.no_grad():
            results[compact] = session.engine.sequence_logprobs(session.model, rollout, index_B, with_entropy=True)
    (logprobs, entropies), (plain_logprobs, plain_entropies) = results[True], results[False]
    torch.testing.assert_close(logprobs[mask], plain_logprobs[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropies[mask], plain_entropies[mask], rtol=1e-5, atol=1e-5)
    assert logprobs[~mask].eq(0).all() and entropies[~mask].eq(0).all()
    assert plain_logprobs[~mask].ne(0).all()  # the plain pass scores the padding too


def test_a_model_or_setting_that_keeps_the_compact_pass_off_is_warned_about_once(task, make_session):
    def notes(make, steps=2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            session = make()
            for _ in range(steps):
                session.step()
        ours = [w for w in caught if "compact" in str(w.message) or "model.generate, not" in str(w.message)]
        package = str(Path(compact_forward.__file__).parent)
        assert not [w.filename for w in ours if w.filename.startswith(package)]  # the caller's line, not grpo_lab's
        return [str(w.message) for w in ours]

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=1, n_head=2))
    tokenizer = load_tokenizer(task.model)
    assert notes(lambda: make_session(model=gpt2, processing_class=tokenizer)) == [
        "compact_forward is on, but grpo_lab's compact forward pass cannot run this model, so transformers' slower "
        "forward pass runs instead: transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel is not one of "
        "transformers' LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM. Set compact_forward=False to silence "
        "this note."
    ]
    assert notes(lambda: make_session(repetition_penalty=1.1)) == [
        "Generation runs model.generate, not grpo_lab's faster sampling loop: repetition_penalty needs "
        "model.generate. The log-prob passes are not affected."
    ]
    assert notes(lambda: make_session(cache_implementation="static")) == [
        "Generation runs model.generate, not grpo_lab's faster sampling loop: the generation settings "
        "cache_implementation need model.generate. The log-prob passes are not affected."
    ]
    assert notes(lambda: make_session(cache_implementation="dynamic")) == []  # generate's default cache
    assert notes(make_session) == []
    assert notes(lambda: make_session(model=gpt2, processing_class=tokenizer, compact_forward=False), steps=1) == []
