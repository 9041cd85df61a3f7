"""Bad input raises at once, names the problem and the fix, and leaves the session usable."""

import functools
import inspect
import math
import warnings
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from grpo_lab import GRPOSession
from grpo_lab.rewards import RewardFunctionError
from tests.conftest import SMALL


def _steps_fine(session):
    session.step()
    assert session.global_step >= 1


def test_dataset_without_prompt_column(task, tmp_path):
    bad = task.train_dataset.rename_column("prompt", "question")
    with pytest.raises(ValueError, match=r"no 'prompt' column.*rename_column"):
        GRPOSession(task.model, task.reward_funcs, args=task.config(**SMALL), train_dataset=bad)


def test_an_offloaded_cache_on_a_cpu_is_refused_with_the_fix(make_session):
    with pytest.raises(ValueError, match="moves a GPU's key/value cache.*generates on a CPU.*"
                                         "cache_implementation=None"):
        make_session(cache_implementation="offloaded")
    session = make_session()
    session.config.cache_implementation = "offloaded_static"  # between steps: refused before generation runs
    with pytest.raises(ValueError, match="'offloaded_static' moves a GPU's key/value cache"):
        session.generate()
    session.config.cache_implementation = None
    _steps_fine(session)


def test_empty_dataset(task):
    empty = task.train_dataset.select([])
    with pytest.raises(ValueError, match="train_dataset is empty.*split, filter or select"):
        GRPOSession(task.model, task.reward_funcs, args=task.config(**SMALL), train_dataset=empty)


def test_a_dataset_dict_is_refused_with_the_split_to_pick(task):
    from datasets import DatasetDict

    splits = DatasetDict({"train": task.train_dataset, "test": task.train_dataset.select(range(4))})
    with pytest.raises(TypeError, match=r"train_dataset is a DatasetDict of splits \('train', 'test'\).*"
                                        r"train_dataset=dataset\['train'\]"):
        GRPOSession(task.model, task.reward_funcs, args=task.config(**SMALL), train_dataset=splits)


def test_model_path_that_does_not_exist_or_is_a_file(task):
    with pytest.raises(FileNotFoundError, match="does not exist as a local path"):
        GRPOSession("./no/such/model", task.reward_funcs, args=task.config(**SMALL), train_dataset=task.train_dataset)
    weights = Path(task.model) / "model.safetensors"
    with pytest.raises(FileNotFoundError, match=rf"model.safetensors is a file; a model is the directory "
                                                rf"save_pretrained writes.*Give the folder that holds it "
                                                rf"\({Path(task.model)}, if"):
        GRPOSession(str(weights), task.reward_funcs, args=task.config(**SMALL), train_dataset=task.train_dataset)


def test_a_save_is_a_model_folder_an_older_one_given_as_model_and_a_missing_one_are_explained(make_session, tmp_path,
                                                                                             monkeypatch):
    import shutil

    first = make_session()
    first.step()
    saved = first.save(tmp_path / "saved")
    fresh = make_session(model=str(saved))  # a new run from the saved weights, as from TRL's checkpoint-N
    assert fresh.global_step == 0
    for name, value in first.model.state_dict().items():
        torch.testing.assert_close(fresh.model.state_dict()[name], value, rtol=0, atol=0, msg=name)
    older = tmp_path / "older"  # the layout of format version 1: the model in model/
    (older / "model").mkdir(parents=True)
    for file in ("config.json", "model.safetensors"):
        shutil.copy(saved / file, older / "model" / file)
    with pytest.raises(FileNotFoundError, match=r"is a grpo_lab checkpoint or saved session.*"
                                                r"its model is in .*older/model"):
        make_session(model=str(older))
    monkeypatch.chdir(saved)  # the save as the working directory
    assert GRPOSession.load(".").global_step == 1
    monkeypatch.chdir(older / "model")
    with pytest.raises(FileNotFoundError, match=r"is not a complete grpo_lab checkpoint"):
        GRPOSession.load(".")
    with pytest.raises(FileNotFoundError, match=r"no_such_run does not exist\. "
                                                r"Give a directory written by session.save"):
        GRPOSession.load(tmp_path / "no_such_run")


