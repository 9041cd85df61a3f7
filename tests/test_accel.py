"""The optional speed paths (grpo_lab.accel) load only when a run takes them, and a path that
transformers changed under (a missing internal) is turned off with one warning: the run steps on
the pass that the setting's False gives, with the same numbers."""

import json
import subprocess
import sys
import types
import warnings

import pytest
import transformers.models.llama.modeling_llama as modeling_llama

import grpo_lab.accel
from grpo_lab.accel import compact_forward

LOADED_SPEED_PATHS = "sorted(name for name in sys.modules if name.startswith('grpo_lab.accel.'))"


def _in_a_fresh_process(code: str, stderr: list | None = None):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    if stderr is not None:
        stderr.append(done.stderr)
    return json.loads(done.stdout.splitlines()[-1])


def test_importing_the_package_and_the_engine_loads_no_speed_path():
    assert _in_a_fresh_process(
        f"import json, sys\nimport grpo_lab, grpo_lab.core.engine\nprint(json.dumps({LOADED_SPEED_PATHS}))"
    ) == []


def test_a_run_that_turns_the_speed_paths_off_never_loads_them_nor_deepspeed_and_no_library_notice_is_printed(
        tmp_path):
    code = f"""
import json, sys
from grpo_lab import GRPOConfig, GRPOSession
from grpo_lab.tasks import default_task
from tests.conftest import SMALL

task = default_task()
config = GRPOConfig(**{{**SMALL, "output_dir": {str(tmp_path)!r}}}, compact_forward=False, share_prompt_prefix=False,
                    keep_freed_cpu_memory=False, use_cpu=True)
session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset)
session.step()
print(json.dumps([*{LOADED_SPEED_PATHS}, *(["deepspeed"] if "deepspeed" in sys.modules else [])]))
"""
    stderr = []
    assert _in_a_fresh_process(code, stderr) == []
    # bitsandbytes (imported by transformers' trainer utilities through peft) and DeepSpeed (whose
    # import says which accelerator it found) print nothing into a run that uses neither
    assert "gemm_4bit" not in stderr[0] and "Setting accelerator" not in stderr[0] and "WARNING" not in stderr[0]


def _steps(session, count=2):
    rows = [session.step() for _ in range(count)]
    for row in rows:
        row.pop("step_time")
    return rows


def _run(make_session, **overrides):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = make_session(max_steps=2, **overrides)
        rows = _steps(session)
    notes = [str(w.message) for w in caught if "does not work with this transformers version" in str(w.message)]
    return rows, [p.detach().clone() for p in session.model.parameters()], notes, session


def _same_run(one, other):
    (rows, weights, *_), (other_rows, other_weights, *_) = one, other
    assert json.dumps(rows) == json.dumps(other_rows)  # every metric, bit for bit (NaN included)
    assert all(a.equal(b) for a, b in zip(weights, other_weights, strict=True))


def test_a_transformers_without_an_internal_the_compact_pass_imports_runs_the_plain_pass(make_session, monkeypatch):
    """transformers renamed LlamaMLP: the compact pass and the sampling loop no longer import. The run
    warns once and steps as a run with compact_forward=False does, bit for bit."""
    plain = _run(make_session, compact_forward=False)
    renamed = types.ModuleType(modeling_llama.__name__)  # the module as importers see it, without LlamaMLP
    renamed.__dict__.update({k: v for k, v in vars(modeling_llama).items() if k not in ("LlamaMLP", "__name__")})
    monkeypatch.setitem(sys.modules, modeling_llama.__name__, renamed)
    for name in ("compact_forward", "decoding"):  # imported afresh, against the changed transformers
        monkeypatch.delitem(sys.modules, f"grpo_lab.accel.{name}", raising=False)
        monkeypatch.delattr(grpo_lab.accel, name, raising=False)
    broken = _run(make_session)
    assert broken[2] == [
        "compact_forward is on, but grpo_lab's compact forward pass does not work with this transformers version "
        f"(ImportError: cannot import name 'LlamaMLP' from 'transformers.models.llama.modeling_llama' "
        f"({modeling_llama.__file__})), so transformers' plain path runs instead. Set compact_forward=False to "
        "silence this note."
    ]
    assert set(broken[3].engine.speed_paths.off) == {"compact_forward", "decoding"}
    _same_run(broken, plain)


