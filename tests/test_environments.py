"""environment_factory: each completion runs in its own environment instance, whose methods are its
tools and whose get_reward() may score it.

The tool-calling tests use the shipped model taught to call ``add`` (tests/test_tools.py): an
environment offering an ``add`` method renders the same tools block, so the model calls it."""

import asyncio
import math
import random

import pandas as pd
import pytest
import torch
from datasets import Dataset

from grpo_lab import GRPOSession, GRPOTrainer
from grpo_lab.rollout.environments import PLACEHOLDER_PROMPT, _observed
from tests.conftest import SMALL
from tests.test_tools import add


class Adder:
    """Adds for the model; the rollout's reward is the number of sums it asked for."""

    built = 0

    def __init__(self):
        Adder.built += 1
        self.resets, self.calls, self.rewarded = [], [], 0

    def reset(self, **row):
        self.resets.append(row)
        self.calls = []

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls.append((a, b))
        return a + b

    def get_reward(self) -> float:
        self.rewarded += 1
        return float(len(self.calls))

    def _helper(self) -> None:
        """Private: not a tool."""


class Quiz(Adder):
    """Poses its own sums: reset() returns the question, which becomes the prompt."""

    def reset(self, **row):
        super().reset(**row)
        rng = random.Random(len(self.resets))
        self.question = f"{rng.randint(10, 99)}+{rng.randint(10, 99)}="
        return self.question


class Shouter:
    """A second environment with another tool and an async reward."""

    def __init__(self):
        self.resets = []

    def reset(self, **row):
        self.resets.append(row)

    def shout(self, text: str) -> str:
        """Repeats a text loudly.

        Args:
            text: What to repeat.
        """
        return text.upper()

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return -1.0


class Hint:
    """No tools: reset() appends a hint to prompts whose answer is odd; the reward function reads it."""

    def __init__(self):
        self.resets = []

    def reset(self, **row):
        self.resets.append(row)
        return None if int(row["answer"]) % 2 == 0 else " (odd)"


class NoReset:
    def add(self, a: int) -> int:
        """Returns a.

        Args:
            a: A number.
        """
        return a


class Undocumented:
    def reset(self, **row):
        return None

    def add(self, a: int) -> int:
        return a


SEEN = []


def seen_environments(completions, environments, **kwargs):
    """Records the environments it receives; 0 for every completion."""
    SEEN.append(list(environments))
    return [0.0] * len(completions)


def no_environments(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, answer):
    return [0.0] * len(completions)


RECORDED = []


def recorded(prompts, completions, environments, **kwargs):
    """Records the prompts and environments it scores; 0 for every completion."""
    RECORDED.append((prompts, list(environments)))
    return [0.0] * len(completions)


EVAL = dict(per_device_eval_batch_size=2, num_generations_eval=2)
"""Eval chunks of 2 prompts x 2 completions: a 4-row eval set takes two, which reuse the eval pool."""


def _config(task, tmp_path, **overrides):
    return task.config(**{**SMALL, "output_dir": str(tmp_path / "out"), "max_completion_length": 64, "top_k": 1,
                          **overrides})


def _session(task, tmp_path, model, factory, reward_funcs=None, train_dataset="task", eval_dataset=None,
             **overrides):
    return GRPOSession(model, reward_funcs, args=_config(task, tmp_path, **overrides),
                       train_dataset=task.train_dataset if train_dataset == "task" else train_dataset,
                       eval_dataset=eval_dataset, environment_factory=factory)


def _prompt_text(rollout, tokenizer, row: int) -> str:
    return tokenizer.decode(rollout.prompt_ids_BP[row][rollout.prompt_mask_BP[row].bool()])


