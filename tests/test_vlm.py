"""Vision-language models: tiny random LLaVA and Gemma 3 models (``grpo_lab.tasks.tiny_vlm``) stepped
through the five stages on the colour-square task (``grpo_lab.tasks.colour_square``), by a session
and by the trainer; their loss and gradients against TRL 1.16's ``_compute_loss`` on the same model
and tensors; checkpoints with the processor and exact resume; and the refusals of images a run
cannot train on."""

import copy
import re

import pytest
import torch
from datasets import Dataset

from grpo_lab import GRPOConfig, GRPOSession, GRPOTrainer
from grpo_lab.rollout.vision import ImageInputs, model_inputs, multimodal_messages
from grpo_lab.tasks.addition import completion_text
from grpo_lab.tasks.colour_square import COLOURS, colour_reward, make_dataset, square_image
from grpo_lab.tasks.tiny_vlm import FAMILIES, tiny_vlm
from tests.trl_loss_parity import _trl_attributes

FAMILY_TOKENS = {"llava": "<image>", "gemma3": "<image_soft_token>"}


def spread_reward(completions, **kwargs) -> list[float]:
    """A reward with a spread among a random model's completions (their length modulo 5), so that
    groups carry a signal and the loss a gradient."""
    return [float(len(completion_text(completion)) % 5) for completion in completions]


