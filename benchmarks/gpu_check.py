"""grpo_lab's device paths in one command: what runs on this machine's accelerator, how fast, and
what could not run, and why.

    python benchmarks/gpu_check.py                       # on a GPU: a 0.5B-class Qwen2 shape
    python benchmarks/gpu_check.py --device cpu          # the same checks, small (in the test suite)
    python benchmarks/gpu_check.py --wheelhouse benchmarks/wheelhouse   # install what is missing first

The model is randomly initialised (no hub) with the shipped tokenizer: on a GPU the shape of
Qwen2-0.5B (hidden 896, 24 layers, 14 query and 2 key/value heads, MLP 4864), its vocabulary the
shipped one's. The checks, each recorded as ``ok``, ``failed`` (with the error) or ``skipped`` (with
the reason):

- ``environment``: device, precision the default picks (``bf16=None``), package versions.
- ``speed_paths_fp32``: two sessions with one seed, grpo_lab's speed paths (``compact_forward``,
  ``share_prompt_prefix``) on and off, in float32: the sampled tokens must be equal, and the
  log-probs of one batch through both paths equal to float32 rounding.
- ``speed_paths_default``: the same in the default precision (bf16 on a GPU that has it): log-probs
  of one batch through both paths within bf16 tolerance, then each path's step time and peak memory.
- ``lora``: a LoRA session's steps, time and peak memory, with the speed paths on and off.
- ``loss_options``: two steps each through the loss path's other branches (a KL reference, a reused
  batch, the off-policy and entropy masks, cispo with an entropy bonus).
- ``trainer``: ``GRPOTrainer.train()`` for a few steps, a checkpoint, ``save_model()``.
- ``evaluation``: a trainer that evaluates at every step has the same history and weights as one
  that does not (evaluation restores every random generator, the accelerator's included), set
  against the difference between two runs without evaluation.
- ``trl``: TRL's GRPOTrainer on the same model and settings (step time, peak memory, tokens/s),
  where ``trl`` imports.
- ``vllm_colocate``: a colocated vLLM session's steps (full-weight sync), where ``vllm`` imports.

Results go to ``OUT/gpu_check.json`` and ``OUT/gpu_check.md``, rewritten after every check, so a run
cut short still reports what it reached. The exit status is 1 when a check failed.

``--wheelhouse DIR`` installs, before anything is imported, the packages missing here from wheels
in DIR (``pip install --no-index``): a machine without network access can be handed a small folder
of pure-Python wheels built here with ``--build-wheelhouse DIR``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

WHEELHOUSE_PACKAGES = ("trl", "rich", "markdown-it-py", "mdurl", "pygments", "datasets", "dill", "multiprocess",
                       "fsspec")
"""What the wheelhouse offers: the pure-Python packages the checks import (grpo_lab's training path
and TRL). Binary ones (pandas, pyarrow, xxhash) are not carried: a machine without them reports
what it could not run. The views' packages (plotly, ipywidgets) are not needed here."""

IMPORT_NAMES = {"trl": "trl", "rich": "rich", "datasets": "datasets", "pandas": "pandas", "pyarrow": "pyarrow"}
"""Distribution -> module, for the packages checked for before anything else is imported."""

SHAPES = {
    "cuda": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64),
    "cpu": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32),
}
"""Qwen2-0.5B's shape on a GPU; a tiny one of the same architecture on a CPU."""

SETTINGS = {
    "cuda": dict(per_device_train_batch_size=16, num_generations=8, max_completion_length=128, steps=4),
    "cpu": dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, steps=2),
}


def letter_share_reward(completions, **kwargs) -> list[float]:
    """The share of ASCII letters in each completion: random weights never earn the task's rewards,
    and a step whose advantages are all zero trains nothing."""
    from grpo_lab.tasks.addition import completion_text

    texts = [completion_text(c) for c in completions]
    return [sum(c.isascii() and c.isalpha() for c in text) / max(len(text), 1) for text in texts]


# ---------------------------------------------------------------------------------------------- set-up
def install_missing(wheelhouse: Path) -> dict:
    """pip-install from ``wheelhouse`` each checked package that does not import here."""
    missing = [name for name, module in IMPORT_NAMES.items() if importlib.util.find_spec(module) is None]
    offered = {path.name.split("-")[0].lower().replace("_", "-") for path in wheelhouse.glob("*.whl")}
    installable = [name for name in missing if name in offered]
    report = {"missing": missing, "installed": [], "install_errors": {}}
    for name in installable:  # one at a time: a package whose dependencies are not here leaves the others
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                   "--find-links", str(wheelhouse), name]
        done = subprocess.run(command, capture_output=True, text=True)
        # a distribution's Python: this machine is lent for the check
        if "externally-managed-environment" in done.stderr:
            done = subprocess.run([*command, "--break-system-packages"], capture_output=True, text=True)
        if done.returncode == 0:
            report["installed"].append(name)
        else:
            report["install_errors"][name] = done.stderr.strip()[-500:]
    importlib.invalidate_caches()
    return report


