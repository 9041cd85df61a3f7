"""Response templates for known chat templates: a tokenizer without a ``response_template`` gets the
one for the tool-call format its chat template writes. Checked against the real chat templates of
the model families (the copies TRL, a test dependency, ships): calls rendered by each template parse
back to the same calls, arguments typed by the tool's schema, and reasoning and answers to the same
text."""

import copy
import json
import os.path
from pathlib import Path

import pytest
import trl
from transformers import AutoTokenizer

from grpo_lab import GRPOSession
from grpo_lab.rollout import response_formats
from grpo_lab.rollout.tools import check_tools
from tests.conftest import SMALL

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
RECOGNISED = {
    "qwen2_5": "ChatML with JSON tool calls", "qwen3": "ChatML with JSON tool calls",
    "qwen3_instruct_2507": "ChatML with JSON tool calls", "qwen3_vl": "ChatML with JSON tool calls",
    "qwen3_5_think": "ChatML with XML tool calls", "qwen3_5_nothink": "ChatML with XML tool calls",
    "qwen3_6": "ChatML with XML tool calls", "qwen3_8": "ChatML with XML tool calls",
    "nemotron_3_nano": "ChatML with XML tool calls", "nemotron_3_super": "ChatML with XML tool calls",
    "llama3_1": "Llama 3 JSON tool calls", "llama3_2": "Llama 3 JSON tool calls",
    "glm4moe": "GLM-4 XML tool calls",
}
# lfm2 renders no calls; muse_glimmer's harmony-like protocol and gemma (1 and 2) are other formats
NOT_RECOGNISED = ["gemma3", "phi3", "cohere2", "llama3", "deepseekv3", "smolvlm", "lfm2", "muse_glimmer", "gemma"]
GPT_OSS, GEMMA4, LFM2 = "GPT-OSS harmony tool calls", "Gemma 4 tool calls", "LFM2.5 Python-style tool calls"
# chat template: (format, reasoning written in a turn with calls, most calls written per turn)
MORE_FORMATS = {
    "gptoss": (GPT_OSS, True, 1),
    "gemma4": (GEMMA4, True, 2), "gemma4_v2": (GEMMA4, False, 2), "gemma4_v3": (GEMMA4, True, 2),
    "gemma4_v4": (GEMMA4, True, 2), "gemma4_v5": (GEMMA4, True, 2), "diffusion_gemma": (GEMMA4, True, 2),
    "lfm2_v2": (LFM2, False, 2), "lfm2_2_5": (LFM2, True, 2), "lfm2_2_5_v2": (LFM2, True, 2),
    "lfm2_2_5_vl": (LFM2, True, 2),
}
REASONING_FIELD = {GPT_OSS: "thinking", GEMMA4: "reasoning_content", LFM2: "thinking"}
QUESTION = [{"role": "user", "content": "Find 12 places in New York, then search for rain."}]
THINKING, ANSWER = "Look the city up first, then search.", "There are 12, and rain for 2 days."
CALLS = [{"type": "function", "function": {"name": "lookup", "arguments": {"count": 12, "city": "New York"}}},
         {"type": "function", "function": {"name": "lookup", "arguments": {"count": 3, "city": "Paris"}}}]


def lookup(count: int, city: str) -> str:
    """Looks a city up.

    Args:
        count: How many results.
        city: The city's name.
    """
    return city * count


def search(query: str, limit: int, ratio: float, exact: bool, tags: list[str], options: dict) -> str:
    """Searches the forecasts.

    Args:
        query: What to search for.
        limit: How many results.
        ratio: The share of results to keep.
        exact: Whether to match the query exactly.
        tags: Tags the results must have.
        options: Further options.
    """
    return query


TOOLS = [lookup, search]
TYPED_CALLS = [
    {"type": "function", "function": {"name": "lookup", "arguments": {"count": 12, "city": "New York"}}},
    {"type": "function", "function": {"name": "search", "arguments": {
        "query": "rain, 2 days: (Paris)", "limit": 3, "ratio": 0.25, "exact": False, "tags": ["a", "b c"],
        "options": {"hours": [6, 18.5], "units": {"metric": True, "name": "SI"}}}}},
]


@pytest.fixture(scope="module")
def tokenizer(task):
    return AutoTokenizer.from_pretrained(task.model)


def _with_template(tokenizer, name: str):
    chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    found = response_formats.known_response_template(chat_template)
    copied = copy.deepcopy(tokenizer)
    copied.chat_template = chat_template
    return copied, found


def _recognised(tokenizer, name: str, expected: str):
    """The tokenizer with chat template ``name``, its response template set to the one found for it."""
    tok, found = _with_template(tokenizer, name)
    assert found is not None and found[0] == expected
    tok.response_template = found[1]
    return tok


