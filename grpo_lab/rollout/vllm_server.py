"""``grpo-lab vllm-serve``: a vLLM generation server that takes policy updates over HTTP.

Endpoints (JSON unless noted):

- ``GET /health``: ``{"status": "ok", "server": "grpo-lab", "model", "vocab_size", "dtype", "version", "run",
  "max_lora_rank", "accepts_full_weights"}``;
- ``POST /generate``: ``{"prompt_token_ids": [[int]], "settings": {...}, "seeds": [int]}`` ->
  ``{"completion_ids": [[int]], "logprobs": [[float]], "version": int, "run": str}``; for a
  vision-language model ``"prompts": [{"prompt_token_ids": [int], "images": [base64 PNG]}],
  "prompt_of": [int]`` (each completion's prompt) in place of ``prompt_token_ids``, answered with
  the ``prompt_token_ids`` vLLM expanded the images into, per completion, too;
- ``POST /adapter``: ``{"version": int, "run": str, "files": {name: base64}}``: a PEFT adapter
  directory (``adapter_config.json``, ``adapter_model.safetensors``) used for every later request;
- ``POST /weights?version=N&run=ID``: body = full weights in safetensors format (GPU engines only).

``run`` identifies the training run that pushed the current policy, so that a trainer notices when
another run shares its server.

Errors answer ``{"error": message}`` with status 400 (bad request) or 500. Requests are served one at
a time (one engine). Weights travel over HTTP, which suits adapters and models up to a few billion
parameters on a fast link; there is no NCCL weight broadcast.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import shutil
import signal
import tempfile
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from grpo_lab.rollout.vllm_engine import VLLMEngine, on_gpu


class BadRequest(ValueError):
    """A request the server cannot serve because of what it asks (answered with status 400)."""


class GenerationService:
    """What the HTTP handler calls: a :class:`VLLMEngine` guarded by a lock."""

    def __init__(self, engine, model: str, max_lora_rank: int):
        self.engine, self.model, self.max_lora_rank = engine, model, max_lora_rank
        self.lock = threading.Lock()
        self.run = None

    def health(self) -> dict:
        return {
            "status": "ok", "server": "grpo-lab", "model": self.model, "vocab_size": self.engine.vocab_size(),
            "dtype": self.engine.dtype(),
            "version": self.engine.version, "run": self.run, "max_lora_rank": self.max_lora_rank,
            "accepts_full_weights": on_gpu(),
        }

    def generate(self, request) -> dict:
        _check_fields(request, "/generate", {"settings": dict, "seeds": list})
        prompts = requested_prompts(request, self.engine.vocab_size())
        settings, seeds = request["settings"], request["seeds"]
        if not all(_is_int(seed) for seed in seeds):
            raise BadRequest(f"/generate: seeds must be whole numbers, got {_shown(seeds)}.")
        if len(seeds) != len(prompts):
            raise BadRequest(f"{len(prompts)} prompts but {len(seeds)} seeds: give one seed per prompt.")
        with self.lock:
            ids, logprobs, version, generated_after = self.engine.generate(prompts, settings, seeds)
            run = self.run
        answer = {"completion_ids": ids, "logprobs": logprobs, "version": version, "run": run}
        if "prompts" in request:  # a vision-language model's: the prompt tokens its images were expanded into
            answer["prompt_token_ids"] = generated_after
        return answer

    def load_adapter(self, request: dict) -> dict:
        if not self.max_lora_rank:
            raise BadRequest("This server was started without LoRA: "
                             "restart it with --max-lora-rank R (R >= the adapter's rank).")
        _check_fields(request, "/adapter", {"version": int, "files": dict})
        files, run = request["files"], request.get("run")
        if run is not None and not isinstance(run, str):
            raise BadRequest(f"/adapter: 'run' must be a string or null, got {_shown(run)}.")
        for name, content in files.items():
            if name in ("", ".", "..") or Path(name).name != name or "\\" in name:
                raise BadRequest(f"/adapter: file names must be plain names (adapter_config.json), got {name!r}.")
            if not isinstance(content, str):
                raise BadRequest(f"/adapter: files[{name!r}] must be a base64 string, got {_shown(content)}.")
        directory = Path(tempfile.mkdtemp(prefix="grpo_lab_upload_"))
        try:
            for name, content in files.items():
                try:
                    data = base64.b64decode(content, validate=True)
                except ValueError:
                    raise BadRequest(f"/adapter: files[{name!r}] is not valid base64.") from None
                (directory / name).write_bytes(data)
            with self.lock:
                self.engine.load_adapter(directory, request["version"])
                self.run = run
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return {"version": self.engine.version}

    def load_weights(self, body: bytes, version: int, run: str | None) -> dict:
        from safetensors.torch import load

        with self.lock:
            self.engine.load_weights(load(body).items(), version)
            self.run = run
        return {"version": self.engine.version}


def requested_prompts(request: dict, vocab: int) -> list:
    """The prompts of a ``/generate`` request as :meth:`VLLMEngine.generate` takes them: token id
    lists (``prompt_token_ids``), or a vision-language model's ``prompts`` (token ids and base64 PNG
    images) decoded into vLLM's ``{"prompt_token_ids": ids, "multi_modal_data": {"image": [PIL
    images]}}``, one entry per completion (``prompt_of``), the copies of a prompt one object. Refuses
    anything else, naming the field."""
    if ("prompts" in request) == ("prompt_token_ids" in request):
        raise BadRequest("/generate needs either 'prompt_token_ids' (token ids) or 'prompts' with 'prompt_of' (a "
                         "vision-language model's token ids and images), not both or neither.")
    if "prompt_token_ids" in request:
        _check_fields(request, "/generate", {"prompt_token_ids": list})
        prompts = request["prompt_token_ids"]
        for index, ids in enumerate(prompts):
            _check_ids(ids, f"prompt_token_ids[{index}]", vocab)
        return prompts
    _check_fields(request, "/generate", {"prompts": list, "prompt_of": list})
    decoded = []
    for index, prompt in enumerate(request["prompts"]):
        if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt or not isinstance(prompt.get("images"),
                                                                                                list):
            raise BadRequest(f"/generate: prompts[{index}] must be {{'prompt_token_ids': [int], 'images': [base64 "
                             f"PNG]}}, got {_shown(prompt)}.")
        _check_ids(prompt["prompt_token_ids"], f"prompts[{index}].prompt_token_ids", vocab)
        entry = {"prompt_token_ids": prompt["prompt_token_ids"]}
        if prompt["images"]:
            entry["multi_modal_data"] = {"image": [_decoded_image(data, f"prompts[{index}].images[{position}]")
                                                   for position, data in enumerate(prompt["images"])]}
        decoded.append(entry)
    prompt_of = request["prompt_of"]
    bad = next((i for i, value in enumerate(prompt_of) if not _is_int(value) or not 0 <= value < len(decoded)), None)
    if bad is not None or not prompt_of:
        raise BadRequest(f"/generate: prompt_of must list, per completion, an index into prompts (0 to "
                         f"{len(decoded) - 1}), got {_shown(prompt_of)}.")
    return [decoded[i] for i in prompt_of]


def _check_ids(ids, field: str, vocab: int) -> None:
    if not isinstance(ids, list) or not ids or not all(_is_int(i) and 0 <= i < vocab for i in ids):
        raise BadRequest(f"/generate: {field} must be a non-empty list of token ids in [0, {vocab}), got "
                         f"{_shown(ids)}.")


def _decoded_image(data, field: str):
    """A PIL image from base64 PNG (or any format PIL reads) text, or a BadRequest naming ``field``."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, str):
        raise BadRequest(f"/generate: {field} must be base64 text, got {_shown(data)}.")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        image.load()
    except Image.DecompressionBombError:
        raise BadRequest(f"/generate: {field} holds more pixels than PIL opens ({Image.MAX_IMAGE_PIXELS}); "
                         "resize the dataset's images.") from None
    except (ValueError, UnidentifiedImageError, OSError):
        raise BadRequest(f"/generate: {field} is not a base64-encoded image.") from None
    return image


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value) -> str:
    """``value`` for an error message, cut short (a request may carry megabytes)."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_fields(request, endpoint: str, fields: dict[str, type]) -> None:
    """Refuse a request body that is not an object holding ``fields`` of their types (400, naming the field)."""
    if not isinstance(request, dict):
        raise BadRequest(f"{endpoint} takes a JSON object, got {_shown(request)}.")
    missing = [name for name in fields if name not in request]
    if missing:
        raise BadRequest(f"{endpoint} needs {', '.join(map(repr, fields))}; {', '.join(map(repr, missing))} missing.")
    for name, kind in fields.items():
        value = request[name]
        if not isinstance(value, kind) or kind is int and isinstance(value, bool):
            kind_name = {int: "a whole number", list: "a list", dict: "an object"}[kind]
            raise BadRequest(f"{endpoint}: {name!r} must be {kind_name}, got {_shown(value)}.")


def _weights_query(query: str) -> tuple[int, str | None]:
    """(version, run) of ``POST /weights?version=N&run=ID``."""
    values = parse_qs(query)
    version = values.get("version", ["0"])[0]
    if not re.fullmatch(r"[0-9]+", version):
        raise BadRequest(f"/weights: version must be a whole number >= 0, got {version!r}.")
    return int(version), values.get("run", [None])[0]


def make_handler(service: GenerationService):
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _serve(self, action) -> None:
            try:
                self._answer(200, action())
            except BadRequest as error:
                self._answer(400, {"error": str(error)})
            except json.JSONDecodeError as error:
                self._answer(400, {"error": f"The request body is not JSON ({error})."})
            except Exception as error:  # the client shows the message; the server keeps serving
                traceback.print_exc()
                self._answer(500, {"error": f"{type(error).__name__}: {error}"})

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if urlparse(self.path).path == "/health":
                self._serve(service.health)
            else:
                self._answer(404, {"error": f"No endpoint GET {self.path}; try /health."})

        def do_POST(self) -> None:  # noqa: N802
            url = urlparse(self.path)
            if url.path == "/generate":
                self._serve(lambda: service.generate(json.loads(self._body())))
            elif url.path == "/adapter":
                self._serve(lambda: service.load_adapter(json.loads(self._body())))
            elif url.path == "/weights":
                self._serve(lambda: service.load_weights(self._body(), *_weights_query(url.query)))
            else:
                self._answer(404, {"error": f"No endpoint POST {url.path}; try /generate, /adapter or /weights."})

        def log_message(self, format, *args) -> None:  # noqa: A002 (http.server's signature)
            """Quiet: one line per request would drown the training logs."""

    return Handler


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo-lab vllm-serve",
        description="Serve generations from vLLM for a GRPO run with use_vllm=True, vllm_mode='server'.",
    )
    parser.add_argument("--model", required=True,
                        help="Base model: a local path or a hub id (the trained model's base).")
    parser.add_argument(
        "--host", default="127.0.0.1",
        help="Address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 lets trainers on other machines in, "
        "with no authentication).",
    )
    parser.add_argument("--port", type=int, default=8000, help="Port (default 8000; the trainer's vllm_server_port).")
    parser.add_argument("--max-lora-rank", type=int, default=0,
                        help="Accept LoRA adapters up to this rank (0: full weights only).")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="Share of GPU memory vLLM may take.")
    parser.add_argument("--max-model-len", type=int, default=None, help="Context window (default: the model's).")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs to shard the model over.")
    parser.add_argument(
        "--dtype", default="auto",
        help="Weight dtype: auto, bfloat16, float16 or float32. Match the training precision (float32 on a CPU): "
        "auto turns float32 weights into bfloat16 on a CPU.",
    )
    parser.add_argument("--model-impl", default="vllm", choices=["vllm", "transformers", "auto"],
                        help="vLLM's model implementation.")
    parser.add_argument("--seed", type=int, default=0, help="Engine seed (each request also carries its own seed).")
    parser.add_argument(
        "--trust-remote-code", action="store_true",
        help="Run the model code the checkpoint ships (the trainer's trust_remote_code)."
    )
    return parser


def _interrupt(signum, frame) -> None:
    """SIGTERM (a job scheduler, a test) stops the server as Ctrl-C does, so that the engine is closed."""
    raise KeyboardInterrupt


def serve(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    engine = VLLMEngine(
        args.model, max_lora_rank=args.max_lora_rank, seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype, model_impl=args.model_impl,
        trust_remote_code=args.trust_remote_code,
    )
    service = GenerationService(engine, args.model, args.max_lora_rank)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(service))
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"grpo-lab vllm-serve: {args.model} ready on http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engine.close()