def test_wrong_argument_types_name_the_type_to_give(task):
    with pytest.raises(TypeError, match=r"train_dataset must be a datasets.Dataset \(got list\).*Dataset.from_list"):
        GRPOSession(task.model, task.reward_funcs, args=task.config(**SMALL), train_dataset=[{"prompt": "1+1="}])
    with pytest.raises(TypeError, match=r"args must be a grpo_lab GRPOConfig \(got dict\).*GRPOConfig\(\*\*settings\)"):
        GRPOSession(task.model, task.reward_funcs, args={"learning_rate": 1e-4}, train_dataset=task.train_dataset)


def short(completions):
    return [0.0] * len(completions)


def needs_label(completions, label, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.parametrize(
    ("func", "message"),
    [
        (short, r"'short' does not accept prompts, completion_ids, trainer_state, log_extra, log_metric, answer\. "
                r".*\*\*kwargs"),
        (needs_label, r"'needs_label' requires label, which no call passes"),
    ],
)
def test_a_reward_function_that_cannot_take_the_call_is_refused_before_generation(make_session, func, message):
    with pytest.raises(TypeError, match=message):
        make_session(reward_funcs=[func])
    session = make_session()
    with pytest.raises(TypeError, match=message):
        session.reward_funcs = [func]
    assert session.engine.reward_names == ["correctness_reward", "format_reward"]  # unchanged


def _taking_only_its_own_arguments(func):
    """A decorator whose wrapper takes any keywords and passes on those ``func`` names."""

    @functools.wraps(func)
    def wrapper(**kwargs):
        return func(**{k: v for k, v in kwargs.items() if k in inspect.signature(func).parameters})

    return wrapper


@_taking_only_its_own_arguments
def answer_length(completions, answer):
    return [float(len(a)) for a in answer]


def exact(completions, prompts, completion_ids, trainer_state, log_extra, log_metric, answer):
    return [0.0] * len(completions)


def test_the_check_reads_a_decorated_functions_wrapper_and_evaluation_checks_its_own_columns(make_session, task):
    session = make_session(reward_funcs=[answer_length, exact])  # the wrapper takes **kwargs, so the call fits
    session.step()
    assert session.history["rewards/answer_length/mean"].iloc[0] > 0
    labelled = task.eval_dataset.add_column("label", [0] * len(task.eval_dataset))
    with pytest.raises(TypeError, match=r"'exact' does not accept label\."):
        session.evaluate(labelled)  # refused before generating: the evaluation rows carry a column 'exact' cannot take


def test_a_reward_model_string_that_cannot_be_loaded_says_strings_are_models(make_session, tmp_path):
    with pytest.raises(ValueError, match=r"is a string, which is loaded as a reward model.*Pass the function itself"):
        make_session(reward_funcs=[str(tmp_path / "not_a_model")])


def test_raising_reward_function_names_itself_and_the_sample(make_session, task):
    def fragile(completions, answer, **kwargs):
        return [1.0 / (len(str(c)) - len(str(c))) if "1" in a else 0.0 for c, a in zip(completions, answer)]

    session = make_session(reward_funcs=[fragile])
    rollout = session.generate()
    with pytest.raises(RewardFunctionError, match=r"'fragile' raised ZeroDivisionError.*sample \d+: prompt=.*"
                                                  r"call session.score\(\)"):
        session.score()
    assert session.rollout is rollout and session.next_stage == "score"  # completions kept
    session.reward_funcs = task.reward_funcs
    session.score()
    _steps_fine(session)


@pytest.mark.parametrize(
    "returned, message",
    [
        (lambda n: [0.0] * (n - 1), r"returned 7 values for 8 completions"),
        (lambda n: ["high"] * n, r"returned 'high' \(str\)"),
        (lambda n: [math.nan] * n, r"returned nan .*finite; return None"),
        (lambda n: [math.inf] * n, r"returned inf"),
        (lambda n: 1.0, r"returned float; it must return a list"),
    ],
    ids=["length", "non-number", "nan", "inf", "scalar"],
)
def test_unusable_reward_values(make_session, task, returned, message):
    def broken(completions, **kwargs):
        return returned(len(completions))

    session = make_session(reward_funcs=[task.reward_funcs[0], broken])
    session.generate()
    with pytest.raises(RewardFunctionError, match=message):
        session.score()
    session.reward_funcs = task.reward_funcs
    _steps_fine(session)


def test_all_none_rewards_are_logged_with_trls_words_and_are_excluded(make_session, caplog):
    def picky(completions, **kwargs):
        return [None] + [1.0] * (len(completions) - 1)

    session = make_session(reward_funcs=[picky])
    session.generate()
    with caplog.at_level("WARNING", logger="grpo_lab"):
        scores = session.score()
    (record,) = [r for r in caplog.records if r.name == "grpo_lab"]
    # TRL's words, which TRL's own test looks for, then how many and which
    assert record.getMessage().startswith("All reward functions returned None for the following kwargs: sample 0")
    assert "(1 completion(s) of this batch)" in record.getMessage()
    assert math.isnan(scores.rewards_BF[0, 0]) and scores.rewards_BF[1:, 0].eq(1.0).all()
    _steps_fine(session)


def test_tokenizer_without_pad_token_or_with_right_padding(task, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(task.model)
    tokenizer.pad_token = None
    tokenizer.padding_side = "right"
    with pytest.warns(UserWarning, match="no pad token; using its EOS token"):
        session = GRPOSession(task.model, task.reward_funcs, args=task.config(**SMALL, output_dir=str(tmp_path)),
                              train_dataset=task.train_dataset, processing_class=tokenizer)
    assert session.tokenizer.pad_token == session.tokenizer.eos_token
    assert session.tokenizer.padding_side == "left"
    _steps_fine(session)


def test_prompts_longer_than_the_context(make_session, task):
    long = Dataset.from_dict({"prompt": ["1+" * 80 + "1="] * 8 + ["1+1="] * 8, "answer": ["81"] * 8 + ["2"] * 8})
    with pytest.raises(ValueError, match=r"train_dataset row 0: the prompt is 162 tokens long \(rendered\), "
                                         r"longer than the model's context of 128 positions\. "
                                         r"7 more rows cannot be used either \(1, 2, 3, 4, 5, \.\.\.\)"
                                         r".*filter\(lambda row, index: index not in \{0, 1, 2, 3, 4, 5, 6, 7\}"):
        make_session(train_dataset=long, shuffle_dataset=False)  # refused when built, before any step
    _steps_fine(make_session(train_dataset=long.select(range(8, 16))))


def test_non_finite_loss_skips_the_update_and_keeps_weights(make_session):
    session = make_session(max_steps=10, lr_scheduler_type="linear", learning_rate=1e-3)
    session.generate(), session.score(), session.advantages(), session.loss()
    for p in session.engine.model.parameters():
        p.grad = torch.full_like(p, math.nan)
    before = [p.detach().clone() for p in session.engine.model.parameters()]
    with pytest.warns(UserWarning, match="gradient is not finite.*update was skipped"):
        row = session.update()
    assert row["update_skipped"] == 1.0
    for p, old in zip(session.engine.model.parameters(), before):
        assert torch.equal(p, old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _steps_fine(session)
    # The schedule took one step (the skipped update took none); a rebuilt schedule goes as far.
    session.config.max_steps = 20
    session.step()
    assert session.history["learning_rate"].tolist() == pytest.approx([1e-3, 1e-3, 1e-3 * 19 / 20])


def test_a_second_session_with_another_precision_in_the_same_process(make_session):
    make_session().step()
    other = make_session(bf16=True)
    assert other.engine.accelerator.mixed_precision == "bf16"
    assert other.step()["step"] == 1


def test_the_optimizer_cannot_be_switched_between_steps(make_session):
    session = make_session()
    session.config.optim = "adamw_torch"
    with pytest.raises(ValueError, match="optim cannot change after the session is built"):
        session.generate()
    assert session.config.optim == "adamw_torch_fused" and session.config_changes == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_generations", 2), ("gradient_checkpointing", True), ("bf16", True), ("seed", 7), ("num_iterations", 2),
     ("model_init_kwargs", {"dtype": "bfloat16"}), ("keep_freed_cpu_memory", False)],
)
def test_fields_read_when_the_session_is_built_refuse_edits_and_undo_them(make_session, field, value):
    session = make_session()
    session.step()
    before = getattr(session.config, field)
    setattr(session.config, field, value)
    with pytest.raises(ValueError, match=f"{field} cannot change after the session is built.*edit was undone"):
        session.generate()
    assert getattr(session.config, field) == before and session.config_changes == []
    session.step()  # the session goes on with the value it was built with


def test_an_invalid_value_of_a_build_time_field_says_it_cannot_change_and_is_undone(make_session):
    # 10 is also invalid (not a multiple of num_generations, 4): the validation error used to win and
    # leave the value in place
    session = make_session()
    session.step()
    before = session.config.per_device_train_batch_size
    session.config.per_device_train_batch_size = 10
    with pytest.raises(ValueError, match="per_device_train_batch_size cannot change after the session is built"):
        session.generate()
    assert session.config.per_device_train_batch_size == before
    session.step()


def test_config_changes_keep_only_the_values_stages_ran_with(make_session):
    session = make_session(max_steps=4)
    session.step()
    session.config.max_completion_length = 500  # longer than the model's context: generate() refuses it
    with pytest.raises(ValueError, match="max_completion_length=500 exceed"):
        session.generate()
    session.config.max_completion_length = 6  # the fix replaces the edit no stage used
    session.config.temperature = 0.9
    session.generate()
    session.config.temperature = 0.8  # generate() sampled at 0.9: both are recorded
    session.step()
    assert session.config_changes == [
        {"step": 2, "field": "max_completion_length", "old": 8, "new": 6},
        {"step": 2, "field": "temperature", "old": 1.0, "new": 0.9},
        {"step": 2, "field": "temperature", "old": 0.9, "new": 0.8},
    ]


def test_beta_cannot_be_switched_on_without_a_reference_model(make_session):
    session = make_session()
    session.config.beta = 0.04
    with pytest.raises(ValueError, match="beta > 0 needs a reference model.*edit was undone"):
        session.generate()
    assert session.config.beta == 0.0
    session.step()
    with_reference = make_session(beta=0.04)
    with_reference.config.beta = 0.1  # a reference exists: the weight may change
    with_reference.step()
    assert with_reference.config_changes[0]["field"] == "beta"



def test_beta_switched_back_on_in_the_middle_of_a_batch_scores_it_against_the_reference(make_session):
    session = make_session(beta=0.04)
    session.step()  # the policy moves away from the reference
    session.config.beta = 0.0
    session.generate()  # sampled without reference log-probs
    session.score()
    session.advantages()
    session.config.beta = 0.04
    session.loss()
    assert session.rollout.ref_logprobs_BT is not None
    assert session.loss_result.metrics["kl"] > 0
    session.update()


def test_beta_switched_on_for_an_adapter_scores_against_the_base_model(task, tmp_path):
    from peft import LoraConfig

    config = task.config(**{**SMALL, "output_dir": str(tmp_path), "learning_rate": 5e-2})
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          peft_config=lora)
    session.step()  # built with beta=0: the adapter moves, and no reference copy exists
    session.config.beta = 0.04  # the base model (adapter disabled) is the reference
    session.step()
    assert session.history["kl"].iloc[-1] > 0
    assert session.config_changes[0]["field"] == "beta"


