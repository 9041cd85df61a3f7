"""GRPOTrainer's transformers surface, as a TRL script uses it: ``state`` (``log_history`` with TRL's
keys and reduction), ``control``, callbacks and their events, ``train()``'s ``TrainOutput``."""

import json
import math

import pytest
from transformers import TrainerCallback
from transformers.trainer_utils import TrainOutput

from grpo_lab import GRPOTrainer
from grpo_lab.trainer.events import window_row
from tests.conftest import SMALL


def _trainer(task, tmp_path, callbacks=None, **overrides):
    config = task.config(**{**SMALL, "output_dir": str(tmp_path), "save_steps": 100, "disable_tqdm": True,
                            **overrides})
    return GRPOTrainer(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                       callbacks=callbacks)


def test_window_row_averages_the_window_leaves_nan_out_and_takes_the_last_step_where_the_trainer_does():
    rows = [
        {"step": 1, "reward": 1.0, "entropy": float("nan"), "kl": float("nan"), "grad_norm": 5.0, "num_tokens": 10.0},
        {"step": 2, "reward": 2.0, "entropy": 0.5, "kl": float("nan"), "grad_norm": 3.0, "num_tokens": 25.0},
    ]
    # reward (1 + 2) / 2; entropy: the NaN left out; kl: nothing left -> None; grad_norm and
    # num_tokens: step 2's
    assert window_row(rows) == {"reward": 1.5, "entropy": 0.5, "kl": None, "grad_norm": 3.0, "num_tokens": 25.0}


def test_log_history_rows_are_trls_window_means_and_train_returns_a_train_output(task, tmp_path):
    trainer = _trainer(task, tmp_path, max_steps=5, logging_steps=2)
    out = trainer.train()
    history = trainer.session.history
    logged = trainer.state.log_history
    assert [row["step"] for row in logged] == [2, 4, 5]
    for row, (first, last) in zip(logged[:2], [(0, 1), (2, 3)]):
        window = history.iloc[first:last + 1]
        assert row["reward"] == pytest.approx(window["reward"].mean(), rel=1e-12)
        assert row["loss"] == pytest.approx(window["loss"].mean(), rel=1e-12, abs=1e-15)
        assert row["grad_norm"] == history["grad_norm"].iloc[last]
        assert row["num_tokens"] == history["num_tokens"].iloc[last]
        assert row["epoch"] == history["epoch"].iloc[last]
    closing = logged[-1]
    train_loss = history["loss"].mean()
    assert closing["train_loss"] == pytest.approx(train_loss, rel=1e-12, abs=1e-15)
    assert closing["reward"] == history["reward"].iloc[4]  # step 5, not logged before: TRL folds it in here
    assert "loss" not in closing and "grad_norm" not in closing
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"} <= set(closing)
    assert isinstance(out, TrainOutput) and out.global_step == 5
    assert out.training_loss == pytest.approx(train_loss, rel=1e-12, abs=1e-15)
    assert out.metrics == {k: v for k, v in closing.items() if k != "step"}  # total_flos included, as TRL's
    assert (trainer.state.global_step, trainer.state.max_steps) == (5, 5)
    assert trainer.state.is_world_process_zero


