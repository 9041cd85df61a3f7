"""examples/gsm8k: its recipe, dataset mapping and rewards, through grpo_lab.cli.recipes.build_trainer as
`grpo-lab train` runs them, on the shipped tiny model and the local stand-in data set (no hub)."""

import json
import math
from pathlib import Path

import pytest
import yaml

from grpo_lab.cli.recipes import build_trainer

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gsm8k"


def _recipe(tmp_path, **changes) -> Path:
    """The example recipe with ``changes`` (None removes a key), written beside the test's files."""
    recipe = yaml.safe_load((EXAMPLE / "recipe.yaml").read_text())
    for key, value in changes.items():
        if value is None:
            recipe.pop(key, None)
        else:
            recipe[key] = value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_the_mapping_turns_gsm8k_rows_into_prompts_and_solutions(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from gsm8k_data import SYSTEM_PROMPT, final_answer, to_grpo_row

    rows = [json.loads(line) for line in (EXAMPLE / "sample.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and all(set(row) == {"question", "answer"} for row in rows)
    mapped = [to_grpo_row(row) for row in rows]
    assert mapped[0] == {"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                    {"role": "user", "content": rows[0]["question"]}], "solution": "27"}
    assert [m["solution"] for m in mapped if m["solution"] == "5000"] == ["5000"]  # "#### 5,000"
    assert all(m["solution"].isdigit() for m in mapped)
    with pytest.raises(ValueError, match="no '####'"):
        final_answer("42")


def test_the_rewards_score_a_right_and_a_wrong_answer(monkeypatch):
    from grpo_lab.rewards.format_rewards import think_format_reward
    from grpo_lab.rewards.math_rewards import accuracy_reward

    completions = [[{"role": "assistant", "content": "<think>3 * 12 = 36, 36 - 9 = 27</think> \\boxed{27}"}],
                   [{"role": "assistant", "content": "The answer is \\boxed{26}."}]]
    assert accuracy_reward(completions, solution=["27", "27"]) == [1.0, 0.0]
    assert think_format_reward(completions) == [1.0, 0.0]


def test_the_recipe_trains_the_shipped_model_on_the_stand_in_data(tmp_path, monkeypatch, task):
    monkeypatch.chdir(EXAMPLE)  # as `grpo-lab train recipe.yaml` run from examples/gsm8k: the mapping imports
    recipe = _recipe(
        tmp_path, model=task.model,
        train_dataset={"path": "sample.jsonl", "map": "gsm8k_data:to_grpo_row"},
        # The shipped model's context is 128 positions and its tokenizer writes a word in several tokens:
        # the system prompt and a question take 150-250 of them. RoPE lets the same weights run at longer
        # positions (untrained there), which is all a test of the pipeline needs.
        model_init_kwargs={"max_position_embeddings": 1024},
    )
    overrides = ["--use_vllm", "false", "--max_steps", "2", "--num_generations", "4",
                 "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
                 "--max_completion_length", "16", "--gradient_checkpointing", "false", "--learning_rate", "1e-3",
                 "--log_completions", "false", "--save_strategy", "no", "--output_dir", str(tmp_path / "out")]
    trainer = build_trainer(recipe, overrides)
    try:
        session = trainer.session
        assert session.engine.is_peft  # the recipe's LoRA adapter, on the shipped Llama
        dataset = session.engine.train_dataset
        assert len(dataset) == 30 and sorted(dataset.column_names) == ["prompt", "solution"]
        rendered = session.tokenizer.apply_chat_template(dataset[0]["prompt"], tokenize=False,
                                                         add_generation_prompt=True)
        assert rendered.startswith("<|im_start|>system\nSolve the math problem.")  # its template keeps the system turn
        trainer.train()
        rows = session.history.to_dict("records")
    finally:
        trainer.close()
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        for name in ("rewards/accuracy_reward/mean", "rewards/think_format_reward/mean", "reward", "loss",
                     "math_verify/parse_failures"):
            assert math.isfinite(row[name]), (name, row[name])


def test_a_bad_dataset_or_peft_spec_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(EXAMPLE)
    cases = [
        ({"path": "sample.jsonl", "mapping": "gsm8k_data:to_grpo_row"},
         "unknown key.*'mapping'.*path, name, split, map"),
        ({"map": "gsm8k_data:to_grpo_row"}, "no 'path'"),
        ({"path": "sample.jsonl", "split": "test"}, "local file, read as one split"),
        ({"path": "sample.jsonl"}, "columns are question, answer, without 'prompt'.*map: module:function"),
        ({"path": "sample.jsonl", "map": "gsm8k_data:no_such_function"}, "has no attribute 'no_such_function'"),
        (["sample.jsonl"], "must be 'default_task'"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=message):
            build_trainer(_recipe(tmp_path, train_dataset=spec), ["--output_dir", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="peft: .*rank.*LoraConfig's fields"):
        build_trainer(_recipe(tmp_path, train_dataset={"path": "sample.jsonl", "map": "gsm8k_data:to_grpo_row"},
                              peft={"rank": 8}), ["--output_dir", str(tmp_path / "out")])


def _saved(tmp_path):
    """A single Dataset and a DatasetDict saved with save_to_disk beside the recipe, rows already mapped."""
    from datasets import Dataset, DatasetDict

    def rows(label):
        return Dataset.from_list([{"prompt": [{"role": "user", "content": f"{label} {i}"}], "solution": str(i)}
                                  for i in range(3)])

    rows("single").save_to_disk(str(tmp_path / "single"))
    DatasetDict({"train": rows("train"), "test": rows("test")}).save_to_disk(str(tmp_path / "splits"))


def test_name_and_split_are_refused_where_they_do_not_apply(tmp_path, monkeypatch):
    monkeypatch.chdir(EXAMPLE)
    _saved(tmp_path)
    cases = [
        ({"path": "single", "split": "test"}, r".*single holds a single Dataset, with no splits: remove 'split'"),
        ({"path": "single", "name": "main"}, r"'name' \(a Hub dataset's configuration\) does not apply to .*single, "
                                             r"a folder written by save_to_disk: remove 'name'"),
        ({"path": "splits", "name": "main", "split": "test"}, r"'name' .* does not apply to .*splits"),
        ({"path": "splits", "split": "validation"}, r"split 'validation' is not in .*splits, which holds the splits "
                                                    r"train, test: give one of them as 'split'"),
        ({"path": "sample.jsonl", "map": "gsm8k_data:to_grpo_row", "split": 3}, r"split must be a string, got 3"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=f"train_dataset: {message}"):
            build_trainer(_recipe(tmp_path, train_dataset=spec), ["--output_dir", str(tmp_path / "out")])


def test_an_eval_dataset_mapping_must_name_its_split(tmp_path, monkeypatch):
    from grpo_lab.cli.recipes import _dataset

    monkeypatch.chdir(EXAMPLE)
    _saved(tmp_path)
    train = {"path": "sample.jsonl", "map": "gsm8k_data:to_grpo_row"}
    cases = [  # without a split each would load the train split: evaluating on the training data
        ({"path": "openai/gsm8k", "name": "main", "map": "gsm8k_data:to_grpo_row"},
         r"eval_dataset: a Hub dataset needs 'split' here \(e.g. split: test\): without it the train split of "
         r"'openai/gsm8k' would be loaded, evaluating on the training data"),
        ({"path": "splits"}, r"eval_dataset: .*splits holds the splits train, test: give 'split' \(e.g. split: test\)"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=message):
            build_trainer(_recipe(tmp_path, train_dataset=train, eval_dataset=spec),
                          ["--output_dir", str(tmp_path / "out")])
    search = (tmp_path, EXAMPLE)
    chosen = _dataset({"path": "splits", "split": "test"}, None, "eval", "recipe.yaml", search)
    assert chosen["prompt"][0][0]["content"] == "test 0"
    assert _dataset({"path": "splits"}, None, "train", "recipe.yaml", search)["prompt"][0][0]["content"] == "train 0"
    assert _dataset({"path": "single"}, None, "eval", "recipe.yaml", search)["prompt"][0][0]["content"] == "single 0"