def test_a_model_internal_missing_at_run_time_turns_the_compact_pass_off(make_session, monkeypatch):
    """The modules import, but a model lacks an attribute they read (AttributeError): generation and
    the log-prob passes fall back on their first use, with one warning, and the run is the plain one."""
    plain = _run(make_session, compact_forward=False)

    def missing(*args, **kwargs):
        raise AttributeError("'LlamaModel' object has no attribute 'rotary_emb'")

    monkeypatch.setattr(compact_forward, "forward", missing)
    monkeypatch.setattr(compact_forward, "shared_prompt_forward", missing)
    broken = _run(make_session)
    assert broken[2] == [
        "compact_forward is on, but grpo_lab's sampling loop does not work with this transformers version "
        "(AttributeError: 'LlamaModel' object has no attribute 'rotary_emb'), so transformers' plain path runs "
        "instead. Set compact_forward=False to silence this note."
    ]
    assert set(broken[3].engine.speed_paths.off) == {"compact_forward", "decoding"}
    _same_run(broken, plain)


def test_prompt_sharing_that_fails_falls_back_to_whole_rows(make_session, monkeypatch):
    """With prefix sharing's cache handling broken (AttributeError), the run is the one with
    share_prompt_prefix=False."""
    from grpo_lab.accel import prefix_sharing

    plain = _run(make_session, share_prompt_prefix=False, compact_forward=False)

    def missing(cache, index_B):
        raise AttributeError("'DynamicCache' object has no attribute 'layers'")

    monkeypatch.setattr(prefix_sharing, "_select_rows", missing)
    broken = _run(make_session, compact_forward=False)
    assert broken[2] == [
        "share_prompt_prefix is on, but prompt prefix sharing does not work with this transformers version "
        "(AttributeError: 'DynamicCache' object has no attribute 'layers'), so transformers' plain path runs "
        "instead. Set share_prompt_prefix=False to silence this note."
    ]
    _same_run(broken, plain)


@pytest.mark.parametrize("path", ["plain", "shared_prompt", "compact"])
def test_one_function_picks_the_path(make_session, path):
    from grpo_lab.core.policy_forward import pick_path

    settings = {"plain": dict(share_prompt_prefix=False), "shared_prompt": dict(compact_forward=False), "compact": {}}
    session = make_session(**settings[path])
    rollout = session.generate()
    config = session.config
    assert pick_path(session.model, rollout.completion_mask_BT, session.engine.speed_paths,
                     share_prompt_prefix=config.share_prompt_prefix, compact_forward=config.compact_forward) == path
    # the load-balancing loss is over whole rows: a pass that returns it is always plain
    assert pick_path(session.model, rollout.completion_mask_BT, session.engine.speed_paths, share_prompt_prefix=True,
                     compact_forward=True, router_aux_loss=True) == "plain"


def test_a_model_loaded_with_hub_kernels_on_trains_on_a_cpu_with_them_off_and_the_same_outputs(make_session, task):
    # transformers turns hub kernels on at load where the kernels package is installed, then walks every
    # module at each train() / eval() that changes the mode; no hub kernel runs on a CPU
    import torch
    from transformers import AutoModelForCausalLM

    pytest.importorskip("kernels", reason="without the kernels package transformers loads no model with hub kernels")
    model = AutoModelForCausalLM.from_pretrained(task.model)
    assert model.use_kernels
    ids_BL = torch.arange(24).view(2, 12)
    with torch.no_grad():
        before = model(ids_BL).logits
    session = make_session(model=model)
    assert session.model is model and not model.use_kernels
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids_BL).logits, before)
    session.step()