def build_wheelhouse(directory: Path) -> None:
    """Download the pure-Python wheels of :data:`WHEELHOUSE_PACKAGES` (no dependencies) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for python in ("3.10", "3.11", "3.12", "3.13"):  # some pure wheels (multiprocess) are per Python version
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--platform", "any", "--python-version", python, "--dest", str(directory),
                        *WHEELHOUSE_PACKAGES], check=False)
    total = sum(path.stat().st_size for path in directory.glob("*.whl")) / 2**20
    print(f"{len(list(directory.glob('*.whl')))} wheels, {total:.1f} MiB in {directory}")


def build_model(workdir: Path, device: str) -> tuple[str, object]:
    """A randomly initialised Qwen2 of :data:`SHAPES` ``[device]`` and the shipped tokenizer (passed
    as an object: for a ``qwen2`` directory AutoTokenizer would substitute Qwen2's tokenizer)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from grpo_lab.tasks import TINY_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    model_dir = workdir / "qwen2_random"
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=512, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, **SHAPES[device])
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    return str(model_dir), tokenizer


# ---------------------------------------------------------------------------------------------- measuring
class Memory:
    """Peak accelerator memory (MiB) since :meth:`reset`; on a CPU the process's peak resident set."""

    def __init__(self, device: str):
        self.device = device

    def reset(self) -> None:
        import torch

        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_mib(self) -> float:
        import resource

        import torch

        if self.device == "cuda":
            return torch.cuda.max_memory_allocated() / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed_steps(session, steps: int, device: str) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        session.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def step_summary(times: list[float], tokens: float, peak_mib: float) -> dict:
    timed = times[1:] or times  # the first step compiles and warms the allocator
    median = statistics.median(timed)
    return {"median_step_s": round(median, 4), "step_times_s": [round(t, 4) for t in times],
            "generated_tokens_per_s": round(tokens / median, 1), "peak_memory_mib": round(peak_mib, 1)}


