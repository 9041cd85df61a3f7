"""4-bit QLoRA on the shipped model: bitsandbytes nf4 weights through model_init_kwargs, a LoRA
adapter on top, and GRPO that learns."""

import pytest

from grpo_lab import GRPOSession

QUANTIZED = {
    "quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_compute_dtype": "float32",
    },
    "device_map": "cpu",
}


def test_every_adapter_gets_a_gradient_after_a_generation_on_any_cpu(tmp_path):
    """bitsandbytes repacks 4-bit weights for an inference kernel without a backward on CPUs with
    AVX512-BF16; the layers are told that such a CPU is present, and the policy must still train."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from grpo_lab.tasks import default_task
    from tests.conftest import SMALL

    task = default_task()
    model = AutoModelForCausalLM.from_pretrained(task.model, **QUANTIZED)
    layers = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = True
    config = task.config(**{**SMALL, "output_dir": str(tmp_path)})
    session = GRPOSession(model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    session.generate(), session.score(), session.advantages(), session.loss()
    assert layers and not any(getattr(layer.weight.quant_state, "packing_format_for_cpu", False) for layer in layers)
    without_gradient = [n for n, p in session.model.named_parameters() if "lora_B" in n and not p.grad.abs().sum() > 0]
    assert not without_gradient


@pytest.mark.slow
def test_qlora_learns_the_task_with_the_base_model_as_reference(tmp_path):
    from peft import LoraConfig

    from grpo_lab.tasks import default_task

    task = default_task(eval_size=100)
    config = task.config(max_steps=40, learning_rate=5e-4, beta=0.001, model_init_kwargs=QUANTIZED,
                         output_dir=str(tmp_path))
    session = GRPOSession(
        task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    assert any(type(m).__name__ == "Linear4bit" for m in session.model.modules())
    assert session.engine.ref_model is None  # beta > 0: the reference is the 4-bit base, adapter disabled
    trainable = [name for name, p in session.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    before = task.evaluate(session.model, session.tokenizer)["greedy_accuracy"]
    session.run(40, progress=False)
    after = task.evaluate(session.model, session.tokenizer)["greedy_accuracy"]
    # Shipped model: 28% greedy on these 100 problems; 40 QLoRA steps reached 85% when measured.
    assert after >= before + 0.3, (before, after)
    assert session.history["kl"].notna().all() and session.history["kl"].iloc[-1] > 0
