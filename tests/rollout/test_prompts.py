"""Prompt token counts taken when a session is built: kept per dataset object and tokenizer, so a session
built again on the same data does not render every prompt again, and recounted when what decides them changes."""

import pytest
from datasets import Dataset

from grpo_lab.core.models import load_tokenizer, prepare_tokenizer
from grpo_lab.rollout import prompts


@pytest.fixture
def renders(monkeypatch):
    """How many prompts the chat template rendered (the real rendering runs)."""
    rendered = [0]
    render = prompts.render_prompts

    def counting(batch, *args, **kwargs):
        rendered[0] += len(batch)
        return render(batch, *args, **kwargs)

    monkeypatch.setattr(prompts, "render_prompts", counting)
    return rendered


def test_counts_are_kept_for_the_same_dataset_and_tokenizer_and_recounted_when_the_template_changes(task, renders):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "1+" * n + "1="}] for n in range(1, 6)]})
    tokenizer = prepare_tokenizer(load_tokenizer(task.model))
    counts = prompts.dataset_prompt_tokens(dataset, tokenizer)
    assert renders[0] == 5 and counts == sorted(counts) and len(set(counts)) == 5  # each "1+" adds tokens

    counts.append(0)  # a copy: the kept counts are not the caller's list
    again = prepare_tokenizer(load_tokenizer(task.model))  # loaded anew, as each session loads its own
    assert prompts.dataset_prompt_tokens(dataset, again) == counts[:-1] and renders[0] == 5

    again.chat_template = again.chat_template.replace("<|im_start|>assistant", "<|im_start|>assistant\nSure:")
    longer = prompts.dataset_prompt_tokens(dataset, again)
    assert renders[0] == 10 and all(new > old for new, old in zip(longer, counts[:-1]))
    prompts.dataset_prompt_tokens(dataset, again, {"enable_thinking": False})  # template arguments count too
    assert renders[0] == 15
    prompts.dataset_prompt_tokens(Dataset.from_dict(dataset.to_dict()), tokenizer)  # another dataset object
    assert renders[0] == 20


def test_a_prompt_refused_at_build_is_refused_again_from_the_kept_counts(task, make_session, renders):
    rows = [{"prompt": "1" * 110 if i == 2 else f"{i}+1=", "answer": str(i + 1)} for i in range(16)]
    dataset = Dataset.from_list(rows)
    make_session(train_dataset=dataset)  # fits with max_completion_length 8
    rendered = renders[0]
    with pytest.raises(ValueError, match=r"train_dataset row 2: the prompt is \d+ tokens long \(rendered\), and with "
                                         r"max_completion_length=100 it exceeds the model's context of 128 positions"):
        make_session(train_dataset=dataset, max_completion_length=100)
    assert renders[0] == rendered  # from the counts of the first build