def vlm_config(tmp_path, **overrides) -> GRPOConfig:
    settings = dict(output_dir=str(tmp_path and tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                    max_completion_length=6, learning_rate=1e-2, max_steps=4, report_to="none", logging_steps=1,
                    seed=3)
    return GRPOConfig(**{**settings, **overrides})


def vlm_session(family, tmp_path, rewards=(colour_reward, spread_reward), rows=16, **overrides) -> GRPOSession:
    model, processor = tiny_vlm(family)
    return GRPOSession(model, list(rewards), args=vlm_config(tmp_path, **overrides), train_dataset=make_dataset(rows),
                       processing_class=processor)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_session_steps_a_vlm_through_the_five_stages(family, tmp_path):
    seen = {}

    def image_reward(completions, image, prompts, **kwargs):
        seen["image"], seen["prompts"] = image, prompts
        return [0.0] * len(completions)

    session = vlm_session(family, tmp_path, rewards=(colour_reward, spread_reward, image_reward))
    token = session.tokenizer.convert_tokens_to_ids(FAMILY_TOKENS[family])
    rollout = session.generate()
    assert len(rollout) == 8 and rollout.image_inputs_B is not None
    assert (rollout.prompt_ids_BP == token).sum(1).min() > 0  # every prompt holds the image's tokens
    assert (rollout.completion_ids_BT == token).sum() == 0  # never sampled (suppressed, as TRL does)
    assert all(inputs.image_tensors["pixel_values"].shape[0] == 1 for inputs in rollout.image_inputs_B)
    scores = session.score()
    # rewards receive the image column as TRL passes it: the rows' images, and the dataset's prompts
    assert [image.size for image in seen["image"]] == [(28, 28)] * 8
    assert seen["prompts"][0] == [{"role": "user", "content": make_dataset(1)[0]["prompt"][0]["content"]}]
    assert scores.rewards_BF.shape == (8, 3)
    advantages = session.advantages()
    assert advantages.advantages_B.abs().sum() > 0
    before = {name: value.clone() for name, value in session.model.named_parameters()}
    loss = session.loss()
    assert torch.isfinite(torch.tensor(loss.loss))
    vision_grads = [p.grad for n, p in session.model.named_parameters() if "vision" in n and p.grad is not None]
    assert vision_grads and any(grad.abs().sum() > 0 for grad in vision_grads)  # the image reaches the loss
    session.update()
    changed = [name for name, value in session.model.named_parameters() if not torch.equal(value, before[name])]
    assert any("vision" in name for name in changed) and any("vision" not in name for name in changed)
    assert session.history["step"].tolist() == [1]


def varied_dataset(rows: int) -> Dataset:
    """The colour task with questions of different lengths (a batch of them is left padded), and every
    fourth row without its picture (a text-only row among image rows)."""
    data = make_dataset(rows).to_dict()
    data["prompt"] = [[{"role": "user", "content": "Look. " * (row % 3) + message[0]["content"]}]
                      for row, message in enumerate(data["prompt"])]
    data["image"] = [None if row % 4 == 3 else image for row, image in enumerate(data["image"])]
    data["answer"] = [answer if row % 4 != 3 else "none" for row, answer in enumerate(data["answer"])]
    return Dataset.from_dict(data).cast_column("image", make_dataset(1).features["image"])


@pytest.mark.parametrize("family", FAMILIES)
def test_each_row_is_scored_with_its_own_image_under_left_padding(family, tmp_path):
    """A log-prob pass over any subset of a left-padded batch gives each row the log-probs of its
    prompt and image alone: row k scored by itself, and row k's prompt processed afresh without
    padding, give the full pass's row k; another row's image gives other log-probs."""
    from grpo_lab.core.model_calls import full_logits
    from grpo_lab.rollout.vision import processed_prompts

    model, processor = tiny_vlm(family)
    session = GRPOSession(model, [colour_reward, spread_reward], args=vlm_config(tmp_path, num_generations=2),
                          train_dataset=varied_dataset(4), processing_class=processor)  # the batch: all 4 rows
    rollout = session.generate()
    engine = session.engine
    assert len(set(rollout.prompt_mask_BP.sum(1).tolist())) > 1  # the batch is left padded
    assert any(not inputs.image_tensors for inputs in rollout.image_inputs_B)  # and holds a row without image
    full = engine.sequence_logprobs(engine.model, rollout, torch.arange(len(rollout)), with_entropy=False)[0]
    mask = rollout.completion_mask_BT.bool()
    for k in range(len(rollout)):
        alone = engine.sequence_logprobs(engine.model, rollout, torch.tensor([k]), with_entropy=False)[0][0]
        torch.testing.assert_close(alone[mask[k]], full[k][mask[k]], rtol=1e-5, atol=1e-5)
        ids, (inputs,) = processed_prompts(processor, [rollout.prompts[k]],
                                           [[rollout.columns["image"][k]] if rollout.columns["image"][k] else []])
        prompt_ids = torch.tensor(ids)
        fresh = full_logits(engine.model, prompt_ids, torch.ones_like(prompt_ids), rollout.completion_ids_BT[k:k + 1],
                            rollout.completion_mask_BT[k:k + 1],
                            model_inputs(inputs and [inputs], torch.ones_like(prompt_ids),
                                         rollout.completion_ids_BT.shape[1])).log_softmax(-1)
        fresh_BT = fresh.gather(-1, rollout.completion_ids_BT[k:k + 1, :, None])[0, :, 0]
        torch.testing.assert_close(fresh_BT[mask[k]], full[k][mask[k]], rtol=1e-4, atol=1e-4)
    swapped = copy.copy(rollout)
    with_image = [k for k, inputs in enumerate(rollout.image_inputs_B) if inputs.image_tensors]
    swapped.image_inputs_B = list(rollout.image_inputs_B)
    first, second = with_image[0], next(k for k in with_image if rollout.columns["answer"][k] !=
                                        rollout.columns["answer"][with_image[0]])
    swapped.image_inputs_B[first] = rollout.image_inputs_B[second]
    other = engine.sequence_logprobs(engine.model, swapped, torch.tensor([first]), with_entropy=False)[0][0]
    assert not torch.allclose(other[mask[first]], full[first][mask[first]])


def test_model_inputs_place_per_token_fields_under_left_padding():
    """Per-token fields (Gemma 3's token_type_ids) sit at each prompt's own tokens in a left-padded
    batch, zeros on the padding and over the completion; image tensors concatenate in row order."""
    rows = [ImageInputs({"pixel_values": torch.full((1, 3), 1.0)}, {"token_type_ids": torch.tensor([0, 1, 1])}),
            ImageInputs({"pixel_values": torch.full((1, 3), 2.0)}, {"token_type_ids": torch.tensor([1, 0])})]
    prompt_mask_BP = torch.tensor([[1, 1, 1], [0, 1, 1]])
    inputs = model_inputs(rows, prompt_mask_BP, completion_width=2, dtype=torch.bfloat16)
    assert inputs["token_type_ids"].tolist() == [[0, 1, 1, 0, 0], [0, 1, 0, 0, 0]]
    assert inputs["pixel_values"].dtype == torch.bfloat16 and inputs["pixel_values"][:, 0].tolist() == [1.0, 2.0]


def test_images_go_before_the_first_user_text_as_trl_places_them():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What colour?"},
                {"role": "user", "content": "Again?"}]
    placed = multimodal_messages(messages, ["image one", "image two"])
    assert placed[0]["content"] == [{"type": "text", "text": "Be brief."}]
    assert placed[1]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What colour?"}]
    assert placed[2]["content"] == [{"type": "text", "text": "Again?"}]


