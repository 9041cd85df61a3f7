"""Environments (TRL's ``environment_factory``): stateful objects whose methods are the model's tools.

An environment is an object with a ``reset(**row)`` method; its other public methods are tools the
model may call (with the type hints and docstring ``tools=`` functions need), and an optional
``get_reward()`` scores a finished rollout from the environment's state. ``environment_factory`` is
a callable that builds one (usually the class), or a dict ``{name: factory}``, in which case each
dataset row names its environment in an ``environment`` column and sees only that one's tools.

Each completion gets its own instance, so that the rollouts of a batch never share state. The
instances live in a pool per environment and are reused from batch to batch ("construct once,
reset often"): a batch draws them in order, and a new one is built only when the pool is short.
One instance of each environment is built when the session is, to check it and to read its tools,
and starts the pool. Before generation every drawn instance is reset with its row's fields (the
dataset row as the sampler drew it, ``prompt`` included where the dataset has one, without
``environment`` for a dict of factories); a string it returns is appended to the content of the
prompt's last message, which the model then sees.

Each environment class that defines ``get_reward`` becomes one more reward function, named after
the class and weighted 1 (``reward_weights`` still lists only ``reward_funcs``): it returns the
``get_reward()`` of every completion whose instance is of that class exactly, and None for the
others. Every reward function receives the batch's instances as ``environments=``, one per completion.

Evaluation runs the same way (reset with the eval row's fields, observations appended, the
instances' methods as tools, ``get_reward`` and ``environments=`` in scoring), but draws from a
pool of its own. TRL 1.16 keeps one pool for training and evaluation and relies on ``reset()``
before every use, which leaves an instance as ``reset()`` makes it but not an environment that
keeps state across episodes on purpose (a curriculum, a cache, a count of episodes): that state
would take in the eval rows. A session may also hold a generated batch across ``evaluate()`` and
score it afterwards, when shared instances would hold eval episodes. So evaluation never touches
an instance training uses: its instances are built the first time an evaluation needs them and
reused by later evaluations.
"""

from __future__ import annotations

import asyncio
import inspect

from grpo_lab.rollout.prompts import is_conversational, prompt_problem
from grpo_lab.rollout.tools import ToolCalling, check_tools
from grpo_lab.core.stream_sampler import first_row, is_stream

PLACEHOLDER_PROMPT = [{"role": "user", "content": ""}]
"""The prompt of a row that has none (no ``prompt`` column, or no dataset): an empty user message
that the environment's ``reset()`` observation fills in."""

_NOT_TOOLS = ("reset", "get_reward")