def _written(tok, messages: list[dict], turn: dict, tools=None) -> tuple[str, str]:
    """The text before ``turn`` and the text the model writes for it, as the chat template renders
    them: a template that prefills part of the turn in the prompt and renders a past turn without it
    shares the prompt up to there."""
    prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    whole = tok.apply_chat_template([*messages, turn], tools=tools, tokenize=False)
    shared = os.path.commonprefix([prompt, whole])
    return shared, whole[len(shared):]


def _parse(tok, before: str, written: str, tools=None) -> dict:
    ids = tok(written, add_special_tokens=False)["input_ids"]
    return tok.parse_response(ids, prefix=tok(before, add_special_tokens=False)["input_ids"], tools=tools)


def _as_json(calls: list[dict]) -> str:
    """The calls' functions as JSON, which tells 1 from True and 2 from 2.0 where == does not."""
    return json.dumps([call["function"] for call in calls], sort_keys=True)


@pytest.mark.parametrize("name", sorted(RECOGNISED))
def test_calls_a_chat_template_writes_parse_back_to_the_same_calls(tokenizer, name):
    tok, found = _with_template(tokenizer, name)
    assert found is not None and found[0] == RECOGNISED[name]
    tok.response_template = found[1]
    calls = CALLS[:1] if name.startswith("llama") else CALLS  # Llama 3 writes one call per turn
    messages = [{"role": "user", "content": "Find 12 in New York and 3 in Paris."}]
    prompt = tok.apply_chat_template(messages, tools=[lookup], add_generation_prompt=True, tokenize=False)
    whole = tok.apply_chat_template(messages + [{"role": "assistant", "content": "", "tool_calls": calls}],
                                    tools=[lookup], tokenize=False)
    # what the model writes after its prompt (a template that prefills "<think>" in the prompt and
    # renders a past turn without it shares the prompt up to there)
    shared = os.path.commonprefix([prompt, whole])
    written = tok(whole[len(shared):], add_special_tokens=False)["input_ids"]
    message = tok.parse_response(written, prefix=tok(shared, add_special_tokens=False)["input_ids"], tools=[lookup])
    assert [call["function"] for call in message["tool_calls"]] == [call["function"] for call in calls]


def test_an_answer_without_a_call_parses_to_its_text_after_the_thinking(tokenizer):
    tok, found = _with_template(tokenizer, "qwen3")
    tok.response_template = found[1]
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+3?"}], add_generation_prompt=True,
                                     tokenize=False)
    written = tok("<think>\nadd them\n</think>\n\nThe sum is 5.<|im_end|>", add_special_tokens=False)["input_ids"]
    message = tok.parse_response(written, prefix=tok(prompt, add_special_tokens=False)["input_ids"])
    assert message["content"] == "The sum is 5." and "tool_calls" not in message


def test_a_format_whose_parser_the_installed_transformers_lacks_is_passed_over():
    assert all(response_formats._parsers_installed(template) for *_, template in response_formats.FORMATS)
    assert not response_formats._parsers_installed({"fields": {"tool_calls": {"content": "no-such-parser"}}})


@pytest.mark.parametrize("name", NOT_RECOGNISED)
def test_other_chat_templates_are_left_to_the_user(tokenizer, name):
    assert _with_template(tokenizer, name)[1] is None


def test_a_session_with_tools_sets_the_template_its_tokenizer_lacks(task, tmp_path, tokenizer):
    tok, found = _with_template(tokenizer, "qwen3")
    assert getattr(tok, "response_template", None) is None
    config = task.config(**{**SMALL, "output_dir": str(tmp_path)})
    GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset, processing_class=tok,
                tools=[lookup])
    assert tok.response_template == found[1] == response_formats.CHATML_JSON


@pytest.mark.parametrize("count", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(MORE_FORMATS))
def test_calls_reasoning_and_answers_of_more_formats_parse_back(tokenizer, name, count):
    kind, reasons_with_calls, most = MORE_FORMATS[name]
    tok = _recognised(tokenizer, name, kind)
    calls = TYPED_CALLS[:count]
    turn = {"role": "assistant", "content": "" if calls else ANSWER, "thinking": THINKING,
            "reasoning_content": THINKING, **({"tool_calls": calls} if calls else {})}
    before, written = _written(tok, QUESTION, turn, TOOLS)
    message = _parse(tok, before, written, TOOLS)
    assert _as_json(message.get("tool_calls", [])) == _as_json(calls[:most])
    assert message.get("content", "") == ("" if calls else ANSWER)
    # the reasoning comes back where the template wrote it (not every revision writes it in every turn)
    assert message.get(REASONING_FIELD[kind]) == (THINKING if THINKING in written else None)
    if calls and reasons_with_calls:
        assert THINKING in written


