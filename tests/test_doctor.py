"""session.doctor(): each finding built on the shipped model, the healthy configs' silence, and a
session left bitwise as it was (grpo_lab/session/findings.py, grpo_lab/doctor/)."""

import random
import re

import pytest
import torch

from grpo_lab import GRPOSession
from grpo_lab.doctor import Findings
from grpo_lab.core.models import load_tokenizer
from grpo_lab.tasks import default_task
from tests.conftest import SMALL


def _only(findings, code):
    found = [finding for finding in findings if finding.code == code]
    assert len(found) == 1, f"{code} not found once in:\n{findings!r}"
    return found[0]


def noise(completions, **kwargs):
    """Varies among the completions of every prompt, whatever the model writes."""
    draw = random.Random(len(completions))
    return [draw.random() for _ in completions]


def half(completions, **kwargs):
    """0 or 0.5 in turn: below the 1.0 it declares."""
    return [0.5 * (i % 2) for i in range(len(completions))]


half.max_reward = 1.0


def always(value):
    def reward(completions, **kwargs):
        return [value] * len(completions)

    reward.__name__ = f"always_{value}"
    return reward


def by_prompt(completions, answer, **kwargs):
    """The reference answer's size: the same for every completion of a prompt."""
    return [int(a) / 200 for a in answer]


def test_the_healthy_configs_give_nothing_above_info(make_session, task, tmp_path):
    small = make_session().doctor()
    demo = GRPOSession(task.model, task.reward_funcs, args=task.config(output_dir=str(tmp_path / "demo")),
                       train_dataset=task.train_dataset).doctor()
    for findings in (small, demo):
        assert isinstance(findings, Findings)
        assert findings.above("info") == [], repr(findings)


def test_truncation_names_the_cut_and_suggests_a_limit_the_probe_checked(make_session):
    session = make_session(max_completion_length=2)
    finding = _only(session.doctor(), "truncation")
    assert finding.severity == "error"
    assert "max_completion_length=2" in finding.message and "without an EOS" in finding.message
    assert finding.evidence["truncated"] == "8 of 8 (100%)" and finding.evidence["ended lengths"] == "none ended"
    # nearly all cut: the probe's batch was generated again with 4, 8... tokens until its lengths showed
    (trial,) = [key for key in finding.evidence if key.startswith("generated again with max_completion_length=")]
    assert finding.evidence[trial].split(";")[0] in {"0% cut", *(f"{p}% cut" for p in range(1, 10))}
    suggested = int(re.match(r"max_completion_length=(\d+) \(nearly all were cut", finding.fix).group(1))
    assert suggested > 2
    session.config.max_completion_length = suggested
    assert [f for f in session.doctor() if f.code == "truncation"] == []  # the proposed limit cuts none of them


def test_a_constant_reward_function_is_named(make_session):
    beside_noise = _only(make_session(reward_funcs=[noise, always(0.5)]).doctor(), "reward_constant")
    assert beside_noise.severity == "info"
    assert "'always_0.5'" in beside_noise.message and "same value (0.5)" in beside_noise.message
    assert "learns from 'noise' alone" in beside_noise.message
    alone = _only(make_session(reward_funcs=[always(0.5)]).doctor(), "reward_constant")
    assert alone.severity == "error"  # alone, it makes every advantage 0: nothing is learned


def test_the_root_cause_comes_first_and_its_consequences_follow_under_it(make_session):
    # a reward that is always 0: every group ties at the lowest reward, "too hard" as a symptom
    findings = make_session(reward_funcs=[always(0.0)]).doctor()
    assert findings[0].code == "reward_constant" and findings[0].severity == "error" and not findings[0].cause
    too_hard = _only(findings, "groups_too_hard")
    assert too_hard.cause == "reward_constant" and findings.index(too_hard) == 1
    assert too_hard.fix.startswith("Fix reward_constant first (above): it explains this finding.")
    assert "    [error] groups_too_hard (follows from reward_constant): " in repr(findings)
    assert "follows from <code>reward_constant</code>" in findings._repr_html_()
    # completions cut at 2 tokens: the cut explains the rewards and the tied groups below it
    findings = make_session(max_completion_length=2).doctor()
    assert findings[0].code == "truncation" and not findings[0].cause
    consequences = [f for f in findings if f.code in ("reward_constant", "groups_too_hard", "groups_tied",
                                                      "zero_advantage_micro_batches")]
    assert consequences and all(f.cause == "truncation" for f in consequences)
    causes = [f.cause for f in findings]
    assert causes[:len(consequences) + 1] == ["", *["truncation"] * len(consequences)]  # grouped under it


