"""The rebuild script, shortened to a few steps so that it cannot rot, and the shipped model."""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lab.tasks import TINY_MODEL_DIR, build_model


def _build(tmp_path, name):
    out = tmp_path / name
    report = build_model.main(["--out", str(out), "--steps", "3", "--batch-size", "8", "--eval-size", "0"])
    return out, report


def test_short_rebuild_writes_a_loadable_deterministic_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    first, report = _build(tmp_path, "a")
    second, _ = _build(tmp_path, "b")
    assert report["parameters"] < 5_000_000
    for name in ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"]:
        assert (first / name).exists(), name
    model_a = AutoModelForCausalLM.from_pretrained(first)
    model_b = AutoModelForCausalLM.from_pretrained(second)
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_tokenizer_keeps_digits_and_answer_tags_whole():
    tokenizer = build_model.build_tokenizer()
    tokens = tokenizer.tokenize("<answer>129</answer>")
    assert tokens == ["<answer>", "1", "2", "9", "</answer>"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer("<answer>7</answer>")["input_ids"]) == "<answer>7</answer>"


def test_shipped_model_is_small_offline_loadable_and_vllm_compatible(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    size = sum(f.stat().st_size for f in TINY_MODEL_DIR.iterdir())
    assert size < 10 * 2**20
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["head_dim"] in {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    assert tokenizer.pad_token is not None and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.padding_side == "left"
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
