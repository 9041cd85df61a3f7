"""Saves never delete what grpo_lab did not write, survive interruption, and load without running code."""

import os
import pickle
import shutil
import sys

import pytest
import torch

from grpo_lab import GRPOSession
from grpo_lab.state.checkpoint import STATE_FILE
from grpo_lab.state.safe_write import PARTIAL_MARKER, atomic_directory_write

PAYLOAD_RAN = []


def payload(marker: str) -> None:
    """What a crafted checkpoint asks the unpickler to call."""
    PAYLOAD_RAN.append(marker)
    with open(marker, "w") as handle:
        handle.write("ran")


class Exploit:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return payload, (self.marker,)


def test_a_directory_holding_other_files_or_a_file_is_never_saved_over(make_session, tmp_path):
    session = make_session()
    folder = tmp_path / "thesis"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    with pytest.raises(FileExistsError, match=r"thesis is a directory that holds other files.*"
                                              r"thesis.tex.*overwrite=True"):
        session.save(folder)
    assert (folder / "thesis.tex").read_text() == "years of work"
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    with pytest.raises(FileExistsError, match=r"notes.txt is a file; a save is a directory"):
        session.save(notes)
    assert notes.read_text() == "keep me"
    session.step()  # still usable
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (session.save(empty) / "COMPLETE").exists()
    session.save(empty)  # its own earlier save is replaced: every entry its COMPLETE marker lists
    (empty / "notes.md").write_text("added beside the save")
    with pytest.raises(FileExistsError, match=r"holds a grpo_lab save and other files \(notes.md\)"):
        session.save(empty)
    assert (empty / "notes.md").exists()
    session.save(folder, overwrite=True)
    assert not (folder / "thesis.tex").exists() and GRPOSession.load(folder).global_step == 1


def test_a_save_to_a_folder_that_cannot_be_written_is_refused_first(make_session, tmp_path):
    if os.geteuid() == 0:  # root writes anywhere: a file in the way is what stops root
        blocker = tmp_path / "blocker"
        blocker.write_text("")
        with pytest.raises(FileExistsError, match="blocker is a file"):
            make_session().save(blocker)
        return
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    with pytest.raises(PermissionError, match=r"locked is not writable"):
        make_session().save(locked / "run")


def test_an_overwrite_interrupted_between_its_renames_keeps_the_old_save(make_session, tmp_path, monkeypatch):
    session = make_session()
    target = session.save(tmp_path / "run")
    session.step()
    real_replace, calls = os.replace, []

    def interrupted_second_rename(source, destination):
        calls.append(destination)
        if len(calls) == 2:  # the old save is aside, the new one not yet in place
            raise KeyboardInterrupt
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", interrupted_second_rename)
    with pytest.raises(KeyboardInterrupt):
        session.save(target)
    monkeypatch.setattr(os, "replace", real_replace)
    assert GRPOSession.load(target).global_step == 0  # put back at once
    assert not list(tmp_path.glob(".run.*"))


def test_a_save_killed_between_its_renames_is_found_by_the_next_load_or_save(make_session, tmp_path):
    session = make_session()
    target = session.save(tmp_path / "run")
    os.replace(target, tmp_path / ".run.old")  # what a kill -9 between the renames leaves on disk
    assert GRPOSession.load(target).global_step == 0
    os.replace(target, tmp_path / ".run.old")
    session.step()
    session.save(target)
    assert GRPOSession.load(target).global_step == 1 and not (tmp_path / ".run.old").exists()


def test_leftovers_of_killed_writes_are_removed_and_nothing_else(make_session, tmp_path):
    session = make_session()
    leftover = tmp_path / ".run.k3j2"
    leftover.mkdir()
    (leftover / PARTIAL_MARKER).write_text("")
    (leftover / "model").mkdir()
    users = tmp_path / ".run.mine"
    users.mkdir()
    session.save(tmp_path / "run")
    assert not leftover.exists() and users.exists()


