"""One-step-off generation (``GRPOConfig.async_generation``): the next generation batch is generated
while this one trains.

At ``generate()`` for the batch of step k (weights W_k), the batch prepared at the previous
``generate()`` is taken (it was generated with the weights of then, W_{k-s}, s the optimizer steps
one batch feeds: ``steps_per_batch``, 1 by default), and the batch after it is launched with W_k. The
loss corrects the lag with the importance weights TRL applies to vLLM's sampling log-probs
(``vllm_importance_sampling_correction``): old log-probs are computed with the training weights when
a batch is taken, so the ratio pi_old / pi_sampler covers both the engine's kernels and the lag.

Where the batch is generated decides what overlaps:
- a vLLM server (``vllm_mode="server"``) is another process: the launch sends its request from a
  worker thread, and the server generates while this process scores, computes the log-prob passes,
  the loss and the update (real overlap, bounded by the training time);
- in-process backends (transformers, colocated vLLM) share the trainer's device and Python thread:
  the launch generates at once, inside ``generate()``, so nothing overlaps; the batches are one step
  stale all the same, which is what a study of staleness needs on a machine without a server.

With ``dynamic_sampling`` a prepared batch is one round: each round taken launches the next (with a
server, the round after this one is generated while this one is scored); the first round of a batch
was launched by the last round of the batch before (``steps_per_batch`` optimizer steps older), the
further rounds with the current weights. A batch's ``policy_version`` is its first round's, the oldest.

Weights reach the server only with nothing in flight (``Engine.publish_weights`` waits for the batch
first), so which weights a batch is generated with never depends on timing: runs are deterministic
and a checkpoint holds the prepared batch itself (:meth:`GenerationAhead.state_dict` waits for it),
so that a resumed run trains on the very batch the uninterrupted one would have.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

from grpo_lab.errors import ConfigError
from grpo_lab.rollout.batch import GeneratedBatch

_BATCH_TENSORS = ("prompt_ids_BP", "prompt_mask_BP", "completion_ids_BT", "completion_mask_BT", "is_truncated_B",
                  "sampling_logprobs_BT")


def check_async_generation(config, custom_rollout) -> None:
    """Refuse ``async_generation`` where a batch is not the backend's completions of drawn prompts
    alone: with a rollout function, tools or environments (they run in the trainer's thread, between
    turns)."""
    if config.async_generation and custom_rollout is not None:
        raise ConfigError(
            "async_generation is not supported with rollout_func, tools or environment_factory yet: their turns run "
            "in the trainer's process between generations. Turn async_generation off."
        )


@dataclass
class DrawnRound:
    """A generation batch's prompts before generation: this process's rows (``prompt`` taken out),
    their prompts, their dataset indices and each completion's group."""

    rows: dict[str, list]
    prompts: list
    indices: list[int]
    group_B: list[int]
    environments: list | None = None  # live instances (environment_factory), never saved


@dataclass
class _Prepared:
    """The batch launched one ``generate()`` ahead: its prompts, the step whose weights generate it,
    and its completions once done (``future`` while a server generates them)."""

    drawn: DrawnRound
    version: int
    call: object | None = None  # the server request (re-sent after a failure), None in-process
    future: Future | None = None
    batch: GeneratedBatch | None = None
    finished_at: float | None = None
    launched_at: float = field(default_factory=time.perf_counter)
    waited: float = 0.0  # seconds the trainer spent waiting for it (after an update, and when it is taken)


class Taken(NamedTuple):
    """A prepared batch as :meth:`GenerationAhead.take` hands it over."""

    drawn: DrawnRound
    batch: GeneratedBatch
    version: int
    timing: dict[str, float]