def test_schedule_fields_rebuild_the_schedule_at_the_current_step(make_session):
    session = make_session(max_steps=10, lr_scheduler_type="linear", learning_rate=1e-3)
    session.run(3, progress=False)
    assert session.history["learning_rate"].tolist() == pytest.approx([1e-3, 9e-4, 8e-4])  # lr0 (10 - n) / 10
    session.config.max_steps = 20
    session.step()
    assert session.history["learning_rate"].iloc[-1] == pytest.approx(1e-3 * 17 / 20)
    session.config.lr_scheduler_type = "constant"
    session.config.learning_rate = 5e-4
    session.step()
    assert session.history["learning_rate"].iloc[-1] == pytest.approx(5e-4)
    assert [(c["step"], c["field"]) for c in session.config_changes] == [
        (4, "max_steps"), (5, "learning_rate"), (5, "lr_scheduler_type")]


def test_a_learning_rate_set_from_zero_takes_the_schedules_current_factor(make_session):
    session = make_session(max_steps=10, lr_scheduler_type="linear", learning_rate=0.0)
    session.run(3, progress=False)
    session.config.learning_rate = 1e-3
    session.step()  # the fourth step of a linear decay over ten: 1e-3 * (10 - 3) / 10
    assert session.history["learning_rate"].tolist() == pytest.approx([0, 0, 0, 7e-4])