def test_each_completion_calls_its_own_pooled_environment(task, tmp_path, tool_model):
    Adder.built = 0
    session = _session(task, tmp_path, tool_model, Adder)
    assert Adder.built == 1  # the probe, which starts the pool
    assert [tool.__name__ for tool in session.engine.environments.probe_tools()[None]] == ["add"]
    rollout = session.generate()
    environments = rollout.environments
    assert len({id(environment) for environment in environments}) == len(rollout) == Adder.built
    assert rollout.columns["tool_calls"] == [len(environment.calls) for environment in environments]
    assert sum(rollout.columns["tool_calls"]) > 0
    for row, environment in enumerate(environments):
        assert environment.resets == [{"prompt": rollout.prompts[row], "answer": rollout.columns["answer"][row]}]
        results = [message["content"] for message in rollout.completions[row] if message["role"] == "tool"]
        assert results == [str(a + b) for a, b in environment.calls]
    scores = session.score()
    assert scores.reward_names == ["Adder"]
    assert scores.rewards_BF[:, 0].tolist() == [float(len(environment.calls)) for environment in environments]
    assert [environment.rewarded for environment in environments] == [1] * len(rollout)
    metrics = session.advantages().metrics
    assert metrics["rewards/Adder/mean"] == pytest.approx(sum(rollout.columns["tool_calls"]) / len(rollout))
    session.loss()
    session.update()
    again = session.generate()  # the same instances, reset again: none built
    assert Adder.built == len(rollout) and [id(e) for e in again.environments] == [id(e) for e in environments]
    assert [len(environment.resets) for environment in environments] == [2] * len(rollout)


def test_an_environment_without_a_dataset_supplies_the_prompts(task, tmp_path, tool_model):
    session = _session(task, tmp_path, tool_model, Quiz, train_dataset=None, max_steps=2)
    assert session.engine.train_dataset["prompt"] == [PLACEHOLDER_PROMPT] * 2  # one generation batch of prompts
    rollout = session.generate()
    for row, environment in enumerate(rollout.environments):
        assert environment.resets == [{"prompt": PLACEHOLDER_PROMPT}]
        assert rollout.prompts[row] == [{"role": "user", "content": environment.question}]
        assert f"<|im_start|>user\n{environment.question}<|im_end|>" in _prompt_text(rollout, session.tokenizer, row)
    session.discard_batch()
    row = session.step()
    assert "rewards/Quiz/mean" in row and row["tools/call_frequency"] > 0
    metrics = session.evaluate(Dataset.from_dict({"level": [1, 2]}))  # no prompts: reset() supplies them
    assert "eval_rewards/Quiz/mean" in metrics
    assert [environment.resets for environment in session.engine.environments.eval_pool[None]] == [
        [{"level": 1}]] * 4 + [[{"level": 2}]] * 4
    with pytest.raises(ValueError, match="max_steps must be set"):
        _session(task, tmp_path, tool_model, Quiz, train_dataset=None, max_steps=-1)


def test_observations_join_the_last_message_and_reward_functions_get_the_environments(task, tmp_path):
    SEEN.clear()
    session = _session(task, tmp_path, task.model, Hint, reward_funcs=[seen_environments, task.reward_funcs[0]],
                       reward_weights=[1.0, 2.0])
    assert session.engine.custom_rollout is None  # no tools: the backend generates
    rollout = session.generate()
    for row, environment in enumerate(rollout.environments):
        (given,) = environment.resets
        odd = int(given["answer"]) % 2 == 1
        assert rollout.prompts[row] == [{"role": "user", "content": given["prompt"][0]["content"] + " (odd)" * odd}]
        assert ("(odd)" in _prompt_text(rollout, session.tokenizer, row)) == odd
    scores = session.score()
    assert [id(e) for e in SEEN[-1]] == [id(e) for e in rollout.environments]
    assert scores.reward_names == ["seen_environments", "correctness_reward"]  # Hint has no get_reward
    with pytest.raises(TypeError, match="'no_environments' does not accept environments"):
        _session(task, tmp_path, task.model, Hint, reward_funcs=[no_environments])
    with pytest.raises(ValueError, match="No reward source"):
        _session(task, tmp_path, task.model, Hint)
    odd = task.train_dataset.filter(lambda row: int(row["answer"]) % 2 == 1).select(range(16))
    text = odd.map(lambda row: {"prompt": row["prompt"][0]["content"]})
    with pytest.raises(ValueError, match="whose prompt is text"):
        _session(task, tmp_path, task.model, Hint, reward_funcs=[seen_environments], train_dataset=text).generate()


