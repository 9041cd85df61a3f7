"""The buffered key/value cache layer: the keys and values of transformers' concatenating layer,
written in place into room allocated once."""

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache, DynamicLayer

from grpo_lab.accel.kv_buffer import BufferedLayer, buffer_cache
from grpo_lab.accel.prefix_sharing import PrefixSharing
from grpo_lab.core.models import CACHE, load_tokenizer, prepare_tokenizer
from grpo_lab.rollout.hf import generate, sampling_config
from grpo_lab.rollout.prompts import render_prompts


def _steps(lengths, generator):
    """(keys, values) of 3 rows x 2 heads x n positions x 4 for each n in ``lengths``."""
    return [(torch.randn(3, 2, n, 4, generator=generator), torch.randn(3, 2, n, 4, generator=generator))
            for n in lengths]


def test_updates_return_the_concatenation_and_write_in_place_until_the_room_is_full():
    generator = torch.Generator().manual_seed(0)
    plain, buffered = DynamicLayer(), BufferedLayer(block=3)
    pointers = []
    for keys, values in _steps([5, 1, 1, 1, 1, 1], generator):  # room 5 + 3, filled by 3 steps; then 9 + 3
        expected = plain.update(keys, values)
        got = buffered.update(keys, values)
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
        assert buffered.get_seq_length() == plain.get_seq_length()
        pointers.append(buffered._keys_buffer.data_ptr())
    assert len(set(pointers[:4])) == 1, "no new allocation while the room lasts"
    assert pointers[4] != pointers[3] and buffered._keys_buffer.shape[-2] == 9 + 3, "past it, another block"
    assert pointers[5] == pointers[4]


def test_a_cache_replaced_from_outside_is_taken_into_fresh_buffers():
    generator = torch.Generator().manual_seed(1)
    plain, buffered = DynamicLayer(), BufferedLayer(block=16)
    (k0, v0), (k1, v1), (k2, v2) = _steps([4, 1, 1], generator)
    for layer in (plain, buffered):
        layer.update(k0, v0)
        layer.update(k1, v1)
        layer.batch_select_indices(torch.tensor([2, 0, 0]))  # as beam search or a row filter would
    expected, got = plain.update(k2, v2), buffered.update(k2, v2)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)


def test_reset_and_offload_let_go_of_the_buffers():
    generator = torch.Generator().manual_seed(2)
    layer = BufferedLayer(block=4)
    (k0, v0), (k1, v1) = _steps([2, 1], generator)
    layer.update(k0, v0)
    layer.reset()
    assert layer._keys_buffer is None and layer.get_seq_length() == 0
    layer.update(k0, v0)
    layer.offload()
    assert layer._keys_buffer is None and layer.get_seq_length() == 2
    keys, _ = layer.update(k1, v1)
    torch.testing.assert_close(keys, torch.cat([k0, k1], dim=-2), rtol=0, atol=0)


def test_a_block_is_at_most_the_growth_block():
    cache = DynamicCache()
    cache.layers.append(DynamicLayer())
    assert buffer_cache(cache, new_tokens=10_000).layers[0].block == 256


def test_buffer_cache_keeps_what_a_prefilled_cache_holds(task):
    model = AutoModelForCausalLM.from_pretrained(task.model).eval()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        cache = getattr(model(input_ids=ids[:, :3], use_cache=True), CACHE)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        assert buffer_cache(cache, new_tokens=10) is cache
        assert all(type(layer) is BufferedLayer for layer in cache.layers)
        assert cache.get_seq_length() == 3
        step = model(input_ids=ids[:, 3:], use_cache=True, **{CACHE: cache}).logits
        full = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(step[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)
    for layer, (keys, values) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.keys[:, :, :3], keys) and torch.equal(layer.values[:, :, :3], values)
    assert isinstance(cache, DynamicCache)


def test_generation_decodes_into_one_buffer_per_layer(task):
    """With a shared prompt cache, every decoding step writes into the same buffers (no copies of the
    cache), and the tokens are those of transformers' own cache (the prefix-sharing tests)."""
    model = AutoModelForCausalLM.from_pretrained(task.model)
    tokenizer = prepare_tokenizer(load_tokenizer(task.model))
    texts = [t for t in render_prompts([task.train_dataset[i]["prompt"] for i in range(2)], tokenizer)
             for _ in range(4)]
    seen = []

    def record(module, args, kwargs):
        cache = kwargs.get(CACHE)
        if cache is not None:  # the pre-fill of the distinct prompts starts without one
            layer = cache.layers[0]
            buffer = getattr(layer, "_keys_buffer", None)  # allocated by the first update
            seen.append((type(layer), None if buffer is None else buffer.data_ptr()))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        torch.manual_seed(0)
        generate(model, tokenizer, texts,
                 sampling_config(tokenizer, max_new_tokens=6, generation_kwargs={"min_new_tokens": 6}),
                 PrefixSharing())
    finally:
        handle.remove()
    assert len(seen) == 6, "generate()'s 6 calls, each with the shared prompt cache"
    assert all(kind is BufferedLayer for kind, _ in seen)
    pointers = {pointer for _, pointer in seen[1:]}
    assert len(pointers) == 1 and None not in pointers