def _public_methods(cls) -> list[str]:
    """The names of the tools an environment class offers: the functions it defines or inherits,
    all but reset, get_reward and private ones (read on the class, since reading them on an
    instance would run its properties)."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in _NOT_TOOLS and not name.startswith("_")]


def _reward_source(cls, is_async: bool):
    """The reward function behind ``cls.get_reward``: one value per completion, that of its instance
    where the instance's class is exactly ``cls`` (a subclass registered too keeps its own column),
    else None."""
    if is_async:
        async def reward(environments, **kwargs):
            own = [index for index, environment in enumerate(environments) if type(environment) is cls]
            values = await asyncio.gather(*(environments[index].get_reward() for index in own))
            found = dict(zip(own, values, strict=True))
            return [found.get(index) for index in range(len(environments))]
    else:
        def reward(environments, **kwargs):
            return [environment.get_reward() if type(environment) is cls else None for environment in environments]
    reward.__name__ = reward.__qualname__ = cls.__name__
    return reward


def _observed(prompt, observation, environment, position: int):
    """``prompt`` with ``observation`` (what ``reset()`` returned) appended to its last message's
    content; a string is appended to a content of text parts as one more part, and a list of parts
    turns a string content into parts, as TRL does. None leaves the prompt as it is."""
    if observation is None:
        return prompt
    name = type(environment).__name__
    if not isinstance(observation, (str, list)):
        raise TypeError(f"{name}.reset() returned {type(observation).__name__} ({str(observation)[:80]!r}): return "
                        "a string to append to the prompt (or a list of text parts), or None to leave it as it is.")
    if not is_conversational(prompt):
        raise ValueError(
            f"{name}.reset() returned an observation for completion {position}, whose prompt is text, not chat "
            "messages: the observation is appended to the last message of a conversational prompt. Give prompts as "
            "lists of messages, or return None from reset()."
        )
    content = prompt[-1]["content"] or ""
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]


class Environments:
    """The environments of a run: their factories, the pool of instances, the tools and reward
    functions they bring, and the instances drawn for the batch being generated (``batch``).

    ``environment_factory`` is checked by building one instance of each environment; ``tools`` are
    the run's ``tools=`` functions, offered beside every environment's own methods. ``pool`` holds
    the instances training draws, ``eval_pool`` those evaluation draws (see the module docstring)."""

    def __init__(self, environment_factory, tools: list | None):
        self.factory = environment_factory
        self.multi = isinstance(environment_factory, dict)
        self.factories = dict(environment_factory) if self.multi else {None: environment_factory}
        self.standalone = list(tools or [])
        self.pool: dict = {}
        self.eval_pool: dict = {name: [] for name in self.factories}
        self.reward_funcs: list = []
        self.batch: list = []
        self._methods: dict[type, list[str]] = {}
        rewarded: list[type] = []  # one reward function per class, however many names map to it
        for name, factory in self.factories.items():
            instance = factory()
            label = "environment_factory()" if name is None else f"environment_factory[{name!r}]()"
            if not callable(getattr(instance, "reset", None)):
                raise ValueError(
                    f"{label} returned a {type(instance).__name__} without a callable reset(): every environment "
                    "needs a reset(self, **kwargs) method, called with the dataset row's fields before each rollout "
                    "(return None, or a string to append to the prompt)."
                )
            self.pool[name] = [instance]
            get_reward = getattr(instance, "get_reward", None)
            if callable(get_reward) and type(instance) not in rewarded:
                rewarded.append(type(instance))
                self.reward_funcs.append(_reward_source(type(instance), inspect.iscoroutinefunction(get_reward)))

    def tools_of(self, environment) -> list:
        """What a completion using ``environment`` may call: the ``tools=`` functions, then the
        instance's public methods, bound to it."""
        cls = type(environment)
        if cls not in self._methods:
            self._methods[cls] = _public_methods(cls)
        return self.standalone + [getattr(environment, name) for name in self._methods[cls]]

    def probe_tools(self) -> dict:
        """Each environment's tools, as its first instance offers them: ``{name: tools}``."""
        return {name: self.tools_of(pool[0]) for name, pool in self.pool.items()}

    def batch_tools(self) -> list[list]:
        """The tools of each completion of the batch being generated."""
        return [self.tools_of(environment) for environment in self.batch]

    def draw(self, names: list, pools: dict) -> list:
        """One instance per entry of ``names`` (environment names), distinct within the call: those of
        ``pools`` (``pool`` or ``eval_pool``), in order, and new ones where a pool has too few."""
        handed: dict = {}
        drawn = []
        for name in names:
            pool, index = pools[name], handed.get(name, 0)
            if index == len(pool):
                pool.append(self.factories[name]())
            handed[name] = index + 1
            drawn.append(pool[index])
        return drawn

    def start(self, rows: dict[str, list], evaluation: bool = False) -> tuple[list, list]:
        """``(prompts, environments)`` of a batch about to be generated, from its ``rows`` (column ->
        one value per completion): an instance drawn for every completion (from ``eval_pool`` for an
        ``evaluation`` batch) and reset with its row's fields, and the prompts with what ``reset()``
        returned appended."""
        count = len(next(iter(rows.values()))) if rows else 0
        self.batch = environments = self.draw(self._names(rows, count), self.eval_pool if evaluation else self.pool)
        given = rows.get("prompt", [PLACEHOLDER_PROMPT] * count)
        prompts = []
        for position, environment in enumerate(environments):
            fields = {key: values[position] for key, values in rows.items()
                      if not (self.multi and key == "environment")}
            prompt = _observed(given[position], environment.reset(**fields), environment, position)
            problem = prompt_problem(prompt)
            if problem is not None:
                raise ValueError(
                    f"After {type(environment).__name__}.reset(), the prompt of completion {position} {problem}. Give "
                    "the row a prompt, or return the prompt's text from reset() (it is appended to the last message)."
                )
            prompts.append(prompt)
        return prompts, environments

    def _names(self, rows: dict[str, list], count: int) -> list:
        """The environment of each of ``count`` completions: the ``environment`` column's with a dict
        of factories, checked against its names."""
        if not self.multi:
            return [None] * count
        if "environment" not in rows:
            raise ValueError(f"environment_factory is a dict of environments ({', '.join(map(repr, self.factories))}), "
                             "so each row must name its own in an 'environment' column; these rows have none.")
        unknown = [name for name in rows["environment"] if not any(name == known for known in self.factories)]
        if unknown:
            raise ValueError(
                f"A row has environment={unknown[0]!r}, which is not among the environments given to "
                f"environment_factory: expected one of {list(self.factories)}."
            )
        return list(rows["environment"])

    def scoring_columns(self, rollout) -> dict[str, list]:
        """``rollout``'s columns for the reward functions, with ``environments``: the instances its
        completions ran in. A batch restored from a checkpoint has none (they are live objects,
        never saved), so it cannot be scored again."""
        if rollout.environments is None:
            raise ValueError(
                "This generation batch was restored from a checkpoint or a state_dict, which does not keep the "
                "environments its completions ran in, so the reward functions cannot receive environments=. "
                "Call session.discard_batch() and generate() a new batch."
            )
        return {**rollout.columns, "environments": list(rollout.environments)}

    def user_reward_funcs(self, funcs: list) -> list:
        """``funcs`` without the environments' own reward functions: what the user passed as reward_funcs."""
        return [func for func in funcs if not any(func is own for own in self.reward_funcs)]


def user_reward_funcs(engine) -> list:
    """The reward functions ``engine``'s run was given (an environment's ``get_reward`` comes with
    the environment): what a checkpoint or an exported script records."""
    environments = engine.environments
    return list(engine.reward_funcs) if environments is None else environments.user_reward_funcs(engine.reward_funcs)