def test_observations_follow_the_content_format_of_the_last_message():
    environment = Hint()
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}]
    assert _observed(prompt, None, environment, 0) is prompt
    assert _observed(prompt, " Go.", environment, 0)[1] == {"role": "user", "content": "1+2= Go."}
    parts = [{"role": "user", "content": [{"type": "text", "text": "1+2="}]}]
    assert _observed(parts, " Go.", environment, 0) == [{"role": "user", "content": [
        {"type": "text", "text": "1+2="}, {"type": "text", "text": " Go."}]}]
    assert _observed(prompt, [{"type": "text", "text": "Go."}], environment, 0)[1]["content"] == [
        {"type": "text", "text": "1+2="}, {"type": "text", "text": "Go."}]
    with pytest.raises(TypeError, match=r"Hint.reset\(\) returned int"):
        _observed(prompt, 3, environment, 0)


def test_a_dict_of_environments_routes_rows_by_their_environment_column(task, tmp_path, tool_model):
    data = task.train_dataset.select(range(16)).add_column("environment", ["math", "shout"] * 8)
    factories = {"math": Adder, "shout": Shouter}
    session = _session(task, tmp_path, tool_model, factories, train_dataset=data, num_generations=2,
                       shuffle_dataset=False)
    rollout = session.generate()
    names = rollout.columns["environment"]
    assert set(names) == {"math", "shout"}
    for row, (name, environment) in enumerate(zip(names, rollout.environments, strict=True)):
        assert type(environment) is factories[name]
        assert "environment" not in environment.resets[-1] and "answer" in environment.resets[-1]
        tools = {"math": "tools: add<", "shout": "tools: shout<"}[name]
        assert tools in _prompt_text(rollout, session.tokenizer, row)
    pool = session.engine.environments.pool
    assert {name: len(instances) for name, instances in pool.items()} == {name: names.count(name) for name in pool}
    scores = session.score()
    assert scores.reward_names == ["Adder", "Shouter"]
    for row, name in enumerate(names):
        adder, shouter = scores.rewards_BF[row].tolist()
        if name == "math":
            assert adder == len(rollout.environments[row].calls) and math.isnan(shouter)
        else:
            assert math.isnan(adder) and shouter == -1.0
    with pytest.raises(ValueError, match="train_dataset needs an 'environment' column"):
        _session(task, tmp_path, tool_model, factories)
    with pytest.raises(ValueError, match="needs a train_dataset with an 'environment' column"):
        _session(task, tmp_path, tool_model, factories, train_dataset=None)
    other = data.map(lambda row: {"environment": "poetry"})
    with pytest.raises(ValueError, match=r"environment='poetry', which is not among .*\['math', 'shout'\]"):
        _session(task, tmp_path, tool_model, factories, train_dataset=other).generate()


def test_setups_that_cannot_run_environments_are_refused(task, tmp_path, tool_model):
    with pytest.raises(ValueError, match="without a callable reset"):
        _session(task, tmp_path, tool_model, NoReset, reward_funcs=[seen_environments])
    with pytest.raises(ValueError, match=r"(?s)public methods of Undocumented .*Google-style docstring"):
        _session(task, tmp_path, tool_model, Undocumented, reward_funcs=[seen_environments])
    with pytest.raises(ValueError, match="Two tools share a name"):
        GRPOSession(tool_model, args=_config(task, tmp_path), train_dataset=task.train_dataset, tools=[add],
                    environment_factory=Adder)
    with pytest.raises(ValueError, match="not both"):
        GRPOSession(tool_model, args=_config(task, tmp_path), train_dataset=task.train_dataset,
                    environment_factory=Adder, rollout_func=lambda prompts, session: {})
    with pytest.raises(ValueError, match="eval_dataset has a column named 'environments'"):
        GRPOSession(tool_model, args=_config(task, tmp_path), train_dataset=task.train_dataset,
                    eval_dataset=task.eval_dataset.add_column("environments", [0] * 16), environment_factory=Adder)
    with pytest.raises(TypeError, match="environment_factory must be a callable"):
        _session(task, tmp_path, tool_model, Adder())
    with pytest.raises(ValueError, match=r"reward_weights has 2 entries .* but there are 1 reward functions"):
        _session(task, tmp_path, tool_model, Adder, reward_funcs=[seen_environments], reward_weights=[1.0, 1.0])
    session = _session(task, tmp_path, tool_model, Adder, reward_funcs=[seen_environments], reward_weights=[3.0])
    session.generate()
    assert session.score().reward_names == ["seen_environments", "Adder"]
    session.advantages()  # weights [3.0] for reward_funcs, 1 for get_reward
    session.reward_funcs = [seen_environments, task.reward_funcs[0]]
    assert session.engine.reward_names == ["seen_environments", "correctness_reward", "Adder"]
    session.score()
    with pytest.raises(ValueError, match=r"reward_weights has 1 entries but there are 2 reward functions"):
        session.advantages()