def _trl_batch(session, rollout, rows: torch.Tensor) -> dict:
    """The inputs of TRL's ``_compute_loss`` for the completions ``rows`` of ``rollout`` (one
    micro-batch), its images processed as TRL 1.16's ``_generate_and_score_completions`` processes
    them (its own message and template functions), without advantages and log-probs."""
    from trl.data_utils import apply_chat_template, prepare_multimodal_messages

    processor = session.engine.processor
    images = [[rollout.columns["image"][row]] for row in rows.tolist()]
    prompts = [prepare_multimodal_messages(rollout.prompts[row], images=image) for row, image in zip(rows, images)]
    texts = [apply_chat_template({"prompt": prompt}, processor)["prompt"] for prompt in prompts]
    processed = processor(images=images, text=texts, padding=True, return_tensors="pt")
    assert torch.equal(processed["input_ids"], rollout.prompt_ids_BP[rows])  # the prompt tokens generation had
    forward = {key: value for key, value in processed.items() if key not in ("input_ids", "attention_mask")}
    if "token_type_ids" in forward:  # TRL extends it with zeros over the completion
        forward["token_type_ids"] = torch.cat(
            [forward["token_type_ids"], forward["token_type_ids"].new_zeros(rollout.completion_ids_BT[rows].shape)], 1)
    return {"prompt_ids": rollout.prompt_ids_BP[rows], "prompt_mask": rollout.prompt_mask_BP[rows],
            "completion_ids": rollout.completion_ids_BT[rows], "completion_mask": rollout.completion_mask_BT[rows],
            "num_images": [1] * len(rows), **forward}


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_equal_trl_on_a_vlm(family, tmp_path):
    """One optimizer step of two micro-batches with a KL term: the reference log-probs and the loss
    and gradients of grpo_lab's passes equal TRL's on the same model (reference: its copy) and tensors."""
    from trl import GRPOTrainer as TRLTrainer
    from trl.trainer.utils import add_fused_lm_head

    session = vlm_session(family, tmp_path, beta=0.04, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    trl_model, trl_reference = copy.deepcopy(session.model), copy.deepcopy(session.model)  # the weights of step 0
    rollout = session.generate()
    session.score()
    advantages = session.advantages()
    result = session.loss()
    ours = {name: param.grad.clone() for name, param in session.model.named_parameters() if param.grad is not None}

    trainer = TRLTrainer.__new__(TRLTrainer)
    _trl_attributes(trainer, session.config, session.engine.accelerator, False)
    for model in (trl_model, trl_reference):
        add_fused_lm_head(model, temperature=session.config.temperature, outputs=("log_probs", "entropy"))
    trl_model.train()
    total = 0.0
    for rows in torch.arange(8).view(2, 4):
        batch = _trl_batch(session, rollout, rows)
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        forward = {key: batch[key] for key in ("pixel_values", "token_type_ids", "num_images") if key in batch}
        with torch.no_grad():
            reference = trainer._get_per_token_logps_and_entropies(
                trl_reference, input_ids, attention, batch["completion_ids"].shape[1], **forward)[0]
        mask = batch["completion_mask"].bool()
        torch.testing.assert_close(reference[mask], rollout.ref_logprobs_BT[rows][mask], rtol=1e-5, atol=1e-5)
        loss = trainer._compute_loss(trl_model, {
            **batch, "advantages": advantages.advantages_B[rows], "ref_per_token_logps": reference,
            "num_items_in_batch": rollout.completion_mask_BT.sum()})
        loss.backward()
        total += float(loss.detach())
    theirs = {name: param.grad for name, param in trl_model.named_parameters() if param.grad is not None}
    assert result.micro_batches == 2 and result.loss == pytest.approx(total, rel=1e-5, abs=1e-7)
    assert set(ours) == set(theirs) and any("vision" in name for name in ours)
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_trainer_trains_a_vlm_as_a_session_steps_it(family, tmp_path):
    session = vlm_session(family, tmp_path / "session", max_steps=2)
    session.run(2, progress=False)
    model, processor = tiny_vlm(family)
    trainer = GRPOTrainer(model, [colour_reward, spread_reward], args=vlm_config(tmp_path / "trainer", max_steps=2),
                          train_dataset=make_dataset(16), processing_class=processor)
    trainer.train()
    assert trainer.processing_class is processor
    columns = [name for name in session.history.columns if name != "step_time"]
    assert trainer.session.history[columns].equals(session.history[columns])
    for (name, ours), theirs in zip(trainer.model.state_dict().items(), session.model.state_dict().values()):
        assert torch.equal(ours, theirs), name


def test_a_checkpoint_keeps_the_processor_and_resumes_a_half_used_batch_exactly(tmp_path):
    """A save inside a generation batch (steps_per_generation=2) stores the batch's images as pixels;
    the run loaded from it (model and processor by path) ends where an uninterrupted one does."""
    rewards = [colour_reward, spread_reward]
    settings = dict(per_device_train_batch_size=4, steps_per_generation=2)
    straight = vlm_session("gemma3", tmp_path / "a", **settings)
    for _ in range(3):
        straight.step()
    stopped = vlm_session("gemma3", tmp_path / "b", **settings)
    stopped.step()
    stopped.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "processor_config.json").exists()
    resumed = GRPOSession.load(tmp_path / "saved", reward_funcs=rewards, train_dataset=make_dataset(16))
    assert type(resumed.engine.processor).__name__ == "Gemma3Processor"
    assert resumed.rollout is not None and resumed.rollout.columns["image"][0].size == (28, 28)
    resumed.step()
    resumed.step()
    for (name, ours), theirs in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(ours, theirs), name