def test_a_schedule_rebuilt_over_a_users_optimizer_keeps_each_groups_rate(task, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(task.model)
    embeddings = list(model.get_input_embeddings().parameters())
    rest = [p for p in model.parameters() if all(p is not e for e in embeddings)]
    optimizer = torch.optim.AdamW([{"params": rest, "lr": 1e-3}, {"params": embeddings, "lr": 1e-4}])
    config = task.config(**{**SMALL, "output_dir": str(tmp_path), "max_steps": 10, "lr_scheduler_type": "linear"})
    session = GRPOSession(model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          optimizers=(optimizer, None))
    session.run(2, progress=False)
    session.config.max_steps = 20
    session.step()  # after three steps the factor is (20 - 3) / 20 of each group's own rate
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-3 * 17 / 20, 1e-4 * 17 / 20])
    session.config.learning_rate = 2e-3  # from the config's 1e-3: both groups' rates double
    session.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([2e-3 * 16 / 20, 2e-4 * 16 / 20])
    session.config.lr_scheduler_kwargs = {"no_such_argument": 1}
    with pytest.raises(ValueError, match=r"the 'linear' schedule takes no 'no_such_argument'; it takes no arguments "
                                         r"of its own\. Remove them"):
        session.generate()
    assert session.config.lr_scheduler_kwargs is None or session.config.lr_scheduler_kwargs == {}
    session.step()  # the old schedule stays in force
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([2e-3 * 15 / 20, 2e-4 * 15 / 20])