def test_trainer_checkpoints_and_resumes_with_new_environments(task, tmp_path, tool_model):
    config = _config(task, tmp_path, max_steps=2, save_steps=1, disable_tqdm=True)
    trainer = GRPOTrainer(tool_model, args=config, train_dataset=task.train_dataset, environment_factory=Adder)
    trainer.train()
    logged = trainer.state.log_history
    assert "rewards/Adder/mean" in logged[0] and "tools/call_frequency" in logged[0]
    trainer.close()
    resumed = GRPOTrainer(tool_model, args=config, train_dataset=task.train_dataset, environment_factory=Adder)
    resumed.train(resume_from_checkpoint=tmp_path / "out" / "checkpoint-1")
    assert resumed.session.global_step == 2
    assert resumed.state.log_history[-2]["reward"] == pytest.approx(logged[1]["reward"])
    resumed.close()


def test_a_session_saves_its_factory_but_not_its_environments(task, tmp_path, tool_model):
    session = _session(task, tmp_path, tool_model, {"math": Adder}, reward_funcs=[seen_environments],
                       train_dataset=task.train_dataset.select(range(16)).add_column("environment", ["math"] * 16))
    session.generate()
    session.save(tmp_path / "saved")
    script = session.export_script(tmp_path / "train.py").read_text()
    assert "from tests.test_environments import Adder" in script and "environment_factory={'math': Adder}," in script
    assert "REWARD_FUNCS = [seen_environments]" in script
    loaded = GRPOSession.load(tmp_path / "saved")
    assert loaded.environment_factory == {"math": Adder} and loaded.reward_funcs[0] is seen_environments
    assert loaded.rollout is not None and loaded.rollout.environments is None
    with pytest.raises(ValueError, match="does not keep the environments"):
        loaded.score()
    loaded.discard_batch()
    loaded.generate()
    assert loaded.score().reward_names == ["seen_environments", "Adder"]