def environment_rollout(tools, environment_factory, tokenizer, eos_token_ids: set[int], train_dataset,
                        chat_template_kwargs: dict | None):
    """``(tools, custom_rollout, environments)`` of a run with ``environment_factory``: the checked
    ``tools=`` functions, the tool loop (None where neither the environments nor ``tools=`` offer a
    tool: the backend generates), and the :class:`Environments`, whose first instances are built
    here. Each environment's tools (``tools=`` included) are checked as ``tools=`` are."""
    first = first_row(train_dataset) if is_stream(train_dataset) else train_dataset[0]
    prompt = first.get("prompt", PLACEHOLDER_PROMPT)
    if tools is not None:
        tools = check_tools(tools, tokenizer, prompt, chat_template_kwargs)
    environments = Environments(environment_factory, tools)
    offered = {}
    for name, environment_tools in environments.probe_tools().items():
        if not environment_tools:
            continue
        try:
            check_tools(environment_tools, tokenizer, prompt, chat_template_kwargs)
        except (TypeError, ValueError) as error:
            raise type(error)(
                f"The public methods of {type(environments.pool[name][0]).__name__} (all but reset and get_reward) "
                f"are the model's tools, beside any tools=: {error} Name a method that is no tool with a leading _."
            ) from error
        offered.update({tool.__name__: tool for tool in environment_tools})
    if not offered:
        return tools, None, environments
    return tools, ToolCalling(list(offered.values()), tokenizer, eos_token_ids, chat_template_kwargs, environments), \
        environments


def check_environment_setup(environment_factory, *, train_dataset, eval_dataset, rollout_func, max_steps: int) -> None:
    """Refuse, before the model loads, an ``environment_factory`` that is neither a callable nor a
    dict of them, or one given with a rollout function, or a train_dataset or eval set (one, or a
    dict of named sets) that cannot drive it."""
    multi = isinstance(environment_factory, dict)
    factories = environment_factory.values() if multi else [environment_factory]
    if not (callable(environment_factory) or multi) or not factories or not all(callable(f) for f in factories):
        raise TypeError("environment_factory must be a callable that returns an environment (e.g. its class), or a "
                        "non-empty dict {name: factory} whose rows name theirs in an 'environment' column.")
    if rollout_func is not None:
        raise ValueError("Give environment_factory or rollout_func, not both: the environments run in grpo_lab's tool "
                         "loop, which takes the rollout function's place.")
    named_sets = eval_dataset.items() if isinstance(eval_dataset, dict) else [(None, eval_dataset)]
    for name, dataset in named_sets:
        if dataset is not None:
            check_environment_columns(dataset, "eval_dataset" if name is None else f"eval_dataset[{name!r}]",
                                      environment_factory)
    if train_dataset is None:
        if multi:
            raise ValueError(
                "A dict environment_factory (several environments) needs a train_dataset with an 'environment' "
                "column that routes each row to its environment. Give one, or pass a single environment factory."
            )
        if max_steps <= 0:
            raise ValueError(
                "Without a train_dataset (the environment supplies each prompt from reset()), max_steps must be set "
                "to a positive number of steps, which the run's length is. Set GRPOConfig(max_steps=...)."
            )
        return
    check_environment_columns(train_dataset, "train_dataset", environment_factory)


def check_environment_columns(dataset, label: str, environment_factory) -> None:
    """Refuse a dataset (named ``label``) whose columns cannot drive ``environment_factory``: one
    without an 'environment' column for a dict of factories, or one with an 'environments' column."""
    columns = getattr(dataset, "column_names", None) or []  # a stream may not declare them
    if isinstance(environment_factory, dict) and columns and "environment" not in columns:
        raise ValueError(
            f"environment_factory is a dict of environments ({', '.join(map(repr, environment_factory))}): "
            f"{label} needs an 'environment' column naming each row's environment."
        )
    if "environments" in columns:
        raise ValueError(f"{label} has a column named 'environments', the keyword argument that passes the "
                         "environment instances to reward functions. Rename the column.")


def placeholder_dataset(rows: int):
    """The train_dataset of a run whose environment supplies the prompts: ``rows`` empty user
    messages (one generation batch's prompts), drawn over and over."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [PLACEHOLDER_PROMPT] * rows})


def reward_sources(reward_funcs, reward_processing_classes, environments: Environments | None):
    """``(funcs, processing_classes)``: ``reward_funcs`` (None, one, or a list) followed by the
    environments' reward functions; a run with neither is refused."""
    funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) \
        else [reward_funcs]
    own = [] if environments is None else environments.reward_funcs
    if not funcs and not own:
        raise ValueError("No reward source: pass reward_funcs, or an environment_factory whose environment defines "
                         "get_reward() (no arguments, returns a float; called once per rollout).")
    if not own:
        return funcs, reward_processing_classes
    classes = reward_processing_classes
    if classes is None or not isinstance(classes, (list, tuple)):
        classes = [classes] * len(funcs)
    return funcs + own, list(classes) + [None] * len(own)
