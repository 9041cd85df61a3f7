"""Tool calling during generation (TRL's ``tools=`` and ``max_tool_calling_iterations``).

:class:`ToolCalling` is a rollout function (see :mod:`grpo_lab.rollout.custom`): it samples the
completions, parses each for tool calls with the tokenizer's ``response_template``
(``tokenizer.parse_response``; one is set for the chat templates :mod:`grpo_lab.rollout.response_formats`
recognises), runs the tools, appends their results as the chat template renders
tool messages, and samples the model's next turn from the whole conversation so far, as token ids
(never re-tokenized), until no completion calls a tool or ``max_tool_calling_iterations`` rounds
have run. The tool results are context for the next turn but are not trained on (``env_mask`` 0),
and a completion, tool results included, stays within max_completion_length: a result that would
leave no room for at least one answer token is dropped and that completion ends with its call (TRL
drops one that overflows, and keeps one that fills the budget exactly).
"""

from __future__ import annotations

import inspect

import torch

from grpo_lab import notices
from grpo_lab.parallel import dist
from grpo_lab.coroutines import run_coroutines
from grpo_lab.parallel.layout import layout_for
from grpo_lab.rollout.prompts import is_conversational, render_prompts
from grpo_lab.rollout.response_formats import FORMATS, known_response_template


def _schema(tool) -> dict:
    from transformers.utils import get_json_schema

    name = getattr(tool, "__name__", repr(tool))
    try:
        return get_json_schema(tool)
    except Exception as error:  # transformers raises its own types for missing docstrings and type hints
        raise ValueError(
            f"Tool {name!r} cannot be described to the model: {error}. A tool needs type hints on every "
            "argument and a Google-style docstring with an Args: section (the chat template renders its "
            "name, description and parameters from them)."
        ) from error


def _check_response_template(tokenizer) -> None:
    """A tokenizer that parses tool calls: one without a ``response_template`` gets the one for the
    format its chat template writes (as TRL sets one for the chat templates it knows), else it is refused."""
    known = known_response_template(getattr(tokenizer, "chat_template", None))
    if getattr(tokenizer, "response_template", None) is None and known is not None:
        tokenizer.response_template = known[1]
        notices.log_warning(f"tools: the tokenizer has no response_template; its chat template writes {known[0]}, "
                            "so that format's template parses the model's calls (set tokenizer.response_template "
                            "to choose another).")
    if getattr(tokenizer, "response_template", None) is None or not hasattr(tokenizer, "parse_response"):
        raise ValueError(
            "tools need a tokenizer that parses the model's tool calls: this one has no response_template "
            "(transformers' response parsing), and its chat template writes none of the tool-call formats "
            f"grpo_lab recognises ({', '.join(name for name, *_ in FORMATS)}). Set tokenizer.response_template "
            "to a template for your model's tool-call format and pass the tokenizer as processing_class."
        )


def check_tools(tools, tokenizer, train_prompt, chat_template_kwargs: dict | None) -> list:
    """The tools as a list, after checking what the loop needs: named callables that can be described
    to the model, a tokenizer that parses tool calls and a chat template that renders them, and
    conversational prompts."""
    if callable(tools) or isinstance(tools, (str, bytes, dict)) or not hasattr(tools, "__iter__"):
        raise TypeError(f"tools must be a list of functions, e.g. tools=[{getattr(tools, '__name__', 'my_tool')}].")
    tools = list(tools)
    names = [getattr(tool, "__name__", None) for tool in tools]
    if not tools or not all(callable(tool) and name for tool, name in zip(tools, names, strict=True)):
        raise TypeError("tools must be a non-empty list of named functions (sync or async) the model may call.")
    if len(set(names)) != len(names):
        raise ValueError(f"Two tools share a name ({', '.join(sorted({n for n in names if names.count(n) > 1}))}); "
                         "the model calls them by name.")
    for tool in tools:
        _schema(tool)
    _check_response_template(tokenizer)
    if "tools" in (chat_template_kwargs or {}):
        raise ValueError("chat_template_kwargs has a 'tools' entry: pass the functions as tools= instead.")
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": names[0], "arguments": {}}}]}
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}, call, {"role": "tool", "name": names[0], "content": "y"}],
            tools=tools, tokenize=False,
            **(chat_template_kwargs or {}),
        )
    except Exception as error:
        raise ValueError(
            "The tokenizer's chat template cannot render a tool-calling conversation "
            f"({type(error).__name__}: {error}). "
            "tools need a template that renders tools, an assistant message with tool_calls, and tool messages."
        ) from error
    if not is_conversational(train_prompt):
        raise ValueError(
            "tools need conversational prompts (lists of chat messages): the chat template renders the tools into "
            "the prompt and the tool results after each call."
        )
    kwargs = dict(tokenize=False, **(chat_template_kwargs or {}))
    if tokenizer.apply_chat_template(train_prompt, tools=tools, add_generation_prompt=True, **kwargs) == \
            tokenizer.apply_chat_template(train_prompt, add_generation_prompt=True, **kwargs):
        raise ValueError(
            "The tokenizer's chat template ignores tools: it renders the first training prompt with them as without "
            "them, so the model would never see its tools. Use a template that renders tools (a tool-calling model's "
            "own does)."
        )
    question = [{"role": "user", "content": "x"}]
    if tokenizer.apply_chat_template([*question, call], **kwargs) == \
            tokenizer.apply_chat_template([*question, {"role": "assistant", "content": ""}], **kwargs):
        raise ValueError(
            "The tokenizer's chat template drops an assistant message's tool_calls (it renders one as an empty "
            "message), so a call the model made would vanish from the conversation. Use a template that renders them."
        )
    return tools


