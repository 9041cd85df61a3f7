"""Optional speed paths: faster ways to run what transformers runs, imported only when a run takes them.

- ``compact_forward``: the forward pass of Llama, Qwen2 and Qwen3 models through their own modules
  (``compact_forward=True``);
- ``decoding``: a sampling loop on that forward pass, in place of ``model.generate``
  (``compact_forward=True``);
- ``prefix_sharing``: a group's shared prompt run once (``share_prompt_prefix=True``);
- ``kv_buffer``: a key/value cache that generation writes in place (with ``share_prompt_prefix``);
- ``host_memory``: freed CPU memory kept for the next step (``keep_freed_cpu_memory=True``).

Nothing imports them at module level: only this package's ``__init__`` (the standard library and
``grpo_lab.notices``) loads with ``grpo_lab.core.engine``. The first four reach into transformers' model
internals (module classes, cache layers), which transformers may rename in any release:
``SpeedPaths`` imports one when a run first takes its path, and a path that fails to import, or to
run against the model's internals (``TRANSFORMERS_CHANGED``), is turned off for the run with one
warning per setting, the pass that the setting's ``False`` gives taking its place. ``host_memory``
uses the C library alone and is imported where a run sets ``keep_freed_cpu_memory``.
"""

from __future__ import annotations

import importlib
import sys

from grpo_lab import notices

TRANSFORMERS_CHANGED = (ImportError, AttributeError)
"""What a speed path raises where transformers renamed or removed an internal it uses."""

_PATHS = {  # module: (what it is, in a warning; the setting that turns it on)
    "compact_forward": ("grpo_lab's compact forward pass", "compact_forward"),
    "decoding": ("grpo_lab's sampling loop", "compact_forward"),
    "prefix_sharing": ("prompt prefix sharing", "share_prompt_prefix"),
    "kv_buffer": ("generation's in-place key/value cache", "share_prompt_prefix"),
}


class SpeedPaths:
    """The speed paths of one run: each module imported on first use, each turned off (with one
    warning per setting) where it fails against this transformers, and the run's one ``PrefixSharing``
    (shared by generation and the log-prob passes, so that a cache that cannot be shared is found
    out, and warned about, once)."""

    def __init__(self, *, quiet: bool = False, prefix_sharing=None):
        self.quiet = quiet  # no warnings (the processes of a multi-process run but the main one)
        self.off: dict[str, str] = {}  # module -> why it was turned off
        self._prefix_sharing = prefix_sharing

    def module(self, name: str):
        """``grpo_lab.accel.<name>``, imported now if it was not; None where it is off."""
        if name in self.off:
            return None
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except TRANSFORMERS_CHANGED as error:
            self.turn_off(name, error)
            return None

    def turn_off(self, name: str, error: BaseException) -> None:
        """Stop using speed path ``name`` for this run, because of ``error``; warn unless a path of
        the same setting was turned off before."""
        what, setting = _PATHS[name]
        warned = any(_PATHS[other][1] == setting for other in self.off)
        self.off[name] = f"{type(error).__name__}: {error}"
        if not warned and not self.quiet:
            notices.warn(
                f"{setting} is on, but {what} does not work with this transformers version ({self.off[name]}), so "
                f"transformers' plain path runs instead. Set {setting}=False to silence this note."
            )

    def prefix_sharing(self):
        """The run's ``prefix_sharing.PrefixSharing``, made on first use; None where the module is off."""
        if "prefix_sharing" in self.off:
            return None
        if self._prefix_sharing is None:
            module = self.module("prefix_sharing")
            self._prefix_sharing = None if module is None else module.PrefixSharing()
        return self._prefix_sharing

    def compact_reason(self, model) -> str | None:
        """Why the compact forward pass cannot run ``model`` (``compact_forward.unsupported_reason``),
        None when it can; where the pass is off for this run, why it was turned off."""
        module = self.module("compact_forward")
        try:
            return self.off.get("compact_forward") or module.unsupported_reason(model)
        except TRANSFORMERS_CHANGED as error:
            self.turn_off("compact_forward", error)
            return self.off["compact_forward"]


def release_freed_memory() -> None:
    """Return the free memory that ``keep_freed_cpu_memory`` kept to the kernel; nothing to do where no
    run of this process imported ``host_memory`` (which alone keeps any)."""
    module = sys.modules.get(f"{__name__}.host_memory")
    if module is not None:
        module.release_freed_memory()
