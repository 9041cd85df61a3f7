"""TRL scripts run by changing the import: the scripts in ``examples/trl_scripts`` run as written
with grpo_lab and, with the import switched back, with TRL 1.16; their ``trainer.state.log_history``
rows have TRL's keys. And GRPOTrainer trains small random models of the architectures TRL's own
tests use."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from grpo_lab import GRPOTrainer
from tests.conftest import SMALL

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "examples" / "trl_scripts"
IMPORT = "from grpo_lab import GRPOConfig, GRPOTrainer"
GRPO_LAB_ONLY = {"backward_skipped_fraction", "update_skipped"}


def _run(script: Path, out: Path, *arguments: str, trl: bool = False) -> list[dict]:
    """Run ``script`` (as written, or with TRL's import) and return its saved ``log_history``."""
    if trl:
        text = script.read_text()
        assert text.count(IMPORT) == 1
        script = out.with_name(f"{out.name}_script.py")
        script.write_text(text.replace(IMPORT, "from trl import GRPOConfig, GRPOTrainer"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    done = subprocess.run([sys.executable, str(script), "--output_dir", str(out), *arguments], capture_output=True,
                          text=True, env=env, timeout=600, cwd=out.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def _compare_keys(ours: list[dict], theirs: list[dict]) -> None:
    assert [row["step"] for row in ours] == [row["step"] for row in theirs]
    for mine, trl_row in zip(ours, theirs):
        assert set(mine) - GRPO_LAB_ONLY == set(trl_row), mine["step"]


def test_the_prompts_script_with_two_rewards_and_evaluation(task, tmp_path):
    script = SCRIPTS / "prompts_two_rewards_eval.py"
    ours = _run(script, tmp_path / "ours", "--model", task.model)
    theirs = _run(script, tmp_path / "trl", "--model", task.model, trl=True)
    _compare_keys(ours, theirs)
    assert sum("eval_reward" in row for row in ours) == 2 and "train_loss" in ours[-1]
    results = json.loads((tmp_path / "ours" / "all_results.json").read_text())
    assert results["train_loss"] == ours[-1]["train_loss"]


@pytest.fixture(scope="module")
def reward_model(task, tmp_path_factory):
    """A small random sequence-classification model with the shipped tokenizer, one label."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(task.model)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    directory = tmp_path_factory.mktemp("reward_model")
    Qwen2ForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def test_the_conversational_lora_script_with_a_reward_model(task, tmp_path, reward_model):
    script = SCRIPTS / "conversational_lora_reward_model.py"
    arguments = ("--model", task.model, "--reward_model", reward_model)
    ours = _run(script, tmp_path / "ours", *arguments)
    theirs = _run(script, tmp_path / "trl", *arguments, trl=True)
    _compare_keys(ours, theirs)
    assert any(key.startswith("rewards/") and "reward_model" not in key for key in ours[0])
    assert "kl" in ours[0]
    assert (tmp_path / "ours" / "adapter_config.json").exists()


def _letter_share(completions, **kwargs):
    """Share of ASCII letters: random weights earn different amounts of it, so groups differ."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(ch.isascii() and ch.isalpha() for ch in text) / max(len(text), 1) for text in texts]


MOE = dict(num_experts_per_tok=2)
ARCHITECTURES = {
    "Qwen2Config": {},
    "Qwen3Config": {},
    "LlamaConfig": {},
    "Qwen3MoeConfig": dict(MOE, num_experts=4, moe_intermediate_size=32, decoder_sparse_step=1),
    "Gemma2Config": dict(sliding_window=64, query_pre_attn_scalar=16),
    "Cohere2Config": dict(sliding_window=64),
    "Glm4MoeConfig": dict(MOE, n_routed_experts=4, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                          topk_group=1, n_shared_experts=1),
    "GptOssConfig": dict(MOE, num_local_experts=4, sliding_window=64),
    "NemotronHConfig": dict(hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
                            n_groups=1, mamba_d_conv=4, mamba_expand=1, chunk_size=16),
}
"""Two-layer random models of the architectures TRL's GRPO tests train (a Mamba layer and an
attention layer for Nemotron-H)."""


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_small_random_models_of_trls_test_architectures_train(task, tmp_path, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(task.model)
    config = getattr(transformers, name)(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **ARCHITECTURES[name])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    args = task.config(**{**SMALL, "output_dir": str(tmp_path / "out"), "max_steps": 2, "logging_steps": 1,
                          "disable_tqdm": True, "save_strategy": "no"})
    trainer = GRPOTrainer(str(tmp_path / "model"), [_letter_share], args=args, train_dataset=task.train_dataset)
    out = trainer.train()
    assert out.global_step == 2 and math.isfinite(out.training_loss)
    for row in trainer.state.log_history[:2]:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
        if row["frac_reward_zero_std"] < 1:  # some group's completions differ in reward: there is a gradient
            assert row["grad_norm"] > 0