# ---------------------------------------------------------------------------------------------- checks
class Checks:
    """The checks of the module docstring, sharing one model, dataset and output folder."""

    def __init__(self, device: str, workdir: Path, steps: int | None):
        from grpo_lab.tasks import default_task

        self.device, self.workdir = device, workdir
        self.settings = dict(SETTINGS[device])
        self.steps = steps or self.settings.pop("steps")
        self.settings.pop("steps", None)
        self.task = default_task(eval_size=8)
        self.model_dir, self.tokenizer = build_model(workdir, device)
        self.memory = Memory(device)
        self.reward_funcs = [*self.task.reward_funcs, letter_share_reward]

    def config(self, name: str, **overrides):
        from grpo_lab import GRPOConfig

        fields = dict(learning_rate=1e-5, beta=0.0, loss_type="dapo", temperature=1.0, gradient_checkpointing=False,
                      seed=0, logging_steps=1, report_to="none", save_steps=10**9, use_cpu=self.device == "cpu")
        return GRPOConfig(output_dir=str(self.workdir / name), **{**fields, **self.settings, **overrides})

    def session(self, name: str, **overrides):
        from grpo_lab import GRPOSession

        peft_config = overrides.pop("peft_config", None)
        return GRPOSession(self.model_dir, self.reward_funcs, args=self.config(name, **overrides),
                           train_dataset=self.task.train_dataset, processing_class=self.tokenizer,
                           peft_config=peft_config)

    def tokens_per_step(self, session) -> float:
        mean_length = float(session.history["completions/mean_length"].iloc[1:].mean())
        return mean_length * self.settings["per_device_train_batch_size"]

    def environment(self) -> dict:
        import torch

        from grpo_lab import GRPOConfig

        versions = {}
        for name in ("torch", "transformers", "accelerate", "peft", "datasets", "trl", "vllm", "deepspeed",
                     "bitsandbytes"):
            try:
                versions[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                versions[name] = None
        device_name = (torch.cuda.get_device_name(0) if self.device == "cuda"
                       else platform.processor() or platform.machine())
        precision = GRPOConfig(output_dir=str(self.workdir / "probe"),
                               use_cpu=self.device == "cpu").resolved_precision()
        return {"device": device_name, "default_precision": precision, "python": platform.python_version(),
                "versions": versions, "model_parameters": self._parameters()}

    def _parameters(self) -> int:
        from transformers import AutoConfig, AutoModelForCausalLM

        with __import__("torch").device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_dir))
        return sum(p.numel() for p in model.parameters())

    def _paths(self, precision_overrides: dict) -> tuple:
        """The fast and the plain session from one seed, each with its first batch generated (one
        after the other: building a session seeds the process's random generators)."""
        fast = self.session("fast", **precision_overrides)
        fast_rollout = fast.generate()
        plain = self.session("plain", compact_forward=False, share_prompt_prefix=False, **precision_overrides)
        return fast, plain, fast_rollout, plain.generate()

    def _logprob_gap(self, session, rollout) -> dict:
        """The largest and mean absolute difference between the log-probs of ``rollout`` through the
        speed paths and through transformers' plain forward, on the session's model."""
        import torch

        engine, index_B = session.engine, torch.arange(len(rollout))
        mask_BT = rollout.completion_mask_BT.bool()
        results = []
        for fast in (True, False):
            session.config.compact_forward = session.config.share_prompt_prefix = fast
            with torch.no_grad():
                results.append(engine.sequence_logprobs(engine.model, rollout, index_B, with_entropy=False)[0].float())
        session.config.compact_forward = session.config.share_prompt_prefix = True
        gap = (results[0] - results[1]).abs()[mask_BT]
        return {"logprob_max_abs_diff": float(gap.max()), "logprob_mean_abs_diff": float(gap.mean())}

    def speed_paths_fp32(self) -> dict:
        import torch

        fast, plain, fast_rollout, plain_rollout = self._paths({"bf16": False})
        same = torch.equal(fast_rollout.completion_ids_BT.cpu(), plain_rollout.completion_ids_BT.cpu())
        result = {"sampled_tokens_equal": same, **self._logprob_gap(fast, fast_rollout)}
        fast.close(), plain.close()
        result["ok"] = same and result["logprob_max_abs_diff"] < 1e-3
        return result

    def speed_paths_default(self) -> dict:
        fast = self.session("fast_default")
        gap = self._logprob_gap(fast, fast.generate())
        fast.discard_batch()
        result = {"precision": fast.config.resolved_precision(), **gap}
        # bf16 keeps 8 bits of mantissa: log-probs around -6 move by a few hundredths between two
        # orders of the same sums; far more than that means the paths compute different things.
        tolerance = 0.25 if result["precision"] != "fp32" else 1e-3
        result["ok"] = gap["logprob_max_abs_diff"] < tolerance
        del fast
        for name, overrides in (("fast", {}), ("plain", {"compact_forward": False, "share_prompt_prefix": False})):
            self.memory.reset()
            session = self.session(f"{name}_timed", **overrides)
            times = timed_steps(session, self.steps, self.device)
            result[name] = step_summary(times, self.tokens_per_step(session), self.memory.peak_mib())
            session.close()
            del session
        result["fast_vs_plain_step_time"] = round(result["fast"]["median_step_s"] / result["plain"]["median_step_s"], 3)
        return result

    def lora(self) -> dict:
        """A LoRA session's steps with the speed paths on and off."""
        from peft import LoraConfig

        result = {"ok": True}
        for name, overrides in (("fast", {}), ("plain", {"compact_forward": False, "share_prompt_prefix": False})):
            self.memory.reset()
            adapter = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
            session = self.session(f"lora_{name}", learning_rate=1e-4, peft_config=adapter, **overrides)
            times = timed_steps(session, self.steps, self.device)
            result[name] = step_summary(times, self.tokens_per_step(session), self.memory.peak_mib())
            result["ok"] &= bool(session.history["grad_norm"].gt(0).all())
            session.close()
            del session
        result["fast_vs_plain_step_time"] = round(result["fast"]["median_step_s"] / result["plain"]["median_step_s"], 3)
        return result

    def loss_options(self) -> dict:
        """The loss path's other branches on this device: a reference model (beta), a reused batch
        (importance ratios), the off-policy mask, the entropy mask and an entropy bonus, cispo."""
        result = {"ok": True}
        for name, overrides in (
            ("kl_reused_batch_masks", dict(beta=0.04, num_iterations=2, off_policy_mask_threshold=0.5,
                                           top_entropy_quantile=0.5, mask_truncated_completions=True)),
            ("cispo_entropy_bonus", dict(loss_type="cispo", epsilon_high=5.0, num_iterations=2, entropy_coef=0.01)),
        ):
            session = self.session(f"options_{name}", **overrides)
            session.run(2, progress=False)
            last = session.history.iloc[-1]
            finite = bool(session.history[["loss", "grad_norm"]]
                          .apply(lambda column: column.map(math.isfinite)).all().all())
            result[name] = {"loss": float(last["loss"]), "kl": float(last["kl"]) if "kl" in last else None,
                            "finite": finite}
            result["ok"] &= result[name]["finite"]
            session.close()
            del session
        return result

    def trainer(self) -> dict:
        from grpo_lab import GRPOTrainer

        self.memory.reset()
        output_dir = self.workdir / "trainer"
        trainer = GRPOTrainer(self.model_dir, self.reward_funcs,
                              args=self.config("trainer", max_steps=self.steps, save_steps=self.steps),
                              train_dataset=self.task.train_dataset, processing_class=self.tokenizer)
        start = time.perf_counter()
        trainer.train()
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        trainer.save_model(output_dir / "final")
        checkpoints = sorted(path.name for path in output_dir.glob("checkpoint-*"))
        saved = (output_dir / "final" / "model.safetensors").exists()
        return {"train_s": round(elapsed, 2), "steps": self.steps, "checkpoints": checkpoints, "save_model": saved,
                "peak_memory_mib": round(self.memory.peak_mib(), 1), "ok": saved and bool(checkpoints)}

    def evaluation(self) -> dict:
        """A trainer that evaluates at every step trains as one that does not: the same history and
        weights. The run without evaluation is made twice, to tell evaluation's effect from the
        device's own run-to-run differences (a GPU's nondeterministic kernels), and the run with
        evaluation is set against the second (the first in a process also warms the kernels up)."""
        import torch

        from grpo_lab import GRPOTrainer

        def run(name: str, **overrides):
            args = self.config(name, max_steps=self.steps, per_device_eval_batch_size=4, **overrides)
            trainer = GRPOTrainer(self.model_dir, self.reward_funcs, args=args, train_dataset=self.task.train_dataset,
                                  eval_dataset=self.task.eval_dataset, processing_class=self.tokenizer)
            trainer.train()
            weights = {k: v.detach().float().cpu() for k, v in trainer.model.state_dict().items()}
            evaluations = sum("eval_reward" in row for row in trainer.state.log_history)
            history = trainer.session.history.drop(columns=["step_time"])
            del trainer
            gc.collect()
            return history, weights, evaluations

        def gap(first, second) -> tuple[bool, float]:
            same_history = first[0].equals(second[0])
            return same_history, max(float((first[1][k] - second[1][k]).abs().max()) for k in first[1])

        def first_difference(first, second) -> str | None:
            for step, (a, b) in enumerate(zip(first[0].to_dict("records"), second[0].to_dict("records")), 1):
                differing = [key for key in a if a[key] != b.get(key) and a[key] == a[key]]
                if differing:
                    return f"step {step}: {', '.join(differing[:6])}"
            return None

        # CUDA's atomics (index_add in the backward of prompt sharing, among others) make two runs differ
        # in their last bits; torch's deterministic algorithms make the comparison exact where they exist
        deterministic = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            first, plain = run("without_evaluation"), run("without_evaluation_again")
            evaluated = run("with_evaluation", eval_strategy="steps", eval_steps=1)
        finally:
            torch.use_deterministic_algorithms(deterministic)
        repeat_history, repeat_diff = gap(first, plain)
        history, diff = gap(plain, evaluated)
        if self.device == "cuda":
            torch.cuda.empty_cache()
        return {"evaluations": evaluated[2], "repeat_history_equal": repeat_history,
                "repeat_weights_max_abs_diff": repeat_diff, "history_equal": history,
                "weights_max_abs_diff": diff, "first_difference": first_difference(plain, evaluated),
                "ok": evaluated[2] == self.steps and (history or not repeat_history) and diff <= repeat_diff}

    def trl(self) -> dict:
        if importlib.util.find_spec("trl") is None:
            return {"skipped": "trl does not import here"}
        import trl
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        stamps, lengths = [], []

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                synchronize(device)
                stamps.append([time.perf_counter()])

            def on_step_end(self, args, state, control, **kwargs):
                synchronize(device)
                stamps[-1].append(time.perf_counter())

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "completions/mean_length" in logs:
                    lengths.append(logs["completions/mean_length"])

        device = self.device
        self.memory.reset()
        settings = {key: value for key, value in self.settings.items()}
        config = GRPOConfig(output_dir=str(self.workdir / "trl"), max_steps=self.steps, learning_rate=1e-5, beta=0.0,
                            loss_type="dapo", temperature=1.0, gradient_checkpointing=False, seed=0, logging_steps=1,
                            report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=device == "cpu",
                            bf16=device == "cuda" and __import__("torch").cuda.is_bf16_supported(), **settings)
        trainer = GRPOTrainer(model=self.model_dir, reward_funcs=self.reward_funcs, args=config,
                              train_dataset=self.task.train_dataset, processing_class=self.tokenizer,
                              callbacks=[Clock()])
        trainer.train()
        times = [end - begin for begin, end in stamps]
        tokens = statistics.mean(lengths[1:] or lengths) * settings["per_device_train_batch_size"]
        return {"version": trl.__version__, **step_summary(times, tokens, self.memory.peak_mib()), "ok": True}

    def vllm_colocate(self) -> dict:
        if self.device != "cuda":
            return {"skipped": "vLLM colocate is checked on a GPU (the CPU build runs in its own environment)"}
        if importlib.util.find_spec("vllm") is None:
            return {"skipped": "vllm does not import here"}
        self.memory.reset()
        session = self.session("vllm", use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)
        times = timed_steps(session, self.steps, self.device)
        result = step_summary(times, self.tokens_per_step(session), self.memory.peak_mib())
        session.close()
        return {**result, "ok": True}


