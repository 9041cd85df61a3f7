"""tools= and max_tool_calling_iterations: the model calls Python functions while it generates.

The shipped model does not call tools, so a fixture teaches it (supervised, a few seconds) the
tool-calling format of ``grpo_lab.tasks.tool_format``: a chat template that renders tools, calls and
results, and the tokenizer's response_template that parses the calls back."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from grpo_lab import GRPOSession
from grpo_lab.tasks.tool_format import TOOL_CHAT_TEMPLATE, TOOL_RESPONSE_TEMPLATE
from tests.conftest import SMALL, launch_plan, run_exported_step

TEMPLATE, RESPONSE_TEMPLATE = TOOL_CHAT_TEMPLATE, TOOL_RESPONSE_TEMPLATE
CALLS = []


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    CALLS.append((a, b))
    return a + b


async def add_later(a: int, b: int) -> int:
    """Adds two integers, asynchronously.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def broken(a: int, b: int) -> int:
    """Fails.

    Args:
        a: The first integer.
        b: The second integer.
    """
    raise RuntimeError("down")


def no_docstring(a: int) -> int:
    return a


def answered(completions, **kwargs):
    """1 where the completion's last message answers after a tool result."""
    return [float(len(c) == 3 and c[1]["role"] == "tool" and "<answer>" in c[2]["content"]) for c in completions]