def test_evaluation_runs_each_completion_in_its_own_instance_of_an_eval_pool(task, tmp_path, tool_model):
    RECORDED.clear()
    eval_rows = task.eval_dataset.select(range(4))
    session = _session(task, tmp_path, tool_model, Adder, reward_funcs=[recorded], eval_dataset=eval_rows,
                       reward_weights=[2.0], **EVAL)
    rollout = session.generate()  # a training batch held across the evaluation, scored after it
    held = [(list(environment.resets), list(environment.calls)) for environment in rollout.environments]
    metrics = session.evaluate()
    assert {"eval_reward", "eval_loss", "eval_rewards/recorded/mean", "eval_rewards/Adder/mean"} <= set(metrics)
    assert metrics["eval_tools/call_frequency"] > 0
    # each completion's get_reward counts its own instance's calls; recorded's zeros weigh 2
    assert metrics["eval_rewards/Adder/mean"] == pytest.approx(metrics["eval_tools/call_frequency"])
    assert metrics["eval_reward"] == pytest.approx(metrics["eval_rewards/Adder/mean"])
    environments = session.engine.environments
    pool = environments.eval_pool[None]
    assert len(pool) == 4 and not {id(e) for e in pool} & {id(e) for e in environments.pool[None]}
    rows = eval_rows.to_list()
    for position, environment in enumerate(pool):  # two chunks: rows 0, 0, 1, 1 then 2, 2, 3, 3
        assert environment.resets == [rows[position // 2], rows[2 + position // 2]]
    prompts, scored = RECORDED[-1]
    assert [id(e) for e in scored] == [id(e) for e in pool] and prompts == [rows[2]["prompt"]] * 2 + [
        rows[3]["prompt"]] * 2
    assert [(environment.resets, environment.calls) for environment in rollout.environments] == held
    assert session.score().rewards_BF[:, 1].tolist() == [float(len(calls)) for _, calls in held]
    session.evaluate()  # the eval pool is reused, not grown
    assert environments.eval_pool[None] == pool and [len(e.resets) for e in pool] == [4] * 4


def test_evaluation_scores_the_eval_prompts_with_their_observations(task, tmp_path):
    RECORDED.clear()
    eval_rows = task.eval_dataset.select(range(4))
    session = _session(task, tmp_path, task.model, Hint, reward_funcs=[recorded, task.reward_funcs[0]],
                       eval_dataset=eval_rows, **EVAL)
    metrics = session.evaluate()
    assert {"eval_rewards/recorded/mean", "eval_rewards/correctness_reward/mean"} <= set(metrics)
    expected = []
    for row in eval_rows:
        text = row["prompt"][0]["content"] + " (odd)" * (int(row["answer"]) % 2)
        expected += [[{"role": "user", "content": text}]] * 2
    assert [prompt for prompts, _ in RECORDED for prompt in prompts] == expected
    assert any("(odd)" in prompt[0]["content"] for prompt in expected)


def test_a_dict_of_environments_routes_eval_rows_by_their_environment_column(task, tmp_path, tool_model):
    factories = {"math": Adder, "shout": Shouter}
    data = task.train_dataset.select(range(16)).add_column("environment", ["math", "shout"] * 8)
    eval_rows = task.eval_dataset.select(range(4)).add_column("environment", ["shout", "math", "math", "shout"])
    with pytest.raises(ValueError, match="eval_dataset needs an 'environment' column"):
        _session(task, tmp_path, tool_model, factories, train_dataset=data, eval_dataset=task.eval_dataset)
    session = _session(task, tmp_path, tool_model, factories, train_dataset=data, eval_dataset=eval_rows,
                       num_generations=2, **EVAL)
    metrics = session.evaluate()
    assert metrics["eval_rewards/Shouter/mean"] == -1.0 and "eval_rewards/Adder/mean" in metrics
    rows = [{key: value for key, value in row.items() if key != "environment"} for row in eval_rows]
    pools = session.engine.environments.eval_pool
    assert [type(e) for e in pools["math"]] == [Adder] * 2 and [type(e) for e in pools["shout"]] == [Shouter] * 2
    assert [e.resets for e in pools["math"]] == [[rows[1], rows[2]]] * 2
    assert [e.resets for e in pools["shout"]] == [[rows[0], rows[3]]] * 2
    assert session.evaluate({"mixed": eval_rows})["eval_mixed_rewards/Shouter/mean"] == -1.0
    with pytest.raises(ValueError, match=r"eval_dataset\['plain'\] needs an 'environment' column"):
        session.evaluate({"plain": task.eval_dataset})


def _no_time(frame):
    return frame.drop(columns=["step_time"])


def test_a_trainer_evaluates_with_environments_and_trains_as_without_evaluating(task, tmp_path, tool_model):
    trainers = []
    for schedule in ({}, dict(eval_strategy="steps", eval_steps=1, eval_on_start=True)):
        config = _config(task, tmp_path / str(len(trainers)), max_steps=2, disable_tqdm=True, **EVAL, **schedule)
        trainers.append(GRPOTrainer(tool_model, args=config, train_dataset=task.train_dataset,
                                    eval_dataset=task.eval_dataset.select(range(4)) if schedule else None,
                                    environment_factory=Adder))
        trainers[-1].train()
    plain, evaluated = trainers
    evaluations = [row for row in evaluated.state.log_history if "eval_reward" in row]
    assert [row["step"] for row in evaluations] == [0, 1, 2]
    assert all("eval_rewards/Adder/mean" in row and "eval_tools/call_frequency" in row for row in evaluations)
    pd.testing.assert_frame_equal(_no_time(evaluated.session.history), _no_time(plain.session.history))
    for (name, a), (_, b) in zip(plain.model.state_dict().items(), evaluated.model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    plain_pool, evaluated_pool = (trainer.session.engine.environments.pool[None] for trainer in trainers)
    assert [e.resets for e in evaluated_pool] == [e.resets for e in plain_pool]
    for trainer in trainers:
        trainer.close()