def test_stepping_past_max_steps_warns_once_that_the_schedule_has_ended(make_session):
    session = make_session(max_steps=2, lr_scheduler_type="linear")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Step .* is past the end")
        session.run(2, progress=False)
    with pytest.warns(UserWarning, match=r"Step 3 is past the end of the run .*2 steps.*rate is now 0.*max_steps"):
        session.step()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Step .* is past the end")
        session.step()  # said once


# ------------------------------------------------------------------ dataset rows, chat content, model files

def _rows(task, count=64):
    """The first ``count`` training rows, as dicts (chat prompts: one user message each)."""
    return task.train_dataset.select(range(count)).to_list()


def _as_text(rows):
    return [dict(row, prompt=row["prompt"][0]["content"]) for row in rows]


def _long_prompt(tokens: int):
    """A chat prompt of ``tokens`` tokens once rendered (the shipped tokenizer spells digits and signs
    one token each; the template adds 8 around one user message)."""
    return [{"role": "user", "content": "1" * (tokens - 8)}]


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (None, r"the prompt is None \(a missing value\)"),
        ("", r"the prompt is an empty string"),
        (_long_prompt(202), r"the prompt is 202 tokens long \(rendered\), "
                            r"longer than the model's context of 128 positions"),
    ],
    ids=["none", "empty", "longer_than_the_context"],
)
def test_a_bad_prompt_row_is_refused_at_build_naming_the_row_and_the_fix(task, make_session, bad, problem):
    rows = _rows(task) if isinstance(bad, list) else _as_text(_rows(task))
    rows[20]["prompt"] = bad
    broken = Dataset.from_list(rows)
    fix = r"train_dataset = train_dataset\.filter\(lambda row, index: index not in \{20\}, with_indices=True\)"
    with pytest.raises(ValueError, match=rf"train_dataset row 20: {problem}\. .*{fix}"):
        make_session(train_dataset=broken)
    _steps_fine(make_session(train_dataset=broken.filter(lambda row, index: index not in {20}, with_indices=True)))


