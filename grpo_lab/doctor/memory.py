"""The doctor's memory forecast: the memory the probe batch took, scaled to the longest sequences
the run can meet, against what is free.

Method. On CUDA: the growth of ``torch.cuda.max_memory_allocated`` over the probe (its peak
statistics are reset first), against the device's free memory plus the memory PyTorch holds but
does not use. On a CPU: the growth of the process's resident memory over the probe (its peak,
VmHWM, reset first where Linux allows it; else the resident size read after each stage), against
``psutil.virtual_memory().available``. The growth (activations, the generation cache, gradients) is
scaled linearly from the probe's longest sequence (prompt plus completion, as padded) to the
longest prompt of the training set plus ``max_completion_length``; the optimizer's state, which the
first ``update()`` allocates (AdamW: two moments per trainable parameter), is added where it does
not exist yet. Linear scaling suits attention with memory-efficient kernels (sdpa, flash); eager
attention grows faster. On a CPU, memory the allocator kept from earlier steps is reused without
growing the resident size, so the forecast there is a lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_lab.doctor.findings import Finding

_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _gib(count: float) -> str:
    return f"{count / 2**30:.2f} GiB"


@dataclass(frozen=True)
class MemoryReading:
    """What :class:`MemoryWatch` saw: bytes in use before the probe, the peak during it, bytes
    available before it, on which device, and how it was measured."""

    device: str
    baseline: int
    peak: int
    available: int
    method: str


def _resident_bytes(field: str = "VmRSS") -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    if field != "VmRSS":
        return None
    import psutil

    return psutil.Process().memory_info().rss


def _reset_resident_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")  # Linux: VmHWM starts again from the current resident size
    except OSError:
        return False
    return _resident_bytes("VmHWM") is not None


class MemoryWatch:
    """Measure the memory a block takes on ``device`` (see the module docstring); call ``sample()``
    between stages, read ``reading`` after the block."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def __enter__(self) -> MemoryWatch:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            free = torch.cuda.mem_get_info(self.device)[0]
            self.available = free + torch.cuda.memory_reserved(self.device) - self.baseline
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method = "CUDA max_memory_allocated over the probe"
        else:
            import psutil

            self.baseline, self.available = _resident_bytes(), psutil.virtual_memory().available
            self.high_water = _reset_resident_peak()
            self.method = ("process resident memory, peak (VmHWM) over the probe" if self.high_water
                           else "process resident memory after each stage of the probe")
        self.peak = self.baseline
        return self

    def sample(self) -> None:
        if not self.cuda:
            self.peak = max(self.peak, _resident_bytes())

    def __exit__(self, *exc) -> bool:
        if self.cuda:
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.sample()
            if self.high_water:
                self.peak = max(self.peak, _resident_bytes("VmHWM") or 0)
        return False

    @property
    def reading(self) -> MemoryReading:
        return MemoryReading(str(self.device), self.baseline, self.peak, self.available, self.method)


def optimizer_state_bytes(optimizer, model) -> int:
    """Bytes the optimizer's state will take at the first ``update()`` where it holds none yet: AdamW's
    two moments, each the size of every trainable parameter; 0 once it exists."""
    if any(optimizer.state.values()):
        return 0
    return 2 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def memory_forecast(reading: MemoryReading, *, probe_length: int, worst_length: int,
                    optimizer_bytes: int) -> list[Finding]:
    """A warning where the probe's memory growth scaled to ``worst_length`` tokens per sequence, plus
    the optimizer state still to come, exceeds the memory available (nothing otherwise)."""
    growth = max(reading.peak - reading.baseline, 0)
    scale = max(worst_length / max(probe_length, 1), 1.0)
    forecast = growth * scale + optimizer_bytes
    if forecast <= reading.available:
        return []
    return [Finding(
        "memory_forecast", "warning",
        f"A batch of the longest sequences this run can meet ({worst_length} tokens) would need about "
        f"{_gib(forecast)} more on {reading.device} than is in use now, and {_gib(reading.available)} is available: "
        "the run may fail with out-of-memory once such a batch comes. This is an estimate (method below).",
        {"in use before the probe": _gib(reading.baseline), "probe growth": _gib(growth),
         "probe sequence length": probe_length, "worst-case sequence length": worst_length,
         "scale": round(scale, 2), "optimizer state still to allocate": _gib(optimizer_bytes),
         "forecast": _gib(forecast), "available": _gib(reading.available), "method": reading.method},
        "Lower per_device_train_batch_size (raising gradient_accumulation_steps to keep the batch), lower "
        "max_completion_length, or set gradient_checkpointing=True; with LoRA (peft_config) the optimizer state "
        "shrinks to the adapter's.",
    )]


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed: CUDA's ``OutOfMemoryError``, or the CPU
    allocator's refusal (a ``RuntimeError`` that says it cannot allocate)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def probe_out_of_memory(error: BaseException, *, device: str, max_completion_length: int,
                        batch_size: int) -> Finding:
    """The finding for a probe that could not allocate what it needed: the run fails the same way at
    its first step."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return Finding(
        "probe_out_of_memory", "error",
        f"The probe batch itself ran out of memory on {device}: the first step of this run would fail the same "
        "way. Generation reserves its cache for prompt plus max_completion_length tokens per sequence, so a "
        "completion limit far above what completions need costs memory even when they end early.",
        {"error": first_line, "max_completion_length": max_completion_length,
         "per_device_train_batch_size": batch_size},
        "Lower max_completion_length to what completions need (a few times their usual length), lower "
        "per_device_train_batch_size (raising gradient_accumulation_steps to keep the batch), or set "
        "gradient_checkpointing=True; with LoRA (peft_config) the optimizer state shrinks to the adapter's.",
    )
