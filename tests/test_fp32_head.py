"""cast_lm_head_to_fp32: a float32 output layer on a bfloat16 model (the ScaleRL recipe)."""

import pytest
import torch

from grpo_lab import GRPOSession
from grpo_lab.core.models import Float32Head
from tests.conftest import SMALL


def _session(task, model, tmp_path, **overrides):
    config = task.config(**{**SMALL, "output_dir": str(tmp_path / "out"), "bf16": True, **overrides})
    return GRPOSession(model, task.reward_funcs, args=config, train_dataset=task.train_dataset)


def test_the_head_computes_float32_logits_from_the_bfloat16_hidden_states_under_autocast(task, untied_bf16, tmp_path):
    plain = _session(task, untied_bf16, tmp_path / "plain")
    cast = _session(task, untied_bf16, tmp_path / "cast", cast_lm_head_to_fp32=True)
    ids = torch.tensor([[5, 17, 30, 41, 8]])
    for session, fp32 in ((plain, False), (cast, True)):
        model = session.engine.unwrapped_model
        assert model.lm_head.weight.dtype == (torch.float32 if fp32 else torch.bfloat16)
        assert model.get_input_embeddings().weight.dtype == torch.bfloat16
        with torch.no_grad(), session.engine.accelerator.autocast():
            logits = model(ids).logits  # float32 either way: accelerate converts the outputs
            hidden = model.model(ids).last_hidden_state
        assert hidden.dtype == torch.bfloat16
        # the float32 products of the bfloat16 hidden states, not bfloat16 products rounded
        assert torch.equal(logits, hidden.float() @ model.lm_head.weight.float().T) == fp32


def test_a_step_keeps_the_float32_head_in_the_policy_the_reference_and_a_reloaded_session(task, untied_bf16, tmp_path):
    session = _session(task, untied_bf16, tmp_path, cast_lm_head_to_fp32=True, beta=0.1, learning_rate=1e-2)
    before = session.engine.unwrapped_model.lm_head.weight.detach().clone()
    session.step()
    head = session.engine.unwrapped_model.lm_head
    assert type(head) is Float32Head and type(session.engine.ref_model.lm_head) is Float32Head
    assert head.weight.dtype == session.engine.ref_model.lm_head.weight.dtype == torch.float32
    # an update smaller than bfloat16's spacing at these values survives only in float32
    assert not torch.equal(head.weight, before) and not torch.equal(head.weight, head.weight.bfloat16().float())
    session.save(tmp_path / "saved")
    loaded = GRPOSession.load(tmp_path / "saved")
    assert torch.equal(loaded.engine.unwrapped_model.lm_head.weight, head.weight)  # not rounded to the model's dtype
    assert loaded.step()["step"] == 2
    from transformers import AutoModelForCausalLM

    given = AutoModelForCausalLM.from_pretrained(untied_bf16)  # a bfloat16 head, as a caller would build it
    GRPOSession.load(tmp_path / "saved", model=given)
    assert given.lm_head.weight.dtype == torch.float32 and torch.equal(given.lm_head.weight, head.weight)


def test_a_tied_output_layer_trains_in_float32_and_the_embeddings_keep_the_models_dtype(task, tmp_path):
    from transformers import AutoModelForCausalLM

    tied = AutoModelForCausalLM.from_pretrained(task.model, dtype=torch.bfloat16)
    assert tied.lm_head.weight is tied.get_input_embeddings().weight
    session = _session(task, tied, tmp_path, cast_lm_head_to_fp32=True, learning_rate=1e-2)
    model = session.engine.unwrapped_model
    assert type(model.lm_head) is Float32Head and model.lm_head.weight is model.get_input_embeddings().weight
    assert model.lm_head.weight.dtype == torch.float32
    ids = torch.tensor([[5, 17, 30, 41, 8]])
    with torch.no_grad():
        assert model.get_input_embeddings()(ids).dtype == torch.bfloat16  # the layers above compute as before
        hidden = model.model(ids).last_hidden_state
        assert torch.equal(model(ids).logits, hidden.float() @ model.lm_head.weight.T)
    session.step()
    assert model.lm_head.weight.dtype == torch.float32 and torch.isfinite(model.lm_head.weight).all()


def test_an_adapter_on_the_output_layer_is_refused_with_the_fix(task, untied_bf16, tmp_path):
    from peft import LoraConfig

    config = task.config(**{**SMALL, "output_dir": str(tmp_path), "cast_lm_head_to_fp32": True})
    with pytest.raises(ValueError, match=r"plain torch.nn.Linear, and it is peft\.tuners\.lora\..*Linear\. "
                                         r"If an adapter.*target_modules"):
        GRPOSession(untied_bf16, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                    peft_config=LoraConfig(r=4, target_modules=["lm_head"], task_type="CAUSAL_LM"))