class ToolCalling:
    """The rollout function behind ``tools=``: see the module docstring. ``tools`` are checked by
    :func:`check_tools`; the number of rounds is read from ``session.config`` at every call.

    With ``environments`` (a :class:`grpo_lab.rollout.environments.Environments`), each completion
    sees and calls the tools of its own environment instance, drawn for the batch being generated."""

    def __init__(self, tools: list, tokenizer, eos_token_ids: set[int], chat_template_kwargs: dict | None,
                 environments=None):
        self.tools, self.tokenizer, self.eos_token_ids = tools, tokenizer, eos_token_ids
        self.environments = environments
        # fails now, not mid-run
        self._suffix_ids([{"role": "tool", "name": tools[0].__name__, "content": "0"}], chat_template_kwargs)

    def __call__(self, prompts: list, session) -> dict:
        config = session.config
        tools_B = [self.tools] * len(prompts) if self.environments is None else self.environments.batch_tools()
        texts = self._render(prompts, tools_B, config.chat_template_kwargs)
        first = session.sample(texts)
        prompt_ids, completion_ids, logprobs = first["prompt_ids"], first["completion_ids"], first["logprobs"]
        env_mask = [[1] * len(ids) for ids in completion_ids]
        messages = [[self._parse(ids, prompt, tools)]
                    for ids, prompt, tools in zip(completion_ids, prompt_ids, tools_B, strict=True)]
        calls, failures = [0] * len(prompts), [0] * len(prompts)
        limit = getattr(session.model.config, "max_position_embeddings", None)
        accelerator = session.engine.accelerator
        # vLLM generates outside the shards
        lockstep = not config.use_vllm and layout_for(accelerator).generates_in_lockstep()
        rounds = config.max_tool_calling_iterations
        active = [row for row, turns in enumerate(messages) if turns[-1].get("tool_calls")]
        done = 0
        while True:
            contexts, budgets, results = {}, {}, {}
            for row in active if rounds is None or done < rounds else []:
                results[row] = self._run(messages[row][-1]["tool_calls"], calls, failures, row, tools_B[row])
                context = (prompt_ids[row] + completion_ids[row]
                           + self._suffix_ids(results[row], config.chat_template_kwargs))
                budget = config.max_completion_length - (len(context) - len(prompt_ids[row]))
                if limit is not None:
                    budget = min(budget, limit - len(context))
                if budget > 0:  # else the result is dropped: no room for an answer
                    contexts[row], budgets[row] = context, budget
            groups = _sampling_groups(contexts, budgets, limit)
            count = len(groups)
            if lockstep:  # every process makes as many generation calls as the busiest one
                count = int(dist.gather(accelerator, torch.tensor([count], device=accelerator.device)).max())
            if count == 0:
                break
            active = []
            for index in range(count):
                if index >= len(groups):  # a call the other processes make, on one throwaway token
                    session.sample([prompt_ids[0]], max_new_tokens=1)
                    continue
                rows, most = groups[index]
                turn = session.sample([contexts[row] for row in rows], max_new_tokens=most)
                for k, row in enumerate(rows):
                    new = turn["completion_ids"][k][:budgets[row]]
                    inserted = len(contexts[row]) - len(prompt_ids[row]) - len(completion_ids[row])
                    env_mask[row] += [0] * inserted + [1] * len(new)
                    if logprobs is not None:
                        logprobs[row] += [0.0] * inserted + turn["logprobs"][k][:budgets[row]]
                    completion_ids[row] = contexts[row][len(prompt_ids[row]):] + new
                    messages[row] += results[row]
                    if new:
                        messages[row].append(self._parse(new, contexts[row], tools_B[row]))
                        if messages[row][-1].get("tool_calls"):
                            active.append(row)
            done += 1
        return {
            "prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs, "env_mask": env_mask,
            "completions": messages, "tool_calls": calls, "tool_failures": failures,
        }

    def _render(self, prompts: list, tools_B: list[list], chat_template_kwargs: dict | None) -> list[str]:
        """The prompt texts, each rendered with the tools its completion may call (none: no tool schema)."""
        shared = tools_B[0] if tools_B else self.tools
        if all(tools is shared for tools in tools_B):
            return render_prompts(prompts, self.tokenizer, chat_template_kwargs, tools=shared or None)
        return [render_prompts([prompt], self.tokenizer, chat_template_kwargs, tools=tools or None)[0]
                for prompt, tools in zip(prompts, tools_B, strict=True)]

    def _parse(self, ids: list[int], prefix: list[int], tools: list) -> dict:
        """The assistant message of a turn, its tool calls parsed; plain text where they do not parse
        (a malformed call is the model's mistake, which the reward may judge)."""
        try:
            message = self.tokenizer.parse_response(ids, prefix=prefix, tools=tools)
        except Exception:
            return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}
        return {"role": "assistant", "content": message.get("content") or "",
                **({"tool_calls": calls} if calls else {})}

    def _run(self, tool_calls: list[dict], calls: list[int], failures: list[int], row: int,
             tools: list) -> list[dict]:
        """The tool messages answering ``tool_calls`` with ``tools`` (the row's), in order; a call that
        fails answers with its error."""
        by_name = {tool.__name__: tool for tool in tools}
        answers, pending = [], {}
        for position, call in enumerate(tool_calls):
            calls[row] += 1
            function = call.get("function") if call.get("type", "function") == "function" else None
            name = function.get("name") if isinstance(function, dict) else call.get("name", "unknown")
            try:
                if function is None:
                    raise ValueError(f"Unsupported tool call type: {call.get('type')!r}")
                if name not in by_name:
                    raise ValueError(f"Tool {name} not found.")
                arguments = function.get("arguments") or {}
                if not isinstance(arguments, dict):
                    raise TypeError(f"arguments must be an object, got {arguments!r}")
                result = by_name[name](**arguments)
                if inspect.isawaitable(result):
                    pending[position] = result
            except Exception as error:
                failures[row] += 1
                result = {"error": str(error)}
            answers.append([name, result])
        if pending:
            for position, outcome in zip(pending, run_coroutines([_settled(c) for c in pending.values()]), strict=True):
                if isinstance(outcome, Exception):
                    failures[row] += 1
                    outcome = {"error": str(outcome)}
                answers[position][1] = outcome
        return [{"role": "tool", "name": name, "content": str(result)} for name, result in answers]

    def _suffix_ids(self, tool_messages: list[dict], chat_template_kwargs: dict | None) -> list[int]:
        """The tokens the chat template puts after an assistant turn that called tools: the tool
        messages and the next assistant turn's header, taken as the difference of two renderings."""
        call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": call}]
        kwargs = dict(tokenize=True, return_dict=False, **(chat_template_kwargs or {}))
        prefix = list(self.tokenizer.apply_chat_template(before, add_generation_prompt=False, **kwargs))
        full = list(self.tokenizer.apply_chat_template(before + tool_messages, add_generation_prompt=True, **kwargs))
        ends = [i for i, token in enumerate(prefix) if token in self.eos_token_ids]
        if ends:  # the model's turn ends at its EOS: what follows the same EOS in the longer rendering is the suffix
            # (by count, not position: some templates render the turn itself differently once it is not the last,
            # e.g. Qwen3 drops an empty thinking block)
            full_ends = [i for i, token in enumerate(full) if token in self.eos_token_ids]
            if len(full_ends) > len(ends):
                return full[full_ends[len(ends) - 1] + 1:]
        elif full[: len(prefix)] == prefix:
            return full[len(prefix):]
        raise ValueError(
            "The chat template's rendering of tool messages after an assistant turn could not be told apart from the "
            "turn, so the tool results cannot be appended to the model's tokens. Use a template whose turns end with "
            "an EOS token, or that keeps earlier turns as they are."
        )


def _sampling_groups(contexts: dict[int, list[int]], budgets: dict[int, int],
                     limit: int | None) -> list[tuple[list[int], int]]:
    """The generation calls of one round, as ``(rows, max_new_tokens)``: as few as keep every row's
    budget within the model's ``limit`` (a call pads its contexts to the longest), so that a long
    context does not shorten the others' answers; usually one."""
    groups: list[tuple[list[int], int]] = []
    longest = 0
    for row in sorted(contexts, key=lambda r: -len(contexts[r])):  # each group's first row is its longest
        if groups and (limit is None or longest + max(groups[-1][1], budgets[row]) <= limit):
            groups[-1] = (groups[-1][0] + [row], max(groups[-1][1], budgets[row]))
        else:
            groups.append(([row], budgets[row]))
            longest = len(contexts[row])
    return [(sorted(rows), most) for rows, most in groups]


async def _settled(awaitable):
    """``awaitable``'s result, or the exception it raised (returned, so one failing tool does not cancel the others)."""
    try:
        return await awaitable
    except Exception as error:
        return error
