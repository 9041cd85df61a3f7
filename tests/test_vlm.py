"""Vision-language models: tiny random LLaVA and Gemma 3 models (``grpo_lab.tasks.tiny_vlm``) stepped
through the five stages on the colour-square task (``grpo_lab.tasks.colour_square``), by a session
and by the trainer; their loss and gradients against TRL 1.16's ``_compute_loss`` on the same model
and tensors; checkpoints with the processor and exact resume; and the refusals of images a run
cannot train on."""

import copy

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


def test_the_image_changes_what_the_model_scores(tmp_path):
    """The log-prob passes give the model each row's own image: the same completions scored with
    another row's images get other log-probs."""
    session = vlm_session("llava", tmp_path)
    rollout = session.generate()
    engine = session.engine
    index_B = torch.arange(len(rollout))
    own = engine.sequence_logprobs(engine.model, rollout, index_B, with_entropy=False)[0]
    assert torch.allclose(own, rollout.old_logprobs_BT if rollout.old_logprobs_BT is not None else own)
    swapped = copy.copy(rollout)
    blank = ImageInputs({"pixel_values": torch.zeros_like(rollout.image_inputs_B[0].image_tensors["pixel_values"])})
    swapped.image_inputs_B = [blank] * len(rollout)
    other = engine.sequence_logprobs(engine.model, swapped, index_B, with_entropy=False)[0]
    mask = rollout.completion_mask_BT.bool()
    assert not torch.allclose(own[mask], other[mask])


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


def _trl_batch(session, rollout, advantages_B) -> dict:
    """The inputs of TRL's ``_compute_loss`` for ``rollout``, its images processed as TRL 1.16's
    ``_generate_and_score_completions`` processes them (its own message and template functions)."""
    from trl.data_utils import apply_chat_template, prepare_multimodal_messages

    processor = session.engine.processor
    images = [[image] for image in rollout.columns["image"]]
    prompts = [prepare_multimodal_messages(prompt, images=image) for prompt, image in zip(rollout.prompts, images)]
    texts = [apply_chat_template({"prompt": prompt}, processor)["prompt"] for prompt in prompts]
    processed = processor(images=images, text=texts, padding=True, return_tensors="pt")
    assert torch.equal(processed["input_ids"], rollout.prompt_ids_BP)  # the same prompt tokens as generation's
    forward = {key: value for key, value in processed.items() if key not in ("input_ids", "attention_mask")}
    if "token_type_ids" in forward:  # TRL extends it with zeros over the completion
        forward["token_type_ids"] = torch.cat(
            [forward["token_type_ids"], forward["token_type_ids"].new_zeros(rollout.completion_ids_BT.shape)], dim=1)
    return {
        "prompt_ids": rollout.prompt_ids_BP, "prompt_mask": rollout.prompt_mask_BP,
        "completion_ids": rollout.completion_ids_BT, "completion_mask": rollout.completion_mask_BT,
        "advantages": advantages_B, "num_items_in_batch": rollout.completion_mask_BT.sum(),
        "num_images": [1] * len(rollout), **forward,
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_equal_trl_on_a_vlm(family, tmp_path):
    from trl import GRPOTrainer as TRLTrainer
    from trl.trainer.utils import add_fused_lm_head

    session = vlm_session(family, tmp_path, beta=0.0)
    rollout = session.generate()
    trl_model = copy.deepcopy(session.model)  # the weights the loss is taken at
    session.score()
    advantages = session.advantages()
    result = session.loss()
    ours = {name: param.grad.clone() for name, param in session.model.named_parameters() if param.grad is not None}

    trainer = TRLTrainer.__new__(TRLTrainer)
    _trl_attributes(trainer, session.config, session.engine.accelerator, False)
    add_fused_lm_head(trl_model, temperature=session.config.temperature, outputs=("log_probs", "entropy"))
    trl_model.train()
    loss = trainer._compute_loss(trl_model, _trl_batch(session, rollout, advantages.advantages_B))
    loss.backward()
    theirs = {name: param.grad for name, param in trl_model.named_parameters() if param.grad is not None}
    assert result.loss == pytest.approx(float(loss), rel=1e-5, abs=1e-7)
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
    assert len(session.generate()) == 8


def test_a_fork_of_a_vlm_session_keeps_its_processor(tmp_path):
    session = vlm_session("llava", tmp_path)
    session.step()
    fork = session.fork()
    assert fork.engine.processor is session.engine.processor
    fork.step()
    assert fork.history["step"].tolist() == [1, 2]


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

    session = vlm_session("gemma3", tmp_path)
    rollout = session.generate()
    counted = session.engine.counted_prompt_tokens()
    assert len(counted) == 16 and set(counted) == set(rollout.prompt_mask_BP.sum(1).tolist())
    text_only = len(session.tokenizer.apply_chat_template(make_dataset(1)[0]["prompt"], add_generation_prompt=True))
    assert counted[0] > text_only  # the image's tokens are in it
    monkeypatch.setattr(grpo_lab.core.build, "VISION_COUNT_ROWS", 4)
    larger = vlm_session("gemma3", tmp_path / "larger", max_completion_length=200)
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
    with pytest.raises(ValueError, match=r"row 0: the 'images' column holds a str \(item 0\).*'red\.png'"):
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


def test_a_text_only_model_given_images_is_refused(task, tmp_path):
    _, processor = tiny_vlm("llava")
    with pytest.raises(ValueError, match=r"text-only model .*remove_columns\('image'\)"):
        GRPOSession(task.model, colour_reward, args=vlm_config(tmp_path), train_dataset=make_dataset(4),
                    processing_class=processor)


def test_a_tokenizer_given_images_is_refused(tmp_path):
    model, processor = tiny_vlm("llava")
    with pytest.raises(ValueError, match=r"processing_class is a .*cannot take images.*AutoProcessor"):
        GRPOSession(model, colour_reward, args=vlm_config(tmp_path), train_dataset=make_dataset(4),
                    processing_class=processor.tokenizer)


@pytest.mark.parametrize("setting", [{"use_vllm": True}, {"use_transformers_continuous_batching": True}])
def test_generation_paths_that_take_no_images_are_refused(setting, tmp_path):
    model, processor = tiny_vlm("llava")
    with pytest.raises(ValueError, match=f"{next(iter(setting))}=True does not take a vision-language model's images"):
        GRPOSession(model, colour_reward, args=vlm_config(tmp_path, **setting), train_dataset=make_dataset(4),
                    processing_class=processor)


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
    """The probe generates with the images again (a longer limit for its truncation check)."""
    findings = vlm_session("llava", tmp_path).doctor()
    assert "truncation" in [finding.code for finding in findings]


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