def test_a_prompt_that_no_longer_fits_after_max_completion_length_grew_is_named_and_the_batch_kept(task, make_session):
    rows = _rows(task)
    rows[2]["prompt"] = _long_prompt(110)  # fits with 8 completion tokens, not with 30
    session = make_session(train_dataset=Dataset.from_list(rows), shuffle_dataset=False)
    session.step()  # rows 0 and 1
    session.config.max_completion_length = 30
    drawn = session.engine.sampler.state_dict()
    with pytest.raises(ValueError, match=r"train_dataset row 2: the prompt is 110 tokens long \(rendered\), and with "
                                         r"max_completion_length=30 it exceeds the model's context of 128 positions\. "
                                         r".*Or lower max_completion_length to 18 or less\."):
        session.generate()
    assert session.engine.sampler.state_dict() == drawn and session.global_step == 1
    session.config.max_completion_length = 8
    assert session.generate().prompts[0] == rows[2]["prompt"]  # rows 2 and 3, the batch that was refused
    session.step()
    assert session.global_step == 2


def test_a_dataset_too_large_to_check_at_build_is_checked_as_each_batch_is_drawn(task, make_session, monkeypatch):
    monkeypatch.setattr("grpo_lab.core.build.PROMPT_CHECK_ROWS", 16)  # the shipped task's 64 rows count as large
    rows = _as_text(_rows(task))
    rows[2]["prompt"] = ""
    session = make_session(train_dataset=Dataset.from_list(rows), shuffle_dataset=False)  # not rendered at build
    session.step()  # rows 0 and 1
    drawn = session.engine.sampler.state_dict()
    with pytest.raises(ValueError, match=r"train_dataset row 2: the prompt is an empty string\. .*filter"):
        session.generate()
    assert session.engine.sampler.state_dict() == drawn
    rows[2]["prompt"] = "2+2="  # repaired in place: the same rows, so the run goes on where it stopped
    session.engine.train_dataset = Dataset.from_list(rows)
    assert session.generate().prompts[0] == "2+2="
    session.step()
    assert session.global_step == 2