def test_a_vlm_loads_by_path_with_its_processor(tmp_path):
    model, processor = tiny_vlm("llava")
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    session = GRPOSession(str(tmp_path / "vlm"), colour_reward, args=vlm_config(tmp_path),
                          train_dataset=make_dataset(8))
    assert type(session.model).__name__ == "LlavaForConditionalGeneration"
    assert type(session.engine.processor).__name__ == "LlavaProcessor"
    assert session.processing_class is session.engine.processor
    assert len(session.generate()) == 8


def test_a_fork_of_a_vlm_session_keeps_its_processor_and_steps_as_the_session(tmp_path):
    session = vlm_session("llava", tmp_path)
    session.step()
    fork = session.fork()
    assert fork.engine.processor is session.engine.processor
    fork.step()
    session.step()
    assert fork.history["step"].tolist() == [1, 2]
    for (name, ours), theirs in zip(fork.model.state_dict().items(), session.model.state_dict().values()):
        assert torch.equal(ours, theirs), name


def test_prompts_that_place_their_images_and_an_images_column_of_two(tmp_path):
    """TRL's other formats: an ``images`` column of lists, and prompts whose content places the images
    itself ({"type": "image"} parts, filled in order); two pictures per row reach the model."""
    model, processor = tiny_vlm("llava")
    rows = make_dataset(8)
    prompts = [[{"role": "user", "content": [{"type": "text", "text": "First"}, {"type": "image"},
                                             {"type": "text", "text": "then"}, {"type": "image"},
                                             {"type": "text", "text": "which colour is the second square?"}]}]] * 8
    images = [[square_image("red", seed=row), rows[row]["image"]] for row in range(8)]
    dataset = Dataset.from_dict({"prompt": prompts, "images": images, "answer": rows["answer"]})
    session = GRPOSession(model, [colour_reward, spread_reward], args=vlm_config(tmp_path), train_dataset=dataset,
                          processing_class=processor)
    rollout = session.generate()
    image_token = session.tokenizer.convert_tokens_to_ids("<image>")
    per_image = int((rollout.prompt_ids_BP[0] == image_token).sum()) // 2
    assert per_image > 1 and (rollout.prompt_ids_BP == image_token).sum(1).tolist() == [2 * per_image] * 8
    assert all(inputs.image_tensors["pixel_values"].shape[0] == 2 for inputs in rollout.image_inputs_B)
    text = session.tokenizer.decode(rollout.prompt_ids_BP[0][rollout.prompt_mask_BP[0].bool()])
    places = [text.index("First"), text.index("<image>"), text.index("then"), text.rindex("<image>"),
              text.index("which")]
    assert places == sorted(places)
    session.step()


