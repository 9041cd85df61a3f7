"""Server mode: completions come from a ``grpo-lab vllm-serve`` process over HTTP.

The trainer's main process pushes each new policy version (the LoRA adapter, or full weights) after
the optimizer step; every process then sends its own prompts. Every call waits at most
``vllm_server_timeout`` seconds, and a server that does not answer is reported with how to start one.
vLLM itself is not needed in the training environment.
"""

from __future__ import annotations

import base64
import io
import json
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

from grpo_lab import notices
from grpo_lab.parallel import dist
from grpo_lab.parallel.layout import layout_for
from grpo_lab.rollout.batch import GeneratedBatch, batch_from_token_lists, draw_seeds, eos_token_ids, prompt_token_lists
from grpo_lab.rollout.hf import check_context_fits
from grpo_lab.rollout.vision import image_token_id
from grpo_lab.rollout.vllm_engine import check_expanded_alike, sampling_settings, training_dtype, without_image_token


def generate_payload(token_lists: list[list[int]], engine_prompts: list[dict] | None, settings: dict,
                     seeds: list[int]) -> dict:
    """The body of ``POST /generate``: the prompts' token ids, or for a vision-language model each
    prompt object's token ids with its images as base64 PNG (``prompts``) and which of them each
    completion's is (``prompt_of``), so that a group's images travel once (the copies of a group are
    one object: :func:`grpo_lab.rollout.vision.engine_prompts`)."""
    payload = {"settings": settings, "seeds": seeds}
    if engine_prompts is None:
        return {"prompt_token_ids": token_lists, **payload}
    distinct: dict[int, int] = {}  # id of a prompt object -> its index (the copies of a group are one object)
    wire, prompt_of = [], []
    for prompt in engine_prompts:
        if id(prompt) not in distinct:
            distinct[id(prompt)] = len(wire)
            images = prompt.get("multi_modal_data", {}).get("image", [])
            wire.append({"prompt_token_ids": prompt["prompt_token_ids"],
                         "images": [png_base64(image) for image in images]})
        prompt_of.append(distinct[id(prompt)])
    return {"prompts": wire, "prompt_of": prompt_of, **payload}


PNG_MODES = ("1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA")
"""The PIL image modes PNG stores as they are."""


def png_base64(image) -> str:
    """A PIL image as base64 PNG text: lossless, the server decodes the very pixels; an image in a mode
    PNG cannot store (a CMYK JPEG, YCbCr) is sent as RGB, which the processor converts it to anyway."""
    buffer = io.BytesIO()
    (image if image.mode in PNG_MODES else image.convert("RGB")).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


class ServerError(RuntimeError):
    """The vLLM server answered with an error."""


def server_url(config) -> str:
    if config.vllm_server_base_url:
        return config.vllm_server_base_url.rstrip("/")
    return f"http://{config.vllm_server_host}:{config.vllm_server_port}"