def test_chat_content_given_as_text_parts_is_rendered_as_its_text(task, make_session):
    from grpo_lab.rollout.prompts import render_prompts

    rows = _rows(task)
    parts = [dict(row, prompt=[{"role": "user", "content": [{"type": "text", "text": row["prompt"][0]["content"]}]}])
             for row in rows]
    session = make_session(train_dataset=Dataset.from_list(parts))
    # the shipped template prints message['content'] as it is: the parts' text, not the list's repr
    assert (render_prompts([parts[0]["prompt"]], session.tokenizer)
            == render_prompts([rows[0]["prompt"]], session.tokenizer))
    two = [{"role": "user", "content": [{"type": "text", "text": "1+1"}, {"type": "text", "text": "="}]}]
    assert (render_prompts([two], session.tokenizer)
            == render_prompts([[{"role": "user", "content": "1+1\n="}]], session.tokenizer))
    rollout = session.generate()
    text = rollout.prompts[0][0]["content"][0]["text"]  # e.g. "40+93="
    assert session.tokenizer.decode(rollout.prompt_ids_BP[0], skip_special_tokens=True) == f"user\n{text}\nassistant\n"
    _steps_fine(session)


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        ({"role": "user", "content": [{"type": "image", "image": "cat.png"}]},
         r"the prompt has a content part of type 'image' in message 0 \(user\): only text parts .*"
         r"Drop the other parts"),
        ({"role": "user", "content": None}, r"the prompt has a user message \(message 0\) with no content \(None\)"),
    ],
    ids=["image_part", "no_content"],
)
def test_chat_content_that_cannot_be_rendered_is_refused_naming_the_row(task, make_session, message, problem):
    rows = [dict(row, prompt=[{"role": "user", "content": [{"type": "text", "text": row["prompt"][0]["content"]}]}])
            for row in _rows(task)]
    rows[20]["prompt"] = [message]
    broken = Dataset.from_list(rows)
    with pytest.raises(ValueError, match=rf"train_dataset row 20: {problem}.*"
                                         rf"filter\(lambda row, index: index not in \{{20\}}"):
        make_session(train_dataset=broken)


@pytest.mark.parametrize("column", ["completions", "trainer_state", "prompts"])
def test_a_column_named_like_a_reward_function_keyword_is_refused_at_build(task, make_session, column):
    clashing = task.train_dataset.select(range(64)).add_column(column, ["x"] * 64)
    with pytest.raises(ValueError, match=rf"train_dataset has a column named '{column}', "
                                         r"a name reward functions already "
                                         rf"receive .*train_dataset\.rename_column\('{column}', '{column}_column'\)"):
        make_session(train_dataset=clashing)
    _steps_fine(make_session(train_dataset=clashing.rename_column(column, f"{column}_column")))


def test_processing_class_given_as_a_path_is_loaded(task, make_session):
    session = make_session(processing_class=task.model)
    assert session.tokenizer.padding_side == "left" and len(session.tokenizer) == 286
    _steps_fine(session)


def test_a_tokenizer_with_more_tokens_than_the_model_has_embeddings_is_refused(task, make_session):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(task.model)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(20)])
    with pytest.raises(ValueError, match=r"The tokenizer has 306 tokens but the model has embeddings for only 286.*"
                                         r"model\.resize_token_embeddings\(len\(tokenizer\)\)"):
        make_session(processing_class=tokenizer)


def test_a_model_directory_without_config_json_is_named(task, make_session, tmp_path):
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(task.model, copy)
    (copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=rf"{copy} holds no config\.json \(it holds .*model\.safetensors.*\), "
                                                r"so it is not a model directory.*"
                                                r"Copy the model's config\.json into it"):
        make_session(model=str(copy))
    shutil.copy(f"{task.model}/config.json", copy)
    _steps_fine(make_session(model=str(copy)))


def test_a_truncated_safetensors_file_is_named_with_the_cause(task, make_session, tmp_path):
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(task.model, copy)
    weights = copy / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(OSError, match=rf"The weights file {weights} is damaged: its tensors need {len(whole)} bytes "
                                      rf"but the file holds only {len(whole) // 2}\. .*cut short.*"
                                      r"Download it again, or save the model again"):
        make_session(model=str(copy))
    weights.write_bytes(whole[:100])  # the header itself cut
    with pytest.raises(OSError, match=r"model\.safetensors is damaged: "
                                      r"its header claims \d+ bytes but the file holds 100"):
        make_session(model=str(copy))


def test_reward_weights_of_the_wrong_length_are_refused_when_the_session_is_built(task, make_session):
    with pytest.raises(ValueError, match=r"reward_weights has 3 entries .* but there are 2 reward functions\. "
                                         r"Give one weight"):
        make_session(reward_weights=[1.0, 0.5, 2.0])
    session = make_session(reward_weights=[1.0, 0.5])
    _steps_fine(session)