def test_a_reward_that_varies_only_between_prompts_gives_no_signal(make_session):
    findings = make_session(reward_funcs=[by_prompt]).doctor()
    finding = _only(findings, "reward_between_prompts_only")
    assert finding.severity == "error"
    assert "never among the completions of one prompt" in finding.message
    assert finding.evidence["std within groups"] == 0.0 and finding.evidence["std of group means"] > 0
    assert "score the completion" in finding.fix
    assert _only(make_session(reward_funcs=[noise, by_prompt]).doctor(),
                 "reward_between_prompts_only").severity == "warning"


def test_an_always_none_reward_function_is_an_error(make_session, task):
    finding = _only(make_session(reward_funcs=[task.reward_funcs[0], always(None)]).doctor(), "reward_always_none")
    assert finding.severity == "error"
    assert "'always_None' returned None for every completion" in finding.message
    assert "return a number" in finding.fix


def test_a_declared_maximum_never_reached_says_what_was_seen(make_session):
    finding = _only(make_session(reward_funcs=[half]).doctor(), "reward_below_maximum")
    assert finding.severity == "info"
    assert "max_reward=1" in finding.message and "the maximum seen is 0.5" in finding.message
    assert finding.evidence["maximum seen"] == 0.5 and finding.evidence["values seen"] == "0 x4, 0.5 x4"


def test_all_correct_groups_are_too_easy(make_session):
    findings = make_session(reward_funcs=[always(1.0)]).doctor()
    finding = _only(findings, "groups_too_easy")
    assert finding.severity == "error"
    assert "every advantage is 0 and so is the gradient" in finding.message
    assert "harder prompts" in finding.fix
    assert len(finding.evidence["example prompts"]) == 2  # the probe's two prompts
    assert "groups_too_hard" not in findings.codes


def test_all_wrong_groups_are_too_hard(make_session):
    findings = make_session(reward_funcs=[always(0.0)]).doctor()
    finding = _only(findings, "groups_too_hard")
    assert finding.severity == "error" and "no try succeeds" in finding.message
    assert "num_generations" in finding.fix
    assert "groups_too_easy" not in findings.codes


def test_the_loss_is_explained_when_it_is_zero_by_construction(make_session):
    finding = _only(make_session().doctor(), "loss_zero_by_construction")
    assert finding.severity == "info"
    assert "beta=0 and one optimizer step per generated batch" in finding.message
    assert "Its gradient is not 0" in finding.message and finding.evidence["probe grad_norm (before clipping)"] > 0
    assert "grad_norm" in finding.fix
    assert "loss_zero_by_construction" not in make_session(num_iterations=2).doctor().codes


def test_micro_batches_of_zero_advantages_are_counted(make_session):
    def first_prompt_only(completions, prompts, **kwargs):
        """Varies within the first prompt's group; ties every other group at 1."""
        draw = random.Random(0)
        return [draw.random() if prompt == prompts[0] else 1.0 for prompt in prompts]

    session = make_session(reward_funcs=[first_prompt_only], per_device_train_batch_size=4,
                           gradient_accumulation_steps=2)  # a batch of 2 prompts, one micro-batch each
    finding = _only(session.doctor(), "zero_advantage_micro_batches")
    assert finding.severity == "warning"
    assert finding.evidence["micro-batches with all advantages 0"] == "1 of 2 (50%)"
    assert "zero_advantage_micro_batches" not in make_session(reward_funcs=[noise]).doctor().codes


def test_a_template_without_a_generation_prompt_is_found(make_session, task):
    tokenizer = load_tokenizer(task.model)
    tokenizer.chat_template = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                               "{{ message['content'] }}<|im_end|>\n{% endfor %}")
    finding = _only(make_session(processing_class=tokenizer).doctor(), "generation_prompt_missing")
    assert finding.severity == "warning"
    assert finding.evidence["assistant header"] == "<|im_start|>assistant\n"
    assert "renders nothing for add_generation_prompt=True" in finding.message
    assert "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}" in finding.fix


def test_plain_text_prompts_on_a_chat_model_are_noted(make_session):
    plain = default_task(conversational=False, eval_size=16)
    finding = _only(make_session(train_dataset=plain.train_dataset).doctor(), "prompts_without_chat_template")
    assert finding.severity == "info" and "plain text" in finding.message