ORDER = ("environment", "speed_paths_fp32", "speed_paths_default", "lora", "loss_options", "trainer", "evaluation",
         "trl", "vllm_colocate")


def markdown(report: dict) -> str:
    env = report["checks"].get("environment", {})
    lines = [f"# gpu_check on {env.get('device', report['device'])}", "",
             f"precision by default: {env.get('default_precision')}; model parameters: {env.get('model_parameters')}; "
             f"versions: {json.dumps(env.get('versions'))}", "",
             "| check | status | median step (s) | peak memory (MiB) | tokens/s | details |",
             "|---|---|---|---|---|---|"]
    for name in ORDER:
        if name == "environment" or name not in report["checks"]:
            continue
        result = report["checks"][name]
        rows = [(name, result)] + [(f"{name}: {key}", value) for key, value in result.items()
                                   if isinstance(value, dict)]
        for label, row in rows:
            details = {k: v for k, v in row.items() if not isinstance(v, (dict, list)) and k not in
                       ("status", "median_step_s", "peak_memory_mib", "generated_tokens_per_s", "error")}
            if row.get("error"):
                details["error"] = row["error"].strip().splitlines()[-1][:200]
            lines.append(f"| {label} | {row.get('status', '')} | {row.get('median_step_s', '')} | "
                         f"{row.get('peak_memory_mib', '')} | {row.get('generated_tokens_per_s', '')} | "
                         f"{json.dumps(details)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda where available")
    parser.add_argument("--out", type=Path, default=Path("gpu_check_results"), help="folder for the JSON and markdown")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default: 4 on a GPU, 2 on a CPU)")
    parser.add_argument("--only", nargs="+", choices=ORDER, default=None, help="run these checks only")
    parser.add_argument("--wheelhouse", type=Path, default=None,
                        help="install missing packages from these wheels first")
    parser.add_argument("--build-wheelhouse", type=Path, default=None, metavar="DIR",
                        help="download the wheels and stop")
    args = parser.parse_args()
    if args.build_wheelhouse:
        build_wheelhouse(args.build_wheelhouse)
        return 0
    installed = install_missing(args.wheelhouse) if args.wheelhouse else None

    # cuBLAS is deterministic only with a fixed workspace (set before CUDA starts); the evaluation
    # check compares runs bit for bit
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here (torch.cuda.is_available() is False)")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": device, "wheelhouse": installed, "checks": {}}

    def write() -> None:
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        (args.out / "gpu_check.md").write_text(markdown(report))

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as workdir:
        try:
            checks = Checks(device, Path(workdir), args.steps)
        except Exception:
            report["checks"]["set-up"] = {"status": "failed", "error": traceback.format_exc()}
            write()
            print(traceback.format_exc(), file=sys.stderr)
            return 1
        for name in args.only or ORDER:
            started = time.perf_counter()
            try:
                result = getattr(checks, name)()
                status = "skipped" if "skipped" in result else ("ok" if result.pop("ok", True) else "failed")
                result = {"status": status, **result}
            except Exception:
                result = {"status": "failed", "error": traceback.format_exc()}
            result["wall_s"] = round(time.perf_counter() - started, 1)
            report["checks"][name] = result
            print(f"{name}: {result['status']} ({result['wall_s']} s)", file=sys.stderr, flush=True)
            if result["status"] == "failed":
                print(result.get("error", json.dumps(result)), file=sys.stderr)
            write()
    print(markdown(report))
    return int(any(result["status"] == "failed" for result in report["checks"].values()))


if __name__ == "__main__":
    sys.exit(main())
