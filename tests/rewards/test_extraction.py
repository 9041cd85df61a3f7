"""Answer extraction helpers, on hand-written text."""

import pytest

from grpo_lab.rewards import completion_text, last_boxed, last_number, tagged


@pytest.mark.parametrize("text, expected", [
    ("I have 3 apples and 1,234 pears.", "1234"),
    ("x = -3.5", "-3.5"),
    ("The answer is 42.", "42"),
    ("so +7", "7"),
    ("about .5 of it", "0.5"),
    ("1,234,567.89 in total", "1234567.89"),
    ("a loss of -1,000", "-1000"),
    ("5-3", "3"),  # a minus after a digit is subtraction, not a sign
    ("f(2)-4", "4"),
    ("the list 1,2,3", "3"),  # commas not followed by three digits separate numbers
    ("line one 12\nline two 7\n", "7"),
    ("no digits at all", None),
    ("", None),
])
def test_last_number(text, expected):
    assert last_number(text) == expected


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
    (r"\boxed{\sqrt{\frac{a^{2}}{b}}} done", r"\sqrt{\frac{a^{2}}{b}}"),
    (r"first \boxed{1}, then \boxed{ 2 }", "2"),  # the last one, stripped
    (r"\fbox{x^{2}}", "x^{2}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not close the group
    (r"$\boxed 5$", "5"),
    (r"cut off in \boxed{\frac{1}{2}", None),  # never closes
    (r"\boxed{3} and \boxedfoo{4}", "3"),  # \boxedfoo is another command
    ("no box here", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_tagged_spans_lines_and_takes_the_last():
    text = "<answer>1</answer>\n<think>\nstep one\nstep two\n</think>\n<answer>\n42\n</answer>"
    assert tagged(text, "answer") == "42"
    assert tagged(text, "think") == "step one\nstep two"
    assert tagged("<answer>unfinished", "answer") is None
    assert tagged("no tags", "answer") is None
    assert tagged("</answer> before <answer>", "answer") is None


def test_completion_text_reads_plain_and_conversational_completions():
    assert completion_text("plain") == "plain"
    assert completion_text([{"role": "assistant", "content": "one message"}]) == "one message"
    with_tools = [{"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
                  {"role": "tool", "content": "4"},
                  {"role": "assistant", "content": "It is 4."}]
    assert completion_text(with_tools) == "It is 4."
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "image"},
                                               {"type": "text", "text": "b"}]}]
    assert completion_text(parts) == "ab"
    assert completion_text([{"content": "no role"}]) == "no role"
    assert completion_text([]) == ""