def test_an_eos_the_model_never_emits_names_the_end_of_turn_token(make_session, task):
    tokenizer = load_tokenizer(task.model)
    tokenizer.eos_token = "#"  # a character the addition model has no use for: generation stops only there
    finding = _only(make_session(processing_class=tokenizer).doctor(), "eos_never_emitted")
    assert finding.severity == "error"
    assert "'#'" in finding.message and "'<|im_end|>'" in finding.message
    assert finding.fix.startswith("Set tokenizer.eos_token = '<|im_end|>'")


def test_pad_equal_to_eos_matters_for_a_rollout_function_that_pads(task, tmp_path):
    def padded(prompts, session):
        out = session.sample(prompts)
        pad = session.tokenizer.pad_token_id
        return {"prompt_ids": out["prompt_ids"], "completion_ids": [ids + [pad, pad] for ids in out["completion_ids"]],
                "logprobs": None}

    tokenizer = load_tokenizer(task.model)
    tokenizer.pad_token = tokenizer.eos_token
    session = GRPOSession(task.model, task.reward_funcs, args=task.config(**SMALL, output_dir=str(tmp_path)),
                          train_dataset=task.train_dataset, processing_class=tokenizer, rollout_func=padded)
    finding = _only(session.doctor(), "pad_is_eos")
    assert finding.severity == "warning"
    assert finding.evidence["completions ending in 2+ pad/EOS tokens"] == 8
    assert "pad token of its own" in finding.fix


def _weights(session):
    return {name: tensor.detach().clone() for name, tensor in session.model.state_dict().items()}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _state(session):
    engine = session.engine
    return {
        "weights": _weights(session), "optimizer": engine.optimizer.state_dict(),
        "grads": [None if p.grad is None else p.grad.clone() for p in session.model.parameters()],
        "rng": session.random_state(), "sampler": engine.sampler.state_dict(),
        "counters": (engine.global_step, engine.num_input_tokens_seen, engine.trained_parameter_names),
        "history": session.history.to_dict(), "config": session.config.to_dict(),
        "stage": (session.next_stage, session.batch_step, len(session.snapshots)),
    }


def test_doctor_leaves_the_session_bitwise_as_it_was(make_session):
    session = make_session(num_iterations=2, undo_steps=2)
    session.step()
    held = (session.rollout, session.scores, session.advantages_result, session.loss())  # a pending loss()
    before = _state(session)
    findings = session.doctor()
    assert session.findings is findings and len(findings) > 0
    assert _same(_state(session), before)
    assert (session.rollout, session.scores, session.advantages_result, session.loss_result) == held
    session.update()
    session.step()
    after_doctor = (session.history.drop(columns=["step_time"]), _weights(session))

    twin = make_session(num_iterations=2, undo_steps=2)  # built after: the sessions share torch's generator
    twin.step()
    twin.loss()
    twin.update()
    twin.step()
    assert twin.history.drop(columns=["step_time"]).equals(after_doctor[0])
    assert _same(_weights(twin), after_doctor[1])


def test_findings_are_empty_before_the_first_doctor_and_render(make_session):
    session = make_session(max_completion_length=2)
    assert session.findings == [] and "no findings" in repr(session.findings)
    findings = session.doctor()
    groups = []  # a root cause and the findings under it, in the order shown
    for finding in findings:
        if finding.cause:
            assert groups and finding.cause == groups[-1][0].code
            groups[-1].append(finding)
        else:
            groups.append([finding])
    severest = [max(f.rank for f in group) for group in groups]
    assert severest == sorted(severest, reverse=True)  # the groups most severe first
    frame = findings.to_pandas()
    assert list(frame.columns) == ["code", "severity", "message", "evidence", "fix", "cause"]
    assert frame["code"].tolist() == findings.codes
    assert "[error] truncation" in repr(findings) and "<table" in findings._repr_html_()
    shown = findings._repr_html_()
    assert re.findall(r"<th[^>]*>([^<]*)</th>", shown) == ["severity", "code", "finding and fix", "evidence"]
    cells = re.findall(r"<td([^>]*)>", shown)
    assert len(cells) == 4 * len(findings) and all("text-align:left" in cell for cell in cells)
    assert shown.count("<b>Fix:</b>") == len(findings)  # each fix under its finding, not a column of its own


@pytest.mark.parametrize("severity", ["fatal", "Error"])
def test_a_finding_refuses_an_unknown_severity(severity):
    from grpo_lab.doctor import Finding

    with pytest.raises(ValueError, match="severity must be one of"):
        Finding("x", severity, "m")


