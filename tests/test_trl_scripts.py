"""TRL scripts run by changing the import: the scripts in ``examples/trl_scripts`` run as written
with grpo_lab and, with the import switched back, with TRL 1.16; their ``trainer.state.log_history``
rows have TRL's keys. TRL's own GRPO script (``trl/scripts/grpo.py`` of the installed TRL, copied at
test time) runs with its import changed, and so does a ``TrlParser`` launch script with a YAML config.
And GRPOTrainer trains small random models of the architectures TRL's own
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


def _launch(script: Path, cwd: Path, *arguments: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    return subprocess.run([sys.executable, str(script), *arguments], capture_output=True, text=True, env=env,
                          timeout=600, cwd=cwd)


def test_the_trl_parser_launch_script_trains_from_its_yaml_config_and_lists_the_fields_in_help(task, tmp_path):
    from grpo_lab import GRPOConfig

    shown = _launch(SCRIPTS / "grpo.py", tmp_path, "--help")
    assert shown.returncode == 0, shown.stderr[-3000:]
    text = " ".join(shown.stdout.split())
    for name in ("beta", "loss_type", "share_prompt_prefix", "model_name_or_path", "reward_funcs"):
        assert f"--{name}" in text
    assert " ".join(GRPOConfig.field_help("loss_type").split()[:12]) in text
    done = _launch(SCRIPTS / "grpo.py", tmp_path, "--config", str(SCRIPTS / "grpo.yaml"),
                   "--model_name_or_path", task.model, "--output_dir", str(tmp_path / "out"), "--num_generations", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]  # max_steps from the YAML file
    assert "rewards/format_reward/mean" in rows[0]  # its reward_funcs
    saved = GRPOConfig.from_yaml(tmp_path / "out" / "checkpoint-2" / "config.yaml")
    assert (saved.num_generations, saved.learning_rate) == (2, 1e-4)  # the command line over the file
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_trls_own_grpo_script_runs_with_the_import_changed(task, tmp_path):
    """TRL 1.16's ``trl/scripts/grpo.py`` (``trl grpo``), copied from the installed package with its
    two imports of GRPOConfig and GRPOTrainer taken from grpo_lab, on a local copy of the task's data."""
    import trl.scripts.grpo

    text = Path(trl.scripts.grpo.__file__).read_text()
    changes = {
        "    from trl import GRPOTrainer, get_dataset,":
            "    from grpo_lab import GRPOTrainer\n    from trl import get_dataset,",
        "    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser":
            "    from grpo_lab import GRPOConfig\n    from trl import DatasetMixtureConfig, ModelConfig, TrlParser",
    }
    for old, new in changes.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    script = tmp_path / "trl_grpo.py"
    script.write_text(text)
    data = tmp_path / "data"
    task.train_dataset.select(range(16)).to_json(data / "train.jsonl")
    task.eval_dataset.select(range(4)).to_json(data / "test.jsonl")
    done = _launch(script, tmp_path, "--model_name_or_path", task.model, "--dataset_name", str(data),
                   "--reward_funcs", "grpo_lab.tasks.addition.correctness_reward",
                   "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--per_device_train_batch_size", "8",
                   "--num_generations", "4",
                   "--max_completion_length", "8", "--gradient_checkpointing", "false", "--report_to", "none")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Training completed" in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2] and "rewards/correctness_reward/mean" in rows[0]
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_the_vlm_lora_script_runs_with_the_import_changed(tmp_path):
    """TRL's grpo_vlm.py manner (an image column, the processor, LoRA) on a tiny random LLaVA saved with
    its processor: grpo_lab and TRL 1.16 log the same keys, and grpo_lab saves the adapter and the
    processor (Gemma 3 takes the same paths in tests/test_vlm.py)."""
    from grpo_lab.tasks.tiny_vlm import tiny_vlm

    model, processor = tiny_vlm("llava")
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    script = SCRIPTS / "vlm_lora.py"
    ours = _run(script, tmp_path / "ours", "--model", str(tmp_path / "vlm"))
    theirs = _run(script, tmp_path / "trl", "--model", str(tmp_path / "vlm"), trl=True)
    _compare_keys(ours, theirs)
    assert all(math.isfinite(row["loss"]) for row in ours if "loss" in row)
    assert (tmp_path / "ours" / "adapter_config.json").exists()
    assert (tmp_path / "ours" / "processor_config.json").exists()