def test_prompt_counts_hold_the_image_tokens_at_build_and_per_batch(tmp_path, monkeypatch):
    """The counts the prompt-room check and the doctor's forecasts read are the tokens the model is
    given, image tokens included: counted at build, or (a larger dataset) as each batch is drawn."""
    import grpo_lab.core.build

    from trl.data_utils import apply_chat_template, prepare_multimodal_messages

    model, processor = tiny_vlm("gemma3")
    dataset = varied_dataset(16)
    session = GRPOSession(model, colour_reward, args=vlm_config(tmp_path), train_dataset=dataset,
                          processing_class=processor)
    counted = session.engine.counted_prompt_tokens()
    by_hand = []  # each row processed as TRL processes it, alone
    for row in dataset:
        images = [row["image"]] if row["image"] is not None else None
        text = apply_chat_template({"prompt": prepare_multimodal_messages(row["prompt"], images=images)},
                                   processor)["prompt"]
        by_hand.append(len(processor(text=[text], images=[images] if images else None)["input_ids"][0]))
    assert counted == by_hand and len(set(counted)) > 2
    text_only = len(session.tokenizer.apply_chat_template(dataset[0]["prompt"], add_generation_prompt=True))
    assert counted[0] > text_only  # the image's tokens are in it
    counted = [max(counted)]  # the longest prompt, for the per-batch check below
    monkeypatch.setattr(grpo_lab.core.build, "VISION_COUNT_ROWS", 4)
    larger = vlm_session("gemma3", tmp_path / "larger", max_completion_length=200)
    counted = [session.engine.counted_prompt_tokens()[0]]  # make_dataset's prompts are all alike
    assert larger.engine.counted_prompt_tokens() is None
    room = larger.engine.generation_stage.context - counted[0]  # the longest prompt's room, image tokens counted
    larger.config.max_completion_length = room + 1
    with pytest.raises(ValueError, match=f"the prompt is {counted[0]} tokens long"):
        larger.generate()


# ------------------------------------------------------------------ refusals
def test_an_image_column_with_a_non_image_value_is_refused_with_the_row(tmp_path):
    model, processor = tiny_vlm("llava")
    rows = {"prompt": make_dataset(3)["prompt"], "images": [["red.png"], ["blue.png"], ["green.png"]],
            "answer": ["red"] * 3}
    with pytest.raises(ValueError, match=r"row 0: the 'images' column holds a str \(item 0\).*'red\.png'.*"
                                         r"cast_column\('images', datasets\.Sequence\(datasets\.Image\(\)\)\)"):
        GRPOSession(model, colour_reward, args=vlm_config(tmp_path), train_dataset=Dataset.from_dict(rows),
                    processing_class=processor)


def test_a_prompt_placing_more_images_than_its_row_has_is_refused(tmp_path):
    model, processor = tiny_vlm("llava")
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    rows = Dataset.from_dict({"prompt": [prompt] * 2, "image": [square_image("red")] * 2, "answer": ["red"] * 2})
    with pytest.raises(ValueError, match=r"row 0: the prompt places 2 image\(s\).*has 1 in its 'image' column"):
        GRPOSession(model, colour_reward, args=vlm_config(tmp_path), train_dataset=rows, processing_class=processor)


def test_standard_prompts_with_images_are_refused(tmp_path):
    model, processor = tiny_vlm("llava")
    rows = Dataset.from_dict({"prompt": ["Which colour?"] * 4, "image": [square_image("red")] * 4,
                              "answer": ["red"] * 4})
    with pytest.raises(ValueError, match="row 0: the prompt is not a list of chat messages.*conversational"):
        GRPOSession(model, colour_reward, args=vlm_config(tmp_path), train_dataset=rows, processing_class=processor)


@pytest.mark.parametrize("given", ["processor", "nothing"])
def test_a_text_only_model_given_images_is_refused(task, tmp_path, given):
    """Named as the text-only model, whether a VLM's processor came with it or none (the model's own
    tokenizer loaded from its folder): no processor would make it take images."""
    processing_class = tiny_vlm("llava")[1] if given == "processor" else None
    with pytest.raises(ValueError, match=r"text-only model .*remove_columns\('image'\)"):
        GRPOSession(task.model, colour_reward, args=vlm_config(tmp_path), train_dataset=make_dataset(4),
                    processing_class=processing_class)


def test_a_tokenizer_given_images_is_refused(tmp_path):
    model, processor = tiny_vlm("llava")
    with pytest.raises(ValueError, match=r"processing_class is a .*cannot take images.*AutoProcessor"):
        GRPOSession(model, colour_reward, args=vlm_config(tmp_path), train_dataset=make_dataset(4),
                    processing_class=processor.tokenizer)