def taught_to_add(model_dir: str, directory) -> str:
    """The model in ``model_dir`` taught to call add and answer after its result, saved with its
    tokenizer (the tool-calling template set) into ``directory``, whose path it returns."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template, tokenizer.response_template = TEMPLATE, RESPONSE_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rng = random.Random(0)
    torch.manual_seed(0)

    def conversation() -> str:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        return tokenizer.apply_chat_template([
            {"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": str(a + b)},
            {"role": "assistant", "content": f"<answer>{a + b}</answer>"},
        ], tools=[add], tokenize=False)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        batch = tokenizer([conversation() for _ in range(16)], return_tensors="pt", padding=True,
                          add_special_tokens=False)
        model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def _session(task, tmp_path, model, tools, reward_funcs=(answered,), **overrides):
    config = task.config(**{**SMALL, "output_dir": str(tmp_path / "out"), "max_completion_length": 64,
                            "top_k": 1, **overrides})
    return GRPOSession(model, list(reward_funcs), args=config, train_dataset=task.train_dataset, tools=tools)


def test_tools_run_and_their_results_are_context_but_not_trained(task, tmp_path, tool_model):
    session = _session(task, tmp_path, tool_model, [add])
    CALLS.clear()
    rollout = session.generate()
    tokenizer = session.tokenizer
    assert rollout.columns["tool_calls"] == [1] * len(rollout) and len(CALLS) == len(rollout)
    for row, (a, b) in enumerate(CALLS):
        assert isinstance(a, int) and isinstance(b, int)  # the arguments are cast by the tool's schema
        call, result, answer = rollout.completions[row]
        assert call["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": a, "b": b}}
        assert result == {"role": "tool", "name": "add", "content": str(a + b)}
        kept = rollout.completion_mask_BT[row].bool()
        ids, env = rollout.completion_ids_BT[row][kept], rollout.env_mask_BT[row][kept]
        inserted = tokenizer.decode(ids[env == 0])
        assert inserted == f"\n<|im_start|>tool\n{a + b}<|im_end|>\n<|im_start|>assistant\n"
        first_turn_end = int((env == 0).nonzero()[0])
        assert ids[first_turn_end - 1] == tokenizer.eos_token_id  # the model's call ends its turn
        assert answer["content"] == tokenizer.decode(ids[first_turn_end + int((env == 0).sum()):],
                                                     skip_special_tokens=True)
    inserted_B = (rollout.env_mask_BT == 0).logical_and(rollout.completion_mask_BT.bool()).sum(1)
    assert torch.equal(rollout.completion_lengths_B, rollout.completion_mask_BT.sum(1) - inserted_B)
    session.score()
    metrics = session.advantages().metrics
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.0
    session.loss()
    session.update()


def test_failing_and_async_tools(task, tmp_path, tool_model):
    broken.__name__ = "add"  # what the model calls
    try:
        session = _session(task, tmp_path / "broken", tool_model, [broken], max_completion_length=80)
        rollout = session.generate()
    finally:
        broken.__name__ = "broken"
    assert {m["content"] for c in rollout.completions for m in c if m["role"] == "tool"} == {"{'error': 'down'}"}
    assert rollout.columns["tool_failures"] == [1] * len(rollout)
    session.score()
    assert session.advantages().metrics["tools/failure_frequency"] == 1.0

    add_later.__name__ = "add"
    try:
        rollout = _session(task, tmp_path / "async", tool_model, [add_later]).generate()
    finally:
        add_later.__name__ = "add_later"
    arguments = rollout.completions[0][0]["tool_calls"][0]["function"]["arguments"]
    assert rollout.completions[0][1]["content"] == str(arguments["a"] + arguments["b"])


def test_max_tool_calling_iterations(task, tmp_path, tool_model):
    session = _session(task, tmp_path, tool_model, [add], max_tool_calling_iterations=0)
    CALLS.clear()
    rollout = session.generate()
    assert CALLS == [] and rollout.columns["tool_calls"] == [0] * len(rollout) and rollout.env_mask_BT.min() == 1
    assert all(len(c) == 1 and c[0]["tool_calls"] for c in rollout.completions)  # parsed, not run
    session.discard_batch()
    session.config.max_tool_calling_iterations = 1  # read at every generation
    assert session.generate().columns["tool_calls"] == [1] * len(rollout)
    with pytest.raises(ValueError, match="max_tool_calling_iterations must be an int >= 0"):
        session.config.max_tool_calling_iterations = -1
        session.discard_batch()
        session.generate()


def test_a_result_that_leaves_no_room_for_an_answer_is_dropped(task, tmp_path, tool_model):
    rollout = _session(task, tmp_path, tool_model, [add], max_completion_length=36).generate()
    assert rollout.columns["tool_calls"] == [1] * len(rollout)  # run, then dropped
    assert rollout.env_mask_BT.min() == 1 and all(len(c) == 1 and c[0]["tool_calls"] for c in rollout.completions)
    assert not rollout.is_truncated_B.any()  # each completion is its call, ended by EOS


def test_an_answer_after_a_tool_result_is_cut_at_max_completion_length(task, tmp_path, tool_model):
    # Where the trained model's answers start and end differs from machine to machine: the budget is
    # read off an uncut (greedy) rollout, one token past the latest answer start, so that every row has
    # room for an answer and each row whose answer is longer than that is cut inside it.
    session = _session(task, tmp_path / "uncut", tool_model, [add])
    uncut = session.generate()
    mask_BT = uncut.completion_mask_BT.bool()
    full_B = mask_BT.sum(1)
    answer_start_B = torch.tensor([int(((uncut.env_mask_BT[row] == 0) & mask_BT[row]).nonzero()[-1]) + 1
                                   for row in range(len(uncut))])
    assert (answer_start_B < full_B).all() and not uncut.is_truncated_B.any()  # every row answered after its result
    budget = int(answer_start_B.max()) + 1
    cut_B = full_B > budget
    assert cut_B.any()

    rollout = _session(task, tmp_path / "cut", tool_model, [add], max_completion_length=budget).generate()
    lengths = rollout.completion_mask_BT.sum(1)
    inserted = ((rollout.env_mask_BT == 0) & rollout.completion_mask_BT.bool()).sum(1)
    assert (inserted > 0).all() and torch.equal(lengths, torch.where(cut_B, budget, full_B))
    assert torch.equal(rollout.is_truncated_B, cut_B)
    assert torch.equal(rollout.completion_lengths_B, lengths - inserted)
    for row in cut_B.nonzero().flatten().tolist():  # the answer holds the tokens that fit, nothing after
        answer_ids = uncut.completion_ids_BT[row][int(answer_start_B[row]):budget]
        assert rollout.completions[row][2]["content"] == session.tokenizer.decode(answer_ids, skip_special_tokens=True)


def test_the_turns_after_a_tool_result_take_the_chat_template_kwargs(task, tmp_path, tool_model):
    session = _session(task, tmp_path, tool_model, [add], chat_template_kwargs={"assistant_prefix": "#"})
    loop = session.engine.custom_rollout
    suffix = loop._suffix_ids([{"role": "tool", "name": "add", "content": "5"}], session.config.chat_template_kwargs)
    assert session.tokenizer.decode(suffix) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n#"
    with pytest.raises(ValueError, match="chat_template_kwargs has a 'tools' entry"):
        _session(task, tmp_path, tool_model, [add], chat_template_kwargs={"tools": []})


def test_setups_that_cannot_call_tools_are_refused(task, tmp_path, tool_model):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="no response_template"):
        _session(task, tmp_path, task.model, [add])
    with pytest.raises(TypeError, match=r"tools must be a list of functions, e.g. tools=\[add\]"):
        _session(task, tmp_path, tool_model, add)
    tokenizer = AutoTokenizer.from_pretrained(task.model)  # the shipped chat template knows no tools
    tokenizer.response_template = RESPONSE_TEMPLATE
    config = task.config(**{**SMALL, "output_dir": str(tmp_path / "t")})
    with pytest.raises(ValueError, match="chat template ignores tools"):
        GRPOSession(tool_model, [answered], args=config, train_dataset=task.train_dataset, processing_class=tokenizer,
                    tools=[add])
    tokenizer.chat_template = TEMPLATE.replace("{% if message.get('tool_calls') %}", "{% if false %}")
    with pytest.raises(ValueError, match="drops an assistant message's tool_calls"):
        GRPOSession(tool_model, [answered], args=config, train_dataset=task.train_dataset, processing_class=tokenizer,
                    tools=[add])
    with pytest.raises(ValueError, match=r"Tool 'no_docstring' cannot be described.*Google-style docstring"):
        _session(task, tmp_path, tool_model, [no_docstring])
    with pytest.raises(ValueError, match="Give tools or rollout_func, not both"):
        config = task.config(**{**SMALL, "output_dir": str(tmp_path / "o")})
        GRPOSession(tool_model, [answered], args=config, train_dataset=task.train_dataset, tools=[add],
                    rollout_func=lambda prompts, session: {})
    plain = task.train_dataset.map(lambda row: {"prompt": row["prompt"][0]["content"]})
    with pytest.raises(ValueError, match="tools need conversational prompts"):
        GRPOSession(tool_model, [answered], args=task.config(**{**SMALL, "output_dir": str(tmp_path / "p")}),
                    train_dataset=plain, tools=[add])


def test_save_load_and_export_keep_the_tools(task, tmp_path, tool_model):
    session = _session(task, tmp_path, tool_model, [add], max_steps=1)
    script = session.export_script(tmp_path / "train.py")
    session.save(tmp_path / "saved")
    first = session.step()
    assert GRPOSession.load(tmp_path / "saved").tools == [add]
    assert "tools=[add]," in script.read_text()
    row = run_exported_step(script, tmp_path)
    assert row == {k: v for k, v in first.items() if k != "step_time"} and row["tools/call_frequency"] == 1.0


@pytest.mark.slow
def test_under_fsdp_a_process_without_a_next_turn_joins_the_others_generation(tool_model, tmp_path):
    """Process 1's tool results leave no room for an answer, process 0's do: process 1 still takes part
    in the generation call that samples process 0's next turns (FSDP gathers weights collectively)."""
    launch_plan("fsdp.yaml", [{"mode": "tools", "model": tool_model, "out": tmp_path}], tmp_path)
    answered_here, dropped_here = (json.loads((tmp_path / f"tools-{rank}.json").read_text()) for rank in (0, 1))
    assert ([calls for calls, _ in answered_here["steps"]] == [[1] * 8] * 2
            == [calls for calls, _ in dropped_here["steps"]])
    assert all(inserted > 0 for _, inserted in answered_here["steps"])
    assert all(inserted == 0 for _, inserted in dropped_here["steps"])
    assert answered_here["row"]["tools/call_frequency"] == 1.0