def test_a_stop_string_the_model_never_writes_is_named(make_session):
    findings = make_session(generation_kwargs={"stop_strings": ["@@never@@"]}, max_completion_length=4).doctor()
    stop = next(f for f in findings if f.code == "stop_never_matched")
    assert stop.severity == "warning"  # the completions it was to end are truncated
    assert stop.evidence["stop strings"] == ["@@never@@"] and "rely on the EOS token" in stop.fix


def test_a_context_and_completion_limit_far_past_the_probe_forecast_a_memory_shortfall(task, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the shipped model with room for 100,000 positions (its rotary embedding has no learned table)
    model = AutoModelForCausalLM.from_pretrained(task.model, max_position_embeddings=100_000)
    config = task.config(**{**SMALL, "output_dir": str(tmp_path), "max_completion_length": 20_000})
    session = GRPOSession(model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          processing_class=AutoTokenizer.from_pretrained(task.model))
    forecast = next(f for f in session.doctor() if f.code == "memory_forecast")
    assert forecast.severity == "warning" and "out-of-memory" in forecast.message
    evidence = forecast.evidence
    assert evidence["worst-case sequence length"] > 20_000 > evidence["probe sequence length"]
    assert evidence["scale"] > 100 and "per_device_train_batch_size" in forecast.fix


def _truncated_share(finding) -> float:
    cut, total = finding.evidence["truncated"].split(" (")[0].split(" of ")
    return int(cut) / int(total)


def test_a_threshold_override_changes_the_truncation_finding_of_the_same_probe(make_session):
    from grpo_lab.doctor.thresholds import DEFAULTS

    session = make_session(max_completion_length=2)
    # the shortest limit whose probe cuts some completions but not most: a warning at the defaults
    for limit in range(2, 17):
        session.config.max_completion_length = limit
        before = session.doctor()
        found = [finding for finding in before if finding.code == "truncation"]
        if found and found[0].severity == "warning":
            break
    else:
        pytest.fail("no max_completion_length from 2 to 16 gives a truncation warning on the probe")
    share = _truncated_share(found[0])
    assert DEFAULTS.truncation_warning <= share <= DEFAULTS.truncation_error
    others = [code for code in before.codes if code != "truncation"]
    # the same probe batch (doctor() leaves the session as it was), read under other thresholds
    session.config.doctor_thresholds = {"truncation_warning": min(1.0, share + 0.01), "truncation_error": 1.0}
    assert session.doctor().codes == others
    session.config.doctor_thresholds = {"truncation_error": share / 2}
    assert DEFAULTS.truncation_warning <= share / 2
    assert _only(session.doctor(), "truncation").severity == "error"
    session.config.doctor_thresholds = {"truncation_warn": 0.3}
    with pytest.raises(ValueError, match="Did you mean 'truncation_warning'"):
        session.doctor()
    session.config.doctor_thresholds = None
    assert _only(session.doctor(), "truncation").severity == "warning"


def test_a_probe_that_cannot_allocate_its_generation_cache_is_an_error_finding(task, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # a completion limit whose generation cache is larger than any address space: the allocation fails
    # at once, on any machine, and the first step would fail alike
    limit = 2 * 10**12
    model = AutoModelForCausalLM.from_pretrained(task.model, max_position_embeddings=limit + 1000)
    config = task.config(**{**SMALL, "output_dir": str(tmp_path), "max_completion_length": limit})
    session = GRPOSession(model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          processing_class=AutoTokenizer.from_pretrained(task.model))
    before = [p.detach().clone() for p in session.model.parameters()]
    (finding,) = session.doctor()
    assert (finding.code, finding.severity) == ("probe_out_of_memory", "error")
    assert finding.evidence["max_completion_length"] == limit and "allocate" in finding.evidence["error"]
    assert finding.fix.startswith("Lower max_completion_length")
    assert session.global_step == 0 and session.next_stage == "generate"
    assert all(torch.equal(a, b) for a, b in zip(before, session.model.parameters()))


def test_groups_tied_between_the_lowest_and_highest_reward_are_named_apart(make_session):
    def first_prompt_varies(prompts, completions, **kwargs):
        """0 and 1 in turn for the first prompt's completions; 0.5 for every completion of the others."""
        first = prompts[0]
        return [float(i % 2) if prompt == first else 0.5 for i, prompt in enumerate(prompts)]

    findings = make_session(reward_funcs=[first_prompt_varies]).doctor()
    tied = _only(findings, "groups_tied")
    assert tied.evidence["groups"].startswith("1 of 2")
    assert "between the lowest and highest" in tied.message
    assert "partial credit" in tied.fix and "num_generations" in tied.fix
    assert "groups_too_easy" not in findings.codes and "groups_too_hard" not in findings.codes