def test_a_trainer_removes_what_killed_checkpoint_writes_left(task, tmp_path):
    from grpo_lab import GRPOTrainer
    from tests.conftest import SMALL

    output = tmp_path / "out"
    leftover = output / ".checkpoint-3.x1y2"
    leftover.mkdir(parents=True)
    (leftover / PARTIAL_MARKER).write_text("")
    trainer = GRPOTrainer(task.model, task.reward_funcs,
                          args=task.config(**{**SMALL, "output_dir": str(output), "max_steps": 1}),
                          train_dataset=task.train_dataset)
    trainer.train()
    assert not leftover.exists() and (output / "checkpoint-1" / "COMPLETE").exists()


def test_a_trainer_refuses_an_output_dir_that_is_a_file_before_training(task, tmp_path):
    from grpo_lab import GRPOTrainer
    from tests.conftest import SMALL

    taken = tmp_path / "out"
    taken.write_text("")
    with pytest.raises(FileExistsError, match=r"Cannot write the run's output to .*out: it is a file"):
        GRPOTrainer(task.model, task.reward_funcs, args=task.config(**{**SMALL, "output_dir": str(taken)}),
                    train_dataset=task.train_dataset)


def test_a_trainer_refuses_an_output_dir_it_cannot_write_before_training(task, tmp_path):
    import subprocess
    import sys

    from tests.conftest import without_root_write_override

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    script = (
        "from grpo_lab import GRPOTrainer\nfrom grpo_lab.tasks import default_task\ntask = default_task()\n"
        f"config = task.config(output_dir={str(locked / 'run')!r}, report_to='none')\n"
        "try:\n    GRPOTrainer(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset)\n"
        "except PermissionError as error:\n    print(error)\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"},
                              preexec_fn=without_root_write_override if os.geteuid() == 0 else None)
    finally:
        locked.chmod(0o755)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == (f"Cannot write the run's output to {locked / 'run'}: {locked} is not writable. "
                                   "Give a directory you can write to.")


def test_a_pickled_payload_in_a_checkpoint_never_runs(make_session, tmp_path):
    target = make_session().save(tmp_path / "run")
    marker = tmp_path / "payload_ran"
    torch.save({"extra": Exploit(str(marker))}, target / STATE_FILE)
    with pytest.raises(ValueError, match=r"holds objects other than tensors.*payload.*does not unpickle"):
        GRPOSession.load(target)
    assert not marker.exists() and not PAYLOAD_RAN


def test_saved_functions_are_references_and_pickled_bytes_are_never_loaded(make_session, tmp_path):
    session = make_session()
    target = session.save(tmp_path / "run")
    state = torch.load(target / STATE_FILE, weights_only=True, map_location="cpu")
    assert state["extra"]["reward_funcs"]["functions"] == [
        "grpo_lab.tasks.addition:correctness_reward", "grpo_lab.tasks.addition:format_reward",
    ]
    marker = tmp_path / "payload_ran"
    state["extra"]["reward_funcs"] = pickle.dumps(Exploit(str(marker)))  # an older format's slot, now a payload
    torch.save(state, target / STATE_FILE)
    with pytest.raises(ValueError, match=r"reward functions saved in .* could not be stored.*reward_funcs=\[\.\.\.\]"):
        GRPOSession.load(target)
    assert not marker.exists()
    assert GRPOSession.load(target, reward_funcs=session.engine.reward_funcs).global_step == 0


def test_a_checkpoint_config_cannot_turn_on_remote_code(make_session, tmp_path):
    target = make_session().save(tmp_path / "run")
    config = (target / "config.yaml").read_text()
    assert "trust_remote_code: false" in config
    (target / "config.yaml").write_text(config.replace("trust_remote_code: false", "trust_remote_code: true"))
    with pytest.warns(UserWarning, match=r"sets trust_remote_code, which a checkpoint cannot turn on.*"
                                         r"trust_remote_code=True"):
        loaded = GRPOSession.load(target)
    assert loaded.config.trust_remote_code is False
    assert GRPOSession.load(target, trust_remote_code=True).config.trust_remote_code is True