def test_the_template_checks_follow_the_training_prompts(task, tool_model):
    """A template that renders tools only into a system message is refused only for prompts without one;
    one that renders the last assistant turn differently (Qwen3's empty thinking block) still gives the
    tokens that follow a turn."""
    from transformers import AutoTokenizer

    from grpo_lab.rollout.tools import ToolCalling, check_tools

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    tokenizer.chat_template = TEMPLATE.replace("{% if tools %}", "{% if tools and messages[0]['role'] == 'system' %}")
    question = [{"role": "user", "content": "1+2="}]
    with pytest.raises(ValueError, match="chat template ignores tools: it renders the first training prompt"):
        check_tools([add], tokenizer, question, None)
    assert check_tools([add], tokenizer, [{"role": "system", "content": "Be brief."}, *question], None) == [add]

    tokenizer.chat_template = TEMPLATE.replace(
        "{% else %}{{ message['content'] }}",
        "{% if loop.last %}<think></think>{% endif %}{% else %}{{ message['content'] }}")
    loop = ToolCalling([add], tokenizer, {tokenizer.eos_token_id}, None)
    suffix = loop._suffix_ids([{"role": "tool", "name": "add", "content": "3"}], None)
    assert tokenizer.decode(suffix) == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"


def test_a_round_samples_in_as_few_calls_as_the_context_allows():
    from grpo_lab.rollout.tools import _sampling_groups

    contexts = {0: [1] * 90, 1: [1] * 60, 2: [1] * 50, 3: [1] * 30}
    budgets = {0: 20, 1: 24, 2: 24, 3: 24}
    assert _sampling_groups(contexts, budgets, None) == [([0, 1, 2, 3], 24)]
    groups = _sampling_groups(contexts, budgets, 112)  # 90 + 24 would not fit: row 0 alone
    assert groups == [([0], 20), ([1, 2, 3], 24)]
    assert all(max(len(contexts[r]) for r in rows) + most <= 112 for rows, most in groups)
    assert _sampling_groups({}, {}, 128) == []


def test_the_trl_tools_script_runs_as_written(tmp_path, tool_model):
    """examples/trl_scripts/tools.py, a TRL script with only its import changed: its log rows carry
    TRL's tool-loop metrics beside the training ones."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "trl_scripts",
                          "tools.py")
    done = subprocess.run([sys.executable, script, "--model", str(tool_model), "--output_dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "trainer_state.json").read_text())["log_history"]
    assert [row["step"] for row in rows] == [1, 2, 2]
    for row in rows[:2]:
        assert {"tools/call_frequency", "tools/failure_frequency", "loss", "reward", "num_tokens"} <= set(row)