class Recorder(TrainerCallback):
    """Notes each event with the step, and stops or saves where told."""

    def __init__(self, save_at=(), stop_at=None):
        self.events, self.save_at, self.stop_at, self.seen = [], save_at, stop_at, {}

    def _note(self, name, state, **kwargs):
        self.events.append((name, state.global_step))
        self.seen.setdefault(name, {k: kwargs.get(k) for k in ("model", "optimizer", "lr_scheduler",
                                                              "processing_class")})

    def on_init_end(self, args, state, control, **kwargs):
        self._note("init_end", state, **kwargs)

    def on_train_begin(self, args, state, control, **kwargs):
        self._note("train_begin", state, **kwargs)

    def on_step_begin(self, args, state, control, **kwargs):
        self._note("step_begin", state, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        self._note("step_end", state, **kwargs)
        if state.global_step in self.save_at:
            control.should_save = True
        if state.global_step == self.stop_at:
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._note("log", state, **kwargs)

    def on_save(self, args, state, control, **kwargs):
        self._note("save", state, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        self._note("train_end", state, **kwargs)


def test_callbacks_get_transformers_events_in_order_and_can_save_and_stop_the_run(task, tmp_path):
    recorder = Recorder(save_at=(1,), stop_at=3)
    trainer = _trainer(task, tmp_path, callbacks=[recorder], max_steps=6, logging_steps=2)
    out = trainer.train()
    assert recorder.events == [
        ("init_end", 0), ("train_begin", 0),
        ("step_begin", 0), ("step_end", 1), ("save", 1),  # saved because the callback asked
        ("step_begin", 1), ("step_end", 2), ("log", 2),  # logging_steps=2
        ("step_begin", 2), ("step_end", 3), ("save", 3),  # stopped: the checkpoint of the last step
        ("log", 3), ("train_end", 3),
    ]
    assert out.global_step == 3 and trainer.session.global_step == 3
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-3"]
    kwargs = recorder.seen["step_end"]
    assert kwargs["model"] is trainer.model and kwargs["optimizer"] is trainer.session.engine.optimizer
    assert kwargs["lr_scheduler"] is trainer.session.engine.scheduler
    assert kwargs["processing_class"] is trainer.session.tokenizer


def test_add_and_pop_callback(task, tmp_path):
    trainer = _trainer(task, tmp_path, max_steps=1)
    recorder = Recorder()
    trainer.add_callback(recorder)
    trainer.train()
    assert ("train_end", 1) in recorder.events
    assert trainer.pop_callback(Recorder) is recorder
    assert not any(isinstance(c, Recorder) for c in trainer.callback_handler.callbacks)


def test_a_resumed_trainer_keeps_the_log_history_of_its_checkpoint(task, tmp_path):
    first = _trainer(task, tmp_path / "a", max_steps=3, logging_steps=1, save_steps=1)
    first.train()
    saved = json.loads((tmp_path / "a" / "checkpoint-2" / "trainer_state.json").read_text())
    assert [row["step"] for row in saved["log_history"]] == [1, 2]
    resumed = _trainer(task, tmp_path / "a", max_steps=3, logging_steps=1, save_steps=1)
    resumed.train(resume_from_checkpoint=tmp_path / "a" / "checkpoint-2")
    logged = resumed.state.log_history
    assert [row["step"] for row in logged] == [1, 2, 3, 3]
    assert logged[:2] == first.state.log_history[:2]
    drop = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
    assert {k: v for k, v in logged[2].items() if k not in drop} == {
        k: v for k, v in first.state.log_history[2].items() if k not in drop}


def test_log_history_has_trls_keys_on_the_same_run(task, tmp_path):
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from grpo_lab.tasks import DEMO_CONFIG

    # transformers 5 dropped warmup_ratio from TrainingArguments (grpo_lab keeps TRL 1.16's field)
    settings = {k: v for k, v in {**DEMO_CONFIG, **SMALL, "max_steps": 3, "logging_steps": 2}.items()
                if k != "warmup_ratio"}
    theirs = TRLTrainer(task.model, task.reward_funcs, train_dataset=task.train_dataset, args=TRLConfig(
        output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, save_strategy="no", **settings))
    # (with disable_tqdm, transformers' PrinterCallback pops total_flos from the metrics it prints and returns)
    trl_out = theirs.train()
    ours = _trainer(task, tmp_path / "ours", max_steps=3, logging_steps=2)
    out = ours.train()
    grpo_lab_only = {"backward_skipped_fraction", "update_skipped"}
    assert len(ours.state.log_history) == len(theirs.state.log_history) == 2
    for mine, trl_row in zip(ours.state.log_history, theirs.state.log_history):
        assert set(mine) - grpo_lab_only == set(trl_row)
    assert set(out.metrics) - grpo_lab_only == set(trl_out.metrics)


def test_nan_and_infinite_losses_are_left_out_of_the_loss_means():
    rows = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": float("nan")}, {"step": 3, "loss": float("inf")}]
    assert window_row(rows)["loss"] == 1.0
    assert window_row(rows, finite_loss=False)["loss"] == math.inf  # NaN left out, as for every metric


def test_logging_first_step_logs_step_one_even_with_logging_off():
    from types import SimpleNamespace

    from transformers.trainer_callback import TrainerControl, TrainerState

    from grpo_lab.trainer.events import GRPOFlowCallback

    args = SimpleNamespace(logging_strategy="no", save_strategy="no", eval_strategy="no", eval_delay=0,
                           logging_first_step=True)
    state = TrainerState(global_step=1, max_steps=5, logging_steps=2, save_steps=2, eval_steps=2)
    assert GRPOFlowCallback().on_step_end(args, state, TrainerControl()).should_log
    state.global_step = 2
    assert not GRPOFlowCallback().on_step_end(args, state, TrainerControl()).should_log


class InsideSteps(TrainerCallback):
    """Notes the events inside a step and the epoch events, with the step and what the optimizer holds."""

    def __init__(self):
        self.events = []

    def _note(self, name, state, optimizer=None):
        moved = None if optimizer is None else sum(len(s) > 0 for s in optimizer.state.values())
        self.events.append((name, state.global_step) if moved is None else (name, state.global_step, moved))

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._note("epoch_begin", state)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._note("epoch_end", state)

    def on_step_begin(self, args, state, control, **kwargs):
        self._note("step_begin", state)

    def on_substep_end(self, args, state, control, **kwargs):
        self._note("substep_end", state)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self._note("pre_optimizer_step", state, optimizer)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self._note("optimizer_step", state, optimizer)

    def on_step_end(self, args, state, control, **kwargs):
        self._note("step_end", state)


@pytest.mark.parametrize("prompts", [4, 5])
def test_events_inside_a_step_and_epoch_events_come_as_transformers_sends_them(task, tmp_path, prompts):
    recorder = InsideSteps()
    # 2 prompts per optimizer step in 2 micro-batches of 4 completions: an epoch is 2 steps, with 4
    # prompts and with 5 (the fifth does not fill a batch and is left out, as a data loader's drop_last)
    config = task.config(**{**SMALL, "output_dir": str(tmp_path), "save_strategy": "no", "disable_tqdm": True,
                            "max_steps": 3, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2})
    trainer = GRPOTrainer(task.model, task.reward_funcs, args=config,
                          train_dataset=task.train_dataset.select(range(prompts)), callbacks=[recorder])
    trainer.train()

    def step(n, first_moves):  # the optimizer holds no state before its first step, then one per parameter
        held = sum(p.requires_grad for p in trainer.model.parameters())
        before = 0 if first_moves else held
        return [("step_begin", n - 1), ("substep_end", n - 1), ("pre_optimizer_step", n - 1, before),
                ("optimizer_step", n - 1, held), ("step_end", n)]

    assert recorder.events == [
        ("epoch_begin", 0), *step(1, True), *step(2, False), ("epoch_end", 2),
        ("epoch_begin", 2), *step(3, False), ("epoch_end", 3),
    ]


def test_the_trainer_and_the_session_take_trls_arguments_in_trls_order():
    import inspect

    import trl

    from grpo_lab import GRPOSession

    theirs = [(name, p.kind, p.default) for name, p in inspect.signature(trl.GRPOTrainer).parameters.items()]
    for ours in (GRPOTrainer, GRPOSession):
        assert [(name, p.kind, p.default) for name, p in inspect.signature(ours).parameters.items()] == theirs
    # a positional call binds the same names: TRL's order after reward_processing_classes included
    values = [f"value {i}" for i in range(len(theirs))]
    assert (inspect.signature(GRPOTrainer).bind(*values).arguments
            == inspect.signature(trl.GRPOTrainer).bind(*values).arguments)
    assert inspect.signature(GRPOTrainer).bind(*values).arguments["quantization_config"] == "value 9"


def test_a_session_refuses_callbacks_and_names_where_they_go(task):
    from grpo_lab import GRPOSession

    with pytest.raises(TypeError, match="pass callbacks= to GRPOTrainer, or follow .* session.on"):
        GRPOSession(task.model, task.reward_funcs, callbacks=[TrainerCallback()], train_dataset=task.train_dataset)


def _four_bit():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="float32")


def test_quantization_config_loads_the_policy_quantized_as_trls_argument(task, tmp_path, caplog):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    config = task.config(**{**SMALL, "output_dir": str(tmp_path), "model_init_kwargs": {"device_map": "cpu"}})
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(task.model, task.reward_funcs, config, task.train_dataset, None, None, None, None,
                          (None, None), _four_bit(), lora)  # positionally, in TRL's order
    assert any(type(module).__name__ == "Linear4bit" for module in trainer.model.modules())
    assert config.model_init_kwargs == {"device_map": "cpu"}  # merged into a copy, as TRL does

    both = task.config(**{**SMALL, "output_dir": str(tmp_path),
                          "model_init_kwargs": {"quantization_config": _four_bit()}})
    with pytest.raises(ValueError, match="`quantization_config` both as a trainer argument and in "
                                         "`args.model_init_kwargs`"):
        GRPOTrainer(task.model, task.reward_funcs, args=both, train_dataset=task.train_dataset,
                    quantization_config=_four_bit())

    loaded = AutoModelForCausalLM.from_pretrained(task.model)
    with caplog.at_level("WARNING", logger="grpo_lab"):
        trainer = GRPOTrainer(loaded, task.reward_funcs, args=task.config(**{**SMALL, "output_dir": str(tmp_path)}),
                              train_dataset=task.train_dataset, quantization_config=_four_bit())
    assert "your model is already instantiated. The `quantization_config` will be ignored." in caplog.text
    assert not any(type(module).__name__ == "Linear4bit" for module in trainer.model.modules())


def test_output_dir_defaults_are_trls(task, tmp_path, monkeypatch):
    from grpo_lab import GRPOConfig

    assert GRPOConfig().output_dir == "trainer_output"
    monkeypatch.chdir(tmp_path)
    trainer = GRPOTrainer(task.model, task.reward_funcs, train_dataset=task.train_dataset)  # no args: TRL's name
    assert trainer.args.output_dir == "tiny_model-GRPO" and trainer.output_dir.name == "tiny_model-GRPO"


def test_a_dtype_object_assigned_to_model_init_kwargs_trains_and_checkpoints(task, tmp_path):
    import torch

    from grpo_lab import GRPOConfig

    config = task.config(**{**SMALL, "output_dir": str(tmp_path), "max_steps": 1, "disable_tqdm": True})
    config.model_init_kwargs = {"dtype": torch.float32}  # after the config is built, as TRL's gspo.py does
    GRPOTrainer(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset).train()
    assert GRPOConfig.from_yaml(tmp_path / "checkpoint-1" / "config.yaml").model_init_kwargs == {"dtype": "float32"}


def test_save_model_writes_trls_training_args_and_model_card(task, tmp_path):
    import torch

    trainer = _trainer(task, tmp_path, max_steps=1)
    target = trainer.save_model(tmp_path / "saved")
    args = torch.load(target / "training_args.bin", weights_only=False)  # as transformers' Trainer pickles it
    assert args.to_dict() == trainer.args.to_dict()
    card = (target / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n") and "GRPO" in card
    assert "base_model" not in card  # a local folder is not named as a hub model, as in TRL


def test_a_run_names_a_model_object_by_its_name_and_a_path_as_given(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_lab.core.build import model_reference

    base = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))
    adapted = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    # a PEFT model (what a resumed LoRA run is built from) is an object, not a path: never its repr
    assert model_reference(adapted, "tiny_model") == "tiny_model"
    assert model_reference(base, "tiny_model") == "tiny_model"
    assert model_reference(tmp_path / "model", "ignored") == str(tmp_path / "model")
    assert model_reference("org/model", None) == "org/model"