class GenerationAhead:
    """The batch prepared one ``generate()`` ahead (``generation_stage.ahead``): launched, waited for,
    taken, saved and loaded. ``paused`` (a what-if or the doctor's probe, inside ``Engine.scratch``)
    leaves it alone: those generate their own batches."""

    def __init__(self, stage):
        self.stage = stage
        self.paused = False
        self._prepared: _Prepared | None = None
        self._executor: ThreadPoolExecutor | None = None

    def active(self, config) -> bool:
        return bool(config.async_generation) and not self.paused

    # ------------------------------------------------------------------ the batch of a generate()
    def take(self) -> Taken:
        """The prepared batch (generated now where none is: the run's first, or after a load without
        one) and the timing metrics, with the next batch launched with the current weights. Inside
        :meth:`one_generate`, which undoes it after a failure."""
        if self._prepared is None:
            self._prepared = self._launch()
        self.wait()
        prepared, self._prepared = self._prepared, None
        self._prepared = self._launch()
        timing = {
            "async_generation/trainer_wait": prepared.waited,
            "async_generation/generator_idle": self._prepared.launched_at - prepared.finished_at,
        }
        return Taken(prepared.drawn, prepared.batch, prepared.version, timing)

    @contextmanager
    def one_generate(self):
        """Around one ``generate()``, whatever it takes (one batch, or with ``dynamic_sampling`` one
        round after another): after a failure or interrupt anywhere inside, things are as before it,
        the batch prepared then prepared again (none on the run's first) and the sampler where it
        stood, so that the next ``generate()`` takes the same batches; a batch launched inside is
        dropped, its request (with a server) waited out once that is done."""
        sampler_state = self.stage.engine.sampler.state_dict()
        before = self._prepared
        try:
            yield
        except BaseException:
            dropped, self._prepared = self._prepared, before
            self.stage.engine.sampler.load_state_dict(sampler_state)
            if dropped is not None and dropped is not before:
                _wait_out(dropped)
            raise

    def _launch(self) -> _Prepared:
        """Draw the next batch's prompts and start its generation with the current weights."""
        stage = self.stage
        engine = stage.engine
        drawn = stage.draw_round()
        prepared = _Prepared(drawn, engine.global_step)
        request = getattr(engine.rollout_backend, "generate_later", None)
        if request is None:  # in-process: generated here and now
            prepared.batch = stage.backend_generate(drawn.prompts, drawn.rows)
            prepared.finished_at = time.perf_counter()
            return prepared
        prepared.call = request(stage.rendered(drawn.prompts), engine.config)  # tokens and seeds drawn here
        self._submit(prepared)
        return prepared

    def _submit(self, prepared: _Prepared) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo_lab_generation_ahead")

        def generate():
            batch = prepared.call()
            prepared.finished_at = time.perf_counter()
            return batch

        prepared.future = self._executor.submit(generate)

    def wait(self) -> None:
        """Wait for the batch in flight, if any. A failed request is sent again by the next wait (the
        same prompts and seeds); an interrupt leaves it in flight, waited for again next time."""
        prepared = self._prepared
        if prepared is None or prepared.batch is not None:
            return
        if prepared.future is None:  # failed before: the same request again
            self._submit(prepared)
        started = time.perf_counter()
        try:
            prepared.batch = prepared.future.result()
        except Exception:
            prepared.future = None
            raise
        finally:
            prepared.waited += time.perf_counter() - started
        prepared.future = None

    def discard(self) -> None:
        """Drop the prepared batch (waiting for a request in flight to end first)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            _wait_out(prepared)

    def close(self) -> None:
        self.discard()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict | None:
        """The prepared batch, waited for (None where there is none)."""
        self.wait()
        prepared = self._prepared
        if prepared is None:
            return None
        batch = prepared.batch
        return {
            "drawn": {"rows": prepared.drawn.rows, "prompts": prepared.drawn.prompts,
                      "indices": prepared.drawn.indices, "group_B": prepared.drawn.group_B},
            "version": prepared.version,
            "batch": {name: None if getattr(batch, name) is None else getattr(batch, name).detach().cpu().clone()
                      for name in _BATCH_TENSORS} | {"policy_version": batch.policy_version},
        }

    def load_state_dict(self, state: dict | None) -> None:
        self.discard()
        if state is None:
            return
        device = self.stage.engine.accelerator.device
        tensors = {name: None if state["batch"][name] is None else state["batch"][name].to(device)
                   for name in _BATCH_TENSORS}
        batch = GeneratedBatch(**tensors, policy_version=state["batch"]["policy_version"])
        self._prepared = _Prepared(DrawnRound(**state["drawn"]), int(state["version"]),
                                   batch=batch, finished_at=time.perf_counter())


def _wait_out(prepared: _Prepared) -> None:
    """Wait for a dropped batch's request in flight, if any, to end (its result is not wanted)."""
    if prepared.future is not None:
        try:
            prepared.future.result()
        except Exception:  # noqa: BLE001 - its result is not wanted either way
            pass
