"""Response templates for known chat templates: a tokenizer without a ``response_template`` gets the
one for the tool-call format its chat template writes. Checked against the real chat templates of
the model families (the copies TRL, a test dependency, ships): calls rendered by each template parse
back to the same calls, arguments typed by the tool's schema."""

import copy
import os.path
from pathlib import Path

import pytest
import trl
from transformers import AutoTokenizer

from grpo_lab import GRPOSession
from grpo_lab.rollout import response_formats
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
NOT_RECOGNISED = ["gemma3", "phi3", "cohere2", "llama3", "deepseekv3", "smolvlm"]
CALLS = [{"type": "function", "function": {"name": "lookup", "arguments": {"count": 12, "city": "New York"}}},
         {"type": "function", "function": {"name": "lookup", "arguments": {"count": 3, "city": "Paris"}}}]


def lookup(count: int, city: str) -> str:
    """Looks a city up.

    Args:
        count: How many results.
        city: The city's name.
    """
    return city * count


@pytest.fixture(scope="module")
def tokenizer(task):
    return AutoTokenizer.from_pretrained(task.model)


def _with_template(tokenizer, name: str):
    chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    found = response_formats.known_response_template(chat_template)
    copied = copy.deepcopy(tokenizer)
    copied.chat_template = chat_template
    return copied, found


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