@pytest.mark.parametrize("name", sorted(MORE_FORMATS))
def test_the_answer_after_the_tool_results_parses(tokenizer, name):
    tok = _recognised(tokenizer, name, MORE_FORMATS[name][0])
    conversation = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": TYPED_CALLS[:1]},
                    {"role": "tool", "name": "lookup", "content": "12 places"}]
    message = _parse(tok, *_written(tok, conversation, {"role": "assistant", "content": ANSWER}, TOOLS), TOOLS)
    assert message.get("content") == ANSWER and "tool_calls" not in message


def test_gpt_oss_calls_with_the_recipient_after_the_channel_parse(tokenizer):
    # the chat template writes "<|start|>assistant to=functions.NAME<|channel|>commentary json"; the
    # models also write the recipient after the channel, with the content type constrained
    tok = _recognised(tokenizer, "gptoss", GPT_OSS)
    prompt = tok.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    arguments = TYPED_CALLS[1]["function"]["arguments"]
    written = (f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>commentary "
               f"to=functions.search <|constrain|>json<|message|>{json.dumps(arguments)}<|call|>")
    message = _parse(tok, prompt, written, TOOLS)
    assert _as_json(message["tool_calls"]) == _as_json(TYPED_CALLS[1:]) and message["thinking"] == THINKING


@pytest.mark.parametrize(("name", "escapes"), [("lfm2_v2", True), ("lfm2_2_5_vl", True), ("lfm2_2_5", False)])
def test_lfm2_strings_with_quotes_and_line_breaks_parse_where_the_template_escapes_them(tokenizer, name, escapes):
    tok = _recognised(tokenizer, name, LFM2)
    calls = [{"type": "function", "function": {"name": "lookup", "arguments": {"count": 2, "city": "O'Hare\\\nGate"}}}]
    before, written = _written(tok, QUESTION, {"role": "assistant", "content": "", "tool_calls": calls}, TOOLS)
    if escapes:
        assert _as_json(_parse(tok, before, written, TOOLS)["tool_calls"]) == _as_json(calls)
    else:  # written as they are, the quote ends the string early
        with pytest.raises(ValueError, match="python-call-list"):
            _parse(tok, before, written, TOOLS)


@pytest.mark.parametrize(("name", "writes_null"), [("gemma4_v5", True), ("gemma4_v4", False)])
def test_a_null_gemma4_argument_parses_from_the_revision_that_writes_it_as_json(tokenizer, name, writes_null):
    tok = _recognised(tokenizer, name, GEMMA4)
    calls = [{"type": "function", "function": {"name": "search", "arguments": {
        "query": "rain", "limit": 1, "ratio": 1.0, "exact": True, "tags": [], "options": {"until": None}}}}]
    before, written = _written(tok, QUESTION, {"role": "assistant", "content": "", "tool_calls": calls}, TOOLS)
    if writes_null:
        assert _as_json(_parse(tok, before, written, TOOLS)["tool_calls"]) == _as_json(calls)
    else:  # older revisions write Python's None
        assert "until:None" in written
        with pytest.raises(ValueError, match="json"):
            _parse(tok, before, written, TOOLS)


def test_deepseek_r1_distill_reasoning_and_answer_parse_but_it_cannot_call_tools(tokenizer):
    tok = _recognised(tokenizer, "deepseek_r1_distill", "DeepSeek-R1-Distill reasoning (no tool calls)")
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<｜Assistant｜><think>\n")  # the reasoning is open before the model writes
    message = _parse(tok, prompt, f"{THINKING}\n</think>\n\n{ANSWER}<｜end▁of▁sentence｜>")
    assert message == {"role": "assistant", "reasoning_content": THINKING, "content": ANSWER}
    # the answer ends as the template writes a past turn; the template renders neither tools nor a turn's calls
    assert tok.apply_chat_template([*QUESTION, {"role": "assistant", "content": ANSWER}], tokenize=False).endswith(
        f"{ANSWER}<｜end▁of▁sentence｜>")
    _, written = _written(tok, QUESTION, {"role": "assistant", "content": "", "tool_calls": TYPED_CALLS[:1]}, TOOLS)
    assert "lookup" not in written
    with pytest.raises(ValueError, match="ignores tools"):
        check_tools([lookup], tok, QUESTION, None)


@pytest.mark.parametrize("name", ["gptoss", "gemma4_v5", "lfm2_2_5"])
def test_tools_set_the_template_of_more_formats_on_a_tokenizer_without_one(tokenizer, name):
    tok, found = _with_template(tokenizer, name)
    assert getattr(tok, "response_template", None) is None
    assert check_tools([lookup], tok, QUESTION, None) == [lookup]
    assert tok.response_template == found[1]