class VLLMServerBackend:
    name = "vllm-server"
    sends_images = True  # a vision-language model's prompts go to vLLM as tokens and images

    def __init__(self, config, *, model_fn, tokenizer, accelerator, lora_rank: int):
        self._model_fn, self.tokenizer, self.accelerator = model_fn, tokenizer, accelerator
        self.url, self.timeout = server_url(config), float(config.vllm_server_timeout)
        self.lora_rank = lora_rank
        self.run = dist.from_main(accelerator, uuid.uuid4().hex)  # one id for all processes of the run
        health = self.wait_until_ready()
        if not isinstance(health, dict) or health.get("server") != "grpo-lab":
            raise ValueError(self._not_ours(f"its /health answer is {str(health)[:200]}"))
        vocab_size = model_fn().config.get_text_config().vocab_size  # a vision-language model's: its text model's
        if health["vocab_size"] != vocab_size:
            raise ValueError(
                f"The vLLM server at {self.url} serves {health['model']!r} with {health['vocab_size']} tokens, but the "
                f"trained model has {vocab_size}: they are not the same base model. Restart the server with "
                "--model set to the trained model's base."
            )
        port = urllib.parse.urlparse(self.url).port
        if lora_rank and health["max_lora_rank"] < lora_rank:
            accepts = (f"accepts LoRA adapters up to rank {health['max_lora_rank']}" if health["max_lora_rank"]
                       else "was started without LoRA")
            raise ValueError(
                f"The vLLM server at {self.url} {accepts}, but the trained adapter has rank {lora_rank}. Restart it "
                f"with `grpo-lab vllm-serve --model {health['model']} --port {port} --max-lora-rank {lora_rank}`."
            )
        if health["dtype"] != training_dtype(config):
            notices.warn(
                f"The vLLM server at {self.url} samples in {health['dtype']} while training runs in "
                f"{training_dtype(config)}: expect wider sampling/sampling_logp_difference and more masked samples. "
                f"Restart it with --dtype {training_dtype(config)} to match.",
            )
        if not lora_rank and not health["accepts_full_weights"]:
            raise ValueError(
                f"The vLLM server at {self.url} cannot load new full weights (vLLM's CPU backend), so it would "
                "keep generating from the initial policy. Train a LoRA adapter (peft_config=LoraConfig(...)) "
                "and start the server with --max-lora-rank R, or serve from a GPU."
            )
        self.sync_weights(model_fn(), 0)

    # ------------------------------------------------------------------ HTTP
    def _request(self, path: str, payload: dict | None = None, body: bytes | None = None, *,
                 timeout: float | None = None):
        data = json.dumps(payload).encode() if payload is not None else body
        headers = {"Content-Type": "application/json" if payload is not None else "application/octet-stream"}
        request = urllib.request.Request(self.url + path, data=data, headers=headers,
                                         method="GET" if data is None else "POST")
        with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
            return json.loads(response.read())

    def _call(self, path: str, payload: dict | None = None, body: bytes | None = None):
        """A request once the server is known to be up: every failure says what happened and what to do."""
        endpoint = path.split("?")[0]
        try:
            return self._request(path, payload, body)
        except urllib.error.HTTPError as error:
            try:
                message = json.loads(error.read()).get("error", "")
            except ValueError:
                message = error.reason
            raise ServerError(
                f"The vLLM server at {self.url} refused {endpoint} (HTTP {error.code}): {message}"
            ) from None
        except TimeoutError:
            raise ServerError(
                f"The vLLM server at {self.url} did not answer {endpoint} within vllm_server_timeout="
                f"{self.timeout:g} s. Raise vllm_server_timeout for long generations, or check the server's log."
            ) from None
        except (urllib.error.URLError, ConnectionError) as error:
            raise ServerError(
                f"Lost the vLLM server at {self.url} during {endpoint} ({error}). Restart `grpo-lab vllm-serve` and "
                "resume the run from its last checkpoint."
            ) from None

    def _not_ours(self, evidence: str) -> str:
        return (
            f"The server at {self.url} is not a `grpo-lab vllm-serve` server ({evidence}); TRL's `trl vllm-serve` "
            "and vLLM's OpenAI server speak other protocols. Start one with `grpo-lab vllm-serve --model <base model>`."
        )

    def wait_until_ready(self) -> dict:
        """``/health`` of the server, polled until ``vllm_server_timeout`` runs out."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self._request("/health", timeout=max(1.0, min(10.0, deadline - time.monotonic())))
            except urllib.error.HTTPError as error:
                raise ValueError(self._not_ours(f"/health answered HTTP {error.code}")) from None
            except json.JSONDecodeError:
                raise ValueError(self._not_ours("/health did not answer JSON")) from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
                if time.monotonic() >= deadline:
                    raise ConnectionError(
                        f"No vLLM server answered at {self.url} within vllm_server_timeout={self.timeout:g} s "
                        f"({error}). Start one with `grpo-lab vllm-serve --model <base model> --port <port>` "
                        "(add --max-lora-rank R when training a LoRA adapter), set vllm_server_base_url or "
                        "vllm_server_host/vllm_server_port to where it listens, or use vllm_mode='colocate'."
                    ) from None
                time.sleep(0.5)

    # ------------------------------------------------------------------ backend
    def generate(self, prompts: list[str] | list[list[int]], config, *, image_inputs=None,
                 engine_prompts: list[dict] | None = None) -> GeneratedBatch:
        return self.generate_later(prompts, config, image_inputs=image_inputs, engine_prompts=engine_prompts)()

    def generate_later(self, prompts: list[str] | list[list[int]], config, *, image_inputs=None,
                       engine_prompts: list[dict] | None = None) -> Callable[[], GeneratedBatch]:
        """The request for ``prompts``' completions, prepared now (tokens, the context check, the seeds
        drawn from torch's generator) and sent when called: ``async_generation`` calls it from a
        worker thread, where nothing may draw from the trainer's generators. For a vision-language
        model, as in colocate mode, ``engine_prompts`` (each prompt's tokens and images) are sent
        (:func:`generate_payload`) and ``image_inputs`` kept on the batch."""
        model = self._model_fn()
        prompt_ids_BP, prompt_mask_BP, token_lists = prompt_token_lists(self.tokenizer, prompts)
        check_context_fits(model, prompt_ids_BP.shape[1], config.max_completion_length)
        settings = without_image_token(sampling_settings(config), image_token_id(model))
        payload = generate_payload(token_lists, engine_prompts, settings, draw_seeds(len(token_lists)))
        eos, device = eos_token_ids(self.tokenizer, model), self.accelerator.device

        def send() -> GeneratedBatch:
            answer = self._call("/generate", payload)
            if answer["run"] != self.run:
                raise RuntimeError(
                    f"The vLLM server at {self.url} generated with a policy pushed by another training run. Give "
                    "each run its own server (--port)."
                )
            if engine_prompts is not None:
                check_expanded_alike(token_lists, answer["prompt_token_ids"])
            batch = batch_from_token_lists(
                prompt_ids_BP.to(device), prompt_mask_BP.to(device), answer["completion_ids"], answer["logprobs"],
                pad_token_id=self.tokenizer.pad_token_id, eos_token_ids=eos, policy_version=answer["version"],
            )
            batch.image_inputs_B = image_inputs
            return batch

        return send

    def sync_weights(self, model, version: int) -> None:
        """The main process pushes the new version; the others wait until it is in place (under FSDP,
        they first help gather the weights whole), and raise with it when the push fails."""
        main = self.accelerator.is_main_process
        if self.lora_rank:
            adapter = layout_for(self.accelerator).full_model_state(model, adapter_only=True)

            def push() -> None:
                with tempfile.TemporaryDirectory(prefix="grpo_lab_adapter_") as directory:
                    model.save_pretrained(directory, state_dict=adapter)
                    files = {p.name: base64.b64encode(p.read_bytes()).decode()
                             for p in Path(directory).iterdir() if p.is_file()}
                self._call("/adapter", {"version": version, "run": self.run, "files": files})
        else:
            state = {
                name: tensor.detach().cpu().clone()
                for name, tensor in layout_for(self.accelerator).whole_tensors(model) if main
            }

            def push() -> None:
                from safetensors.torch import save

                self._call(f"/weights?version={version}&run={self.run}", body=save(state))
        dist.on_main(self.accelerator, f"push policy version {version} to the vLLM server", push)

    def close(self) -> None:
        """Nothing to release: the server outlives the run."""
