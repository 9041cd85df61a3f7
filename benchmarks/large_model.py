"""The benchmarks' larger model: a randomly initialised 30M-parameter Llama with the shipped
tokenizer, where compute (not orchestration) dominates a step."""

from __future__ import annotations

from pathlib import Path


def large_model(workdir: Path, tokenizer_source: str) -> str:
    """The model's directory under ``workdir``, built (seed 0) on first use."""
    model_dir = workdir / "large_model"
    if not model_dir.exists():
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=256,
                             tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        LlamaForCausalLM(config).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    return str(model_dir)