def _add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


class _Counter:
    def reset(self, **kwargs):
        return None


@pytest.mark.parametrize("setting, given", [
    ("use_transformers_continuous_batching=True", {"args": {"use_transformers_continuous_batching": True}}),
    ("async_generation=True", {"args": {"async_generation": True}}),
    ("rollout_func", {"rollout_func": lambda prompts, trainer: {}}),
    ("tools", {"tools": [_add]}),
    ("environment_factory", {"environment_factory": _Counter}),
])
def test_generation_paths_that_take_no_images_are_refused(setting, given, tmp_path):
    model, processor = tiny_vlm("llava")
    extra = {key: value for key, value in given.items() if key != "args"}
    with pytest.raises(ValueError, match=f"^{re.escape(setting)} does not take a vision-language model's images"):
        GRPOSession(model, colour_reward, args=vlm_config(tmp_path, **given.get("args", {})),
                    train_dataset=make_dataset(4), processing_class=processor, **extra)


def test_the_colour_task_rows_and_reward():
    rows = make_dataset(8, seed=1)
    assert rows["answer"][:4] == list(COLOURS)
    image = rows[0]["image"]
    assert image.size == (28, 28) and COLOURS[rows[0]["answer"]] in [colour for _, colour in image.getcolors()]
    completions = ["<answer>red</answer>", "<answer> blue </answer>", "red"]
    assert colour_reward(completions, ["red", "blue", "red"]) == [1, 1, 0]
    assert make_dataset(8, seed=1)[3]["image"].tobytes() == rows[3]["image"].tobytes()  # the seed decides the pictures


TWO_PROCESSES = """
import sys
import torch
from grpo_lab import GRPOTrainer
from grpo_lab.tasks.colour_square import colour_reward, make_dataset
from grpo_lab.tasks.tiny_vlm import tiny_vlm
from tests.test_vlm import spread_reward, vlm_config

out, resume = sys.argv[1], sys.argv[2]
model, processor = tiny_vlm("gemma3")
config = vlm_config(None, output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, save_steps=2,
                    disable_tqdm=True)
trainer = GRPOTrainer(model, [colour_reward, spread_reward], args=config, train_dataset=make_dataset(32),
                      processing_class=processor)
trainer.train(resume_from_checkpoint=None if resume == "no" else resume)
rank = trainer.accelerator.process_index
torch.save({"weights": {n: p.detach().clone() for n, p in trainer.session.model.named_parameters()},
            "history": trainer.session.history.drop(columns=["step_time"]).to_dict("list"),
            "answers": trainer.session.last_trained.advantages.scores.rollout.columns["answer"]},
           f"{out}/result-{rank}.pt")
trainer.close()
"""