def test_atomic_writes_leave_no_partial_marker_in_a_complete_save(tmp_path):
    written = atomic_directory_write(tmp_path / "x", lambda directory: (directory / "data").write_text("1"),
                                     own_entries=frozenset({"data"}))
    assert sorted(p.name for p in written.iterdir()) == ["COMPLETE", "data"]
    shutil.rmtree(written)


def test_a_save_folder_that_also_holds_a_users_file_is_not_replaced(make_session, tmp_path):
    session = make_session()
    target = session.save(tmp_path / "run")
    (target / "train.py").write_text("# exported beside the save")
    with pytest.raises(FileExistsError, match=r"holds a grpo_lab save and other files \(train.py\).*move them out"):
        session.save(target)
    assert (target / "train.py").exists() and GRPOSession.load(target).global_step == 0


def test_values_a_checkpoint_cannot_hold_safely_never_make_it_unloadable(make_session, tmp_path):
    import fractions

    import numpy as np

    def logs_numpy_and_objects(completions, log_extra, log_metric, **kwargs):
        log_extra("judge", np.arange(len(completions)))  # numpy: stored as plain values
        # no safe form: the half-used batch is left out
        log_extra("exact", [fractions.Fraction(1, 3)] * len(completions))
        log_metric("judge_mean", np.float32(0.5))
        return [0.0] * len(completions)

    session = make_session(reward_funcs=[logs_numpy_and_objects], num_iterations=2)
    session.step()  # half of the batch is used
    with pytest.warns(UserWarning, match=r"half-used generation batch holds fractions.Fraction.*generates a new one"):
        target = session.save(tmp_path / "run")
    loaded = GRPOSession.load(target, reward_funcs=[logs_numpy_and_objects])
    assert loaded.next_stage == "generate" and loaded.history.equals(session.history)
    logged = loaded.record.completion_log[0]
    assert logged["judge"] == list(range(8)) and logged["exact"] == ["1/3"] * 8
    loaded.step()


def test_a_function_reference_is_never_imported_from_inside_the_checkpoint(make_session, tmp_path, monkeypatch):
    target = make_session().save(tmp_path / "run")
    marker = tmp_path / "imported"
    (target / "code").mkdir()
    (target / "code" / "shipped_rewards.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\n\ndef reward(completions, **kwargs):\n    return [0.0]\n")
    state = torch.load(target / STATE_FILE, weights_only=True)
    state["extra"]["reward_funcs"]["functions"] = ["shipped_rewards:reward"]
    torch.save(state, target / STATE_FILE)
    monkeypatch.syspath_prepend(str(target / "code"))  # e.g. a notebook started inside the checkpoint
    with pytest.raises(ValueError, match=r"cannot be found .*beside or inside the checkpoint.*"
                                         r"reward_funcs=\[\.\.\.\]"):
        GRPOSession.load(target)
    assert not marker.exists()


@pytest.mark.parametrize("reference", ["run.shipped:reward", "beside:reward"])
def test_a_function_reference_is_never_imported_from_the_folder_holding_the_checkpoint(make_session, tmp_path,
                                                                                       monkeypatch, reference):
    # the checkpoint's own folder reached as a namespace package (run.shipped), or a module beside it
    # (beside.py): a process started in the folder that holds the checkpoint has it on sys.path
    target = make_session().save(tmp_path / "run")
    marker = tmp_path / "imported"
    code = f"open({str(marker)!r}, 'w').close()\n\n\ndef reward(completions, **kwargs):\n    return [0.0]\n"
    (target / "shipped.py").write_text(code)
    (tmp_path / "beside.py").write_text(code)
    state = torch.load(target / STATE_FILE, weights_only=True)
    state["extra"]["reward_funcs"]["functions"] = [reference]
    torch.save(state, target / STATE_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"beside or inside the checkpoint.*reward_funcs=\[\.\.\.\]"):
        GRPOSession.load(target)
    assert not marker.exists()
    # imported by the process itself first (a notebook's own reward module), the reference is taken
    import beside

    try:
        state["extra"]["reward_funcs"]["functions"] = ["beside:reward"]
        torch.save(state, target / STATE_FILE)
        assert GRPOSession.load(target).engine.reward_names == ["reward"]
    finally:
        del sys.modules[beside.__name__]


