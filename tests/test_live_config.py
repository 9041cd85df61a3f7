"""live_config: every config field declares when it may change, and edits follow those declarations."""

import dataclasses

import pytest

from grpo_lab.config.grpo_config import GRPOConfig, built, setting
from grpo_lab.config.field_rules import FieldRule, rule_of, ruled
from grpo_lab.config.live import BUILT_PARTS, CHANGE_KINDS, apply_edits, change_rules, fields_of


def test_every_config_field_declares_a_known_change_rule():
    for field in dataclasses.fields(GRPOConfig):
        rule = rule_of(field)
        assert rule.change in CHANGE_KINDS, f"{field.name} declares change={rule.change!r}"
        if rule.change == "build":
            assert rule.builds in BUILT_PARTS, field.name
        else:
            assert rule.builds is None, field.name
        assert set(field.metadata) <= {"help"}, field.name  # HfArgumentParser hands every key to argparse
    assert set(change_rules()) == {field.name for field in dataclasses.fields(GRPOConfig)}


@dataclasses.dataclass
class _NoRule:
    seed: int = 0


@dataclasses.dataclass
class _UnknownRule:
    seed: int = setting(0, "sometimes", "A seed.")


@dataclasses.dataclass
class _BuildWithoutPart:
    seed: int = ruled(dataclasses.field(default=0, metadata={"help": "A seed."}), FieldRule("build"))


@dataclasses.dataclass
class _UnknownPart:
    seed: int = built(0, "the moon", "A seed.")


@pytest.mark.parametrize(("config_class", "message"), [
    (_NoRule, "_NoRule.seed declares change=None: declare one of live, build"),
    (_UnknownRule, "_UnknownRule.seed declares change='sometimes'"),
    (_BuildWithoutPart, "builds=None: a build-time field names what it builds, one of model, batch_layout"),
    (_UnknownPart, "builds='the moon'"),
])
def test_a_field_without_a_rule_or_with_an_unknown_one_is_named(config_class, message):
    with pytest.raises(ValueError, match=message):
        change_rules(config_class)


def test_build_time_parts_partition_the_build_time_fields():
    parts = [fields_of("build", part) for part in BUILT_PARTS]
    assert set().union(*parts) == fields_of("build") and sum(map(len, parts)) == len(fields_of("build"))
    assert {"seed", "data_seed", "shuffle_dataset", "optim"} == fields_of("build", "saved_state")
    assert fields_of("run_length") == {"max_steps", "num_train_epochs"}


class _Optimization:
    """The optimization hooks apply_edits calls, recorded in ``calls``."""

    def __init__(self, owns_scheduler, calls):
        self.owns_scheduler, self.calls, self.entropy = owns_scheduler, calls, self

    def rebuild_schedule(self, config, total_steps):
        self.calls.append("rebuild_schedule")

    def set_learning_rate(self, value, previous):
        self.calls.append(("set_learning_rate", value, previous))

    def restart(self, coef, *, forget_entropy):  # the entropy weight's
        self.calls.append(("restart_entropy_weight", forget_entropy))

    def apply_adamw_settings(self, config):
        self.calls.append("apply_adamw_settings")


class _Engine:
    """The engine hooks apply_edits calls, recorded."""

    ref_model, is_peft = None, False

    def __init__(self, owns_scheduler=True):
        self.calls = []
        self.optimization = _Optimization(owns_scheduler, self.calls)

    def total_steps(self):
        return 10

    def router_aux_loss_weight(self):
        return 0.0


def test_each_kind_of_edit_reaches_its_engine_hook_once():
    config, engine = GRPOConfig(), _Engine()
    applied = config.to_dict()
    config.learning_rate, config.warmup_ratio, config.entropy_coef, config.adam_beta1 = 1e-5, 0.1, 0.01, 0.8
    config.temperature = 0.7
    changed = apply_edits(config, applied, engine)
    assert set(changed) == {"learning_rate", "warmup_ratio", "entropy_coef", "adam_beta1", "temperature"}
    assert changed["learning_rate"] == (1e-6, 1e-5)
    assert engine.calls == ["rebuild_schedule", ("set_learning_rate", 1e-5, 1e-6), ("restart_entropy_weight", False),
                            "apply_adamw_settings"]
    engine.calls.clear()
    applied = config.to_dict()
    config.use_adaptive_entropy = True
    apply_edits(config, applied, engine)
    assert engine.calls == [("restart_entropy_weight", True)]  # switching also forgets the measured entropy


def test_refused_edits_are_undone_and_leave_the_others_pending():
    config, engine = GRPOConfig(), _Engine(owns_scheduler=False)
    applied = config.to_dict()
    config.seed, config.optim = 7, "adamw_torch"
    with pytest.raises(ValueError, match="optim, seed cannot change after the session is built"):
        apply_edits(config, applied, engine)
    assert (config.seed, config.optim) == (42, "adamw_torch_fused")
    config.max_steps, config.lr_scheduler_type, config.temperature = 5, "cosine", 0.5
    with pytest.raises(ValueError, match="^lr_scheduler_type: these configure the schedule grpo_lab builds"):
        apply_edits(config, applied, engine)
    assert (config.max_steps, config.lr_scheduler_type, config.temperature) == (-1, "linear", 0.5)
    config.beta = 0.04
    with pytest.raises(ValueError, match="beta > 0 needs a reference model"):
        apply_edits(config, applied, engine)
    assert config.beta == 0.0 and engine.calls == []