@pytest.mark.slow
def test_two_processes_train_a_vlm_alike_and_resume_exactly(tmp_path):
    """A 2-process data-parallel run of a VLM: both processes end with the same weights, each trained
    on its own rows' images, and a run resumed from its step-2 checkpoint ends where the whole run does."""
    import os
    import subprocess
    from pathlib import Path

    from tests.conftest import launch_two

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "run.py").write_text(TWO_PROCESSES)
    launch = launch_two("--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
    runs = (("whole", "no"), ("resumed", str(tmp_path / "whole" / "checkpoint-2")))
    for out, resume in runs:
        done = subprocess.run([*launch, str(tmp_path / "run.py"), str(tmp_path / out), resume],
                              capture_output=True, text=True, env=env, cwd=root, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
    whole = [torch.load(tmp_path / "whole" / f"result-{rank}.pt") for rank in (0, 1)]
    resumed = [torch.load(tmp_path / "resumed" / f"result-{rank}.pt") for rank in (0, 1)]
    assert whole[0]["history"] == whole[1]["history"] and whole[0]["history"]["step"] == [1, 2, 3, 4]
    assert whole[0]["answers"] != whole[1]["answers"]  # each process its own rows
    for name, value in whole[0]["weights"].items():
        assert torch.equal(whole[1]["weights"][name], value), name
        assert all(torch.equal(run["weights"][name], value) for run in resumed), name


def test_an_exported_vlm_session_script_reproduces_the_first_step(tmp_path):
    """The script carries the processor (its image settings) beside the datasets with their images."""
    from tests.conftest import run_exported_step

    model, processor = tiny_vlm("gemma3")
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    session = GRPOSession(str(tmp_path / "vlm"), [colour_reward, spread_reward],
                          args=vlm_config(tmp_path, max_steps=1), train_dataset=make_dataset(16))
    script = session.export_script(tmp_path / "train.py")
    first = session.step()
    assert (tmp_path / "train.data" / "tokenizer" / "processor_config.json").exists()
    row = run_exported_step(script, tmp_path)
    assert row == {key: value for key, value in first.items() if key != "step_time"}


def test_the_doctor_probes_a_vlm_session(tmp_path):
    """The probe's batches (the first, and the one generated again with a longer limit for the
    truncation check) go to the model with their images, and reward functions get them."""
    images_seen = []

    def image_count(completions, image, **kwargs):
        images_seen.append(sum(picture is not None for picture in image))
        return [0.0] * len(completions)

    session = vlm_session("llava", tmp_path, rewards=(colour_reward, spread_reward, image_count))
    findings = session.doctor()
    truncation = next(finding for finding in findings if finding.code == "truncation")
    assert any("generated again" in f"{key} {value}" for key, value in truncation.evidence.items())
    assert images_seen and all(count == 8 for count in images_seen)
    assert session.rollout is None and session.engine.global_step == 0  # the probe leaves the run as it was


def test_a_recipe_trains_a_vlm_with_its_processor_settings(tmp_path):
    import yaml

    from grpo_lab.cli.recipes import build_trainer

    model, processor = tiny_vlm("llava")
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    make_dataset(16).save_to_disk(str(tmp_path / "squares"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": str(tmp_path / "vlm"), "train_dataset": str(tmp_path / "squares"),
        "reward_funcs": ["grpo_lab.tasks.colour_square:colour_reward", "tests.test_vlm:spread_reward"],
        "processor": {"do_normalize": False}, "num_generations": 4, "per_device_train_batch_size": 8,
        "max_completion_length": 6, "max_steps": 1, "report_to": "none", "output_dir": str(tmp_path / "out"),
    }))
    trainer = build_trainer(recipe)
    assert trainer.processing_class.image_processor.do_normalize is False
    trainer.train()
    pixels = trainer.session.last_trained.advantages.scores.rollout.image_inputs_B[0].image_tensors["pixel_values"]
    assert pixels.min() >= 0 and pixels.max() <= 1  # rescaled, not normalised: the setting reached the images


def test_a_vlm_trains_on_rows_without_images(tmp_path):
    """A vision-language model given a text-only dataset (chat prompts, or plain strings: rendered
    through the processor, as TRL does) trains."""
    model, processor = tiny_vlm("gemma3")
    text = make_dataset(8).remove_columns("image")
    strings = Dataset.from_dict({"prompt": ["Which colour is red? Answer: "] * 8, "answer": ["red"] * 8})
    for train in (text, strings):
        session = GRPOSession(model, [colour_reward, spread_reward], args=vlm_config(tmp_path), train_dataset=train,
                              processing_class=processor)
        rollout = session.generate()
        assert all(not inputs.image_tensors for inputs in rollout.image_inputs_B)
        assert session.step()["step"] == 1


def test_an_eval_set_with_images_is_evaluated_with_them(tmp_path):
    seen = []

    def image_sizes(completions, image, **kwargs):
        seen.append([picture.size for picture in image])
        return [0.0] * len(completions)

    model, processor = tiny_vlm("llava")
    session = GRPOSession(model, [colour_reward, image_sizes], args=vlm_config(tmp_path), train_dataset=make_dataset(8),
                          eval_dataset=make_dataset(4, seed=7), processing_class=processor)
    metrics = session.evaluate()
    assert "eval_reward" in metrics and seen == [[(28, 28)] * 16]  # 4 rows, num_generations each


def test_a_lora_vlm_checkpoint_resumes_exactly(tmp_path):
    """LoRA on a LLaVA (peft has no auto class for it): the adapter is saved, and the run loaded from
    the checkpoint ends where an uninterrupted one does."""
    from peft import LoraConfig

    model, processor = tiny_vlm("llava")
    model.save_pretrained(tmp_path / "vlm")  # the adapter's base model, which loading the checkpoint reads
    processor.save_pretrained(tmp_path / "vlm")

    def lora_session(folder):
        return GRPOSession(str(tmp_path / "vlm"), [colour_reward, spread_reward], args=vlm_config(folder),
                           train_dataset=make_dataset(16),
                           peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    straight = lora_session(tmp_path / "a")
    straight.step()
    straight.step()
    stopped = lora_session(tmp_path / "b")
    stopped.step()
    stopped.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "adapter_config.json").exists()
    resumed = GRPOSession.load(tmp_path / "saved", reward_funcs=[colour_reward, spread_reward],
                               train_dataset=make_dataset(16))
    assert type(resumed.model.get_base_model()).__name__ == "LlavaForConditionalGeneration"
    resumed.step()
    for (name, ours), theirs in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(ours, theirs), name


@pytest.mark.parametrize("mode", ["P", "RGBA", "L", "CMYK"])
def test_a_saved_batchs_images_come_back_pixel_for_pixel(mode):
    from PIL import Image

    from grpo_lab.state.checkpoint import restored_images, stored_images

    image = square_image("green", seed=5).convert(mode)
    columns = {"image": [image, None], "answer": ["green", "red"]}
    stored = stored_images(columns)
    assert isinstance(stored["image"][0], dict) and stored["answer"] == ["green", "red"]
    back = restored_images(stored)["image"][0]
    assert isinstance(back, Image.Image) and back.mode == mode and back.tobytes() == image.tobytes()
    if mode == "P":
        assert back.getpalette() == image.getpalette()


def test_gradient_checkpointing_gives_a_vlm_the_gradients_of_the_plain_pass(tmp_path):
    """TRL's default (gradient_checkpointing=True, non-reentrant) on a VLM: the same loss and gradients
    as without it, the vision tower's included."""
    grads = []
    for checkpointing in (True, False):
        session = vlm_session("gemma3", tmp_path / str(checkpointing), gradient_checkpointing=checkpointing)
        assert session.model.is_gradient_checkpointing is checkpointing
        session.generate(), session.score(), session.advantages()
        loss = session.loss().loss
        grads.append((loss, {name: param.grad.clone() for name, param in session.model.named_parameters()
                             if param.grad is not None}))
    (loss_on, on), (loss_off, off) = grads
    assert loss_on == pytest.approx(loss_off, rel=1e-6) and set(on) == set(off) and any("vision" in n for n in on)
    for name, grad in on.items():
        torch.testing.assert_close(grad, off[name], rtol=1e-5, atol=1e-7, msg=name)


def test_sample_on_a_vlm_session_renders_through_the_processor_and_never_samples_the_image_token(tmp_path):
    session = vlm_session("llava", tmp_path, max_completion_length=16)
    prompts = [[{"role": "user", "content": "Which colour is red?"}]] * 4
    sampled = session.sample(prompts)
    image_token = session.tokenizer.convert_tokens_to_ids("<image>")
    assert len(sampled["texts"]) == 4 and all(image_token not in ids for ids in sampled["completion_ids"])
    expected = session.engine.processor.apply_chat_template(prompts[0], tokenize=False, add_generation_prompt=True)
    assert session.tokenizer.decode(sampled["prompt_ids"][0]) == expected


def test_a_fork_does_not_process_the_datasets_images_again(tmp_path, monkeypatch):
    import grpo_lab.rollout.vision as vision

    session = vlm_session("llava", tmp_path)
    calls = []
    original = vision.prompt_lengths
    monkeypatch.setattr(vision, "prompt_lengths", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    fork = session.fork()
    assert calls == [] and fork.engine.counted_prompt_tokens() == session.engine.counted_prompt_tokens()


def test_reentrant_checkpointing_of_a_vlm_on_several_processes_is_refused_before_training(tmp_path):
    """DDP must look for the vision tower's unreached weights, which reentrant checkpointing forbids:
    refused when the policy is adapted (the build step under test, given a 2-process accelerator's
    count), where DDP would fail at the first backward pass."""
    from types import SimpleNamespace

    from grpo_lab.core.build import adapt_policy

    model, _ = tiny_vlm("llava")
    config = vlm_config(tmp_path, gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="use_reentrant.*several processes.*use_reentrant=False"):
        adapt_policy(model, config, None, SimpleNamespace(num_processes=2))
    policy, _ = adapt_policy(model, config, None, SimpleNamespace(num_processes=1))  # one process: nothing to find
    assert policy.is_gradient_checkpointing