def test_a_checkpoint_config_cannot_fetch_code_through_model_init_kwargs(make_session, tmp_path):
    target = make_session().save(tmp_path / "run")
    config = (target / "config.yaml").read_text()
    assert "model_init_kwargs: null" in config
    (target / "config.yaml").write_text(config.replace(
        "model_init_kwargs: null",
        "model_init_kwargs:\n  attn_implementation: kernels-community/flash-attn\n"
        "  use_kernels: true\n  dtype: float32"))
    with pytest.warns(UserWarning, match=r"model_init_kwargs\['use_kernels'\], "
                                         r"model_init_kwargs\['attn_implementation'\]"):
        loaded = GRPOSession.load(target)
    assert loaded.config.model_init_kwargs == {"dtype": "float32"}


FULL_DISK_SCRIPT = """
import shutil, sys
from pathlib import Path
from grpo_lab import GRPOSession, GRPOTrainer
from grpo_lab.tasks import default_task

disk, output = Path(sys.argv[1]), sys.argv[2]
task = default_task()
config = task.config(max_steps=4, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                     output_dir=output)
session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset)
session.step()
session.save(disk / "save")
(disk / "ballast").write_bytes(bytes(shutil.disk_usage(disk).free - (256 << 10)))  # the disk nearly full
session.step()
for name, save in (("session.save", lambda: session.save(disk / "save")),
                   ("save_model", lambda: GRPOTrainer(task.model, task.reward_funcs, args=config,
                                                      train_dataset=task.train_dataset).save_model(disk / "model"))):
    try:
        save()
        print(name, "saved")
    except OSError as error:
        print(name, "refused:", error)
print("entries:", sorted(p.name for p in disk.iterdir()))
print("loaded step:", GRPOSession.load(disk / "save").global_step)
"""


@pytest.mark.slow
def test_a_save_on_a_full_disk_names_the_disk_and_the_fix_and_keeps_the_earlier_save(tmp_path):
    """On a real full file system: a 24 MB tmpfs mounted in a user and mount namespace of its own."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    (tmp_path / "full_disk.py").write_text(FULL_DISK_SCRIPT)
    run = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
         'mount -t tmpfs -o size=24m tmpfs "$1" && exec "$2" "$3" "$1" "$4"', "sh",
         str(disk), sys.executable, str(tmp_path / "full_disk.py"), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    saved, model, entries, loaded = lines[-4:]
    assert saved.startswith(f"session.save refused: [Errno 28] Cannot save to {disk}/save: the disk or quota is "
                            "full (a save there takes about "), saved
    assert f"the save already at {disk}/save is kept as it was). Free space on that disk or save to one" in saved
    assert "unexpected pos" not in run.stdout and "enforce fail" not in run.stdout
    assert model.startswith(f"save_model refused: [Errno 28] Cannot save to {disk}/model: the disk or quota is "
                            "full ("), model
    assert "the files written there are incomplete. Free space on that disk" in model
    assert entries == "entries: ['ballast', 'model', 'save']"  # no partial copy of the save left behind
    assert loaded == "loaded step: 1"  # the earlier save is whole


def test_a_save_over_the_working_directory_or_a_folder_above_it_is_refused(make_session, tmp_path, monkeypatch):
    session = make_session()
    session.save(tmp_path / "save")
    monkeypatch.chdir(tmp_path / "save")
    for target in (".", tmp_path / "save"):
        with pytest.raises(ValueError, match=r"it is this process's working directory \(or a folder above it\)"):
            session.save(target)
    (tmp_path / "save" / "notes").mkdir()
    monkeypatch.chdir(tmp_path / "save" / "notes")
    with pytest.raises(ValueError, match=r"working directory \(or a folder above it\)"):
        session.save("..", overwrite=True)
    assert (tmp_path / "save" / "COMPLETE").exists() and (tmp_path / "save" / "notes").is_dir()
