"""Colocated vLLM: the engine lives in the training process (one kernel in a notebook).

After every optimizer step the policy is handed over: the LoRA adapter is saved and passed with
the next requests (PEFT training; the only way on CPU), or the full weights are loaded into vLLM's
model (GPU). With ``vllm_enable_sleep_mode`` vLLM frees its GPU memory between generations.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from grpo_lab.rollout.batch import GeneratedBatch, batch_from_token_lists, draw_seeds, eos_token_ids, prompt_token_lists
from grpo_lab.rollout.hf import check_context_fits
from grpo_lab.rollout.vision import image_token_id
from grpo_lab.rollout.vllm_engine import (VLLMEngine, check_expanded_alike, import_vllm, on_gpu, sampling_settings,
                                          training_dtype, without_image_token)


class VLLMColocateBackend:
    name = "vllm-colocate"
    sends_images = True  # a vision-language model's prompts go to vLLM as tokens and images

    def __init__(self, config, *, model_fn, tokenizer, accelerator, vllm_model: str, lora_rank: int):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # a notebook cell, not a server log (read at import)
        import_vllm()  # a missing vLLM is the first thing to fix
        if accelerator.num_processes > 1:
            raise NotImplementedError(
                f"Colocated vLLM runs in a single process; this run has {accelerator.num_processes}. Start "
                "`grpo-lab vllm-serve` and set vllm_mode='server' (every process sends its prompts to it), or "
                "launch one process."
            )
        if not lora_rank and not on_gpu():
            raise ValueError(
                "use_vllm=True on CPU needs LoRA training: vLLM's CPU backend cannot take new full weights "
                "after an update, so generations would come from a stale policy. Pass "
                "peft_config=LoraConfig(...), or use a GPU, or set use_vllm=False."
            )
        self._model_fn, self.tokenizer, self.accelerator = model_fn, tokenizer, accelerator
        self.engine = VLLMEngine(
            vllm_model,
            max_lora_rank=lora_rank,
            enable_sleep_mode=config.vllm_enable_sleep_mode,
            seed=config.seed + accelerator.process_index,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            max_model_len=config.vllm_max_model_length,
            tensor_parallel_size=config.vllm_tensor_parallel_size,
            model_impl=config.vllm_model_impl,
            trust_remote_code=config.model_kwargs()["trust_remote_code"],
            dtype=training_dtype(config),  # the same precision on both sides keeps their log-probs close
        )
        self.enable_sleep_mode = config.vllm_enable_sleep_mode
        self.engine.sampling_params(sampling_settings(config), seed=0)  # bad generation_kwargs fail here, not later
        self.sync_weights(model_fn(), 0)

    def generate(self, prompts: list[str] | list[list[int]], config, *, image_inputs=None,
                 engine_prompts: list[dict] | None = None) -> GeneratedBatch:
        """Completions of ``prompts``; for a vision-language model, ``prompts`` are the processor's token
        ids (the batch's, for training) and ``engine_prompts`` what vLLM is sent, each prompt's tokens
        before the images are expanded and its images (:func:`grpo_lab.rollout.vision.engine_prompts`),
        ``image_inputs`` kept on the batch."""
        model = self._model_fn()
        prompt_ids_BP, prompt_mask_BP, token_lists = prompt_token_lists(self.tokenizer, prompts)
        check_context_fits(model, prompt_ids_BP.shape[1], config.max_completion_length)
        settings = without_image_token(sampling_settings(config), image_token_id(model))
        ids, logprobs, version, generated_after = self.engine.generate(
            token_lists if engine_prompts is None else engine_prompts, settings, draw_seeds(len(token_lists)))
        if engine_prompts is not None:
            check_expanded_alike(token_lists, generated_after)
        if self.enable_sleep_mode:
            self.engine.sleep()
        batch = batch_from_token_lists(
            prompt_ids_BP.to(self.accelerator.device), prompt_mask_BP.to(self.accelerator.device), ids, logprobs,
            pad_token_id=self.tokenizer.pad_token_id, eos_token_ids=eos_token_ids(self.tokenizer, model),
            policy_version=version,
        )
        batch.image_inputs_B = image_inputs
        return batch

    def sync_weights(self, model, version: int) -> None:
        if self.engine.uses_lora:
            directory = tempfile.mkdtemp(prefix="grpo_lab_adapter_")
            try:
                model.save_pretrained(directory)
                self.engine.load_adapter(directory, version)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
        else:
            self.engine.load_weights(model.state_dict().items(), version)

    def close(self) -> None:
        self.engine.close()


