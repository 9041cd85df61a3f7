"""TRL's public helpers on GRPOTrainer, with TRL's signatures: ``get_high_entropy_mask`` and
``get_off_policy_mask``, checked on hand-computed numbers and against TRL 1.16's own functions."""

import subprocess
import textwrap
from types import SimpleNamespace

import torch
from accelerate import Accelerator

from grpo_lab import GRPOTrainer
from tests.conftest import launch_two


def _trainer_like():
    """What ``get_high_entropy_mask`` reads of a trainer: its accelerator (one process here)."""
    return SimpleNamespace(accelerator=Accelerator(cpu=True))


def test_high_entropy_mask_by_hand():
    entropies = torch.tensor([[0.1, 0.5, 0.9, 7.0], [0.3, 0.2, 0.8, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    # masked values sorted: 0.1 0.2 0.3 0.5 0.8 0.9; the 0.5 quantile sits at position 0.5 * 5 = 2.5,
    # halfway between 0.3 and 0.5: 0.4. Kept: 0.5, 0.9, 0.8; never the padding's 7.0.
    kept = GRPOTrainer.get_high_entropy_mask(_trainer_like(), entropies, mask, 0.5)
    assert kept.dtype == torch.bool
    assert kept.tolist() == [[False, True, True, False], [False, False, True, False]]
    empty = GRPOTrainer.get_high_entropy_mask(_trainer_like(), entropies, torch.zeros_like(mask), 0.5)
    assert not empty.any()


def test_off_policy_mask_by_hand():
    advantages = torch.tensor([[-1.0], [-1.0], [2.0]])
    logps = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-3.0, -3.0]])
    sampling = torch.tensor([[-0.5, float("nan")], [-0.2, -0.2], [-0.1, -0.1]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    # drift per sequence: (0.5 + 0 for the NaN token) / 2 = 0.25; (0.8 + 0.8) / 2 = 0.8; 2.9
    # threshold 0.5: row 0 kept (drift 0.25), row 1 dropped (negative advantage, drift 0.8), row 2 kept
    # (advantage >= 0)
    kept = GRPOTrainer.get_off_policy_mask(advantages, logps, sampling, mask, 0.5)
    assert kept.tolist() == [[1.0], [0.0], [1.0]]


def test_the_helpers_equal_trls_on_random_inputs():
    from trl import GRPOTrainer as TRLTrainer

    generator = torch.Generator().manual_seed(0)
    entropies = torch.rand(6, 9, generator=generator) * 3
    mask = (torch.rand(6, 9, generator=generator) > 0.3).long()
    for threshold in (0.0, 0.2, 0.8, 1.0):
        theirs = TRLTrainer.get_high_entropy_mask(_trainer_like(), entropies, mask, threshold)
        assert torch.equal(GRPOTrainer.get_high_entropy_mask(_trainer_like(), entropies, mask, threshold), theirs)
    advantages = torch.randn(6, 1, generator=generator)
    logps = -torch.rand(6, 9, generator=generator) * 4
    sampling = -torch.rand(6, 9, generator=generator) * 4
    sampling[1, 3] = float("nan")
    for threshold in (0.01, 0.5, 2.0):
        theirs = TRLTrainer.get_off_policy_mask(advantages, logps, sampling, mask.float(), threshold)
        assert torch.equal(GRPOTrainer.get_off_policy_mask(advantages, logps, sampling, mask.float(), threshold),
                           theirs)


def test_the_entropy_threshold_is_taken_over_both_processes(tmp_path):
    script = tmp_path / "masks.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        from types import SimpleNamespace
        import torch
        from accelerate import Accelerator
        from grpo_lab import GRPOTrainer

        accelerator = Accelerator(cpu=True)
        rank = accelerator.process_index
        # process 0 holds the small entropies (3 tokens), process 1 the large ones (2 tokens)
        entropies = torch.tensor([[0.1, 0.2, 0.3, 0.0]]) if rank == 0 else torch.tensor([[5.0, 6.0, 0.0, 0.0]])
        mask = torch.tensor([[1, 1, 1, 0]]) if rank == 0 else torch.tensor([[1, 1, 0, 0]])
        kept = GRPOTrainer.get_high_entropy_mask(SimpleNamespace(accelerator=accelerator), entropies, mask, 0.5)
        with open(sys.argv[1] + f"-{rank}.json", "w") as handle:
            json.dump(kept.tolist(), handle)
        accelerator.end_training()  # the process group ended before exit: a gloo thread left running can abort it
    """))
    out = tmp_path / "kept"
    launch = launch_two("--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no")
    done = subprocess.run([*launch, str(script), str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # pooled values 0.1 0.2 0.3 5 6: the median is 0.3, so process 0 keeps its 0.3 and process 1
    # both of its tokens (alone, process 0 would keep 0.2 and 0.3)
    assert (tmp_path / "kept-0.json").read_text() == "[[false, false, true, false]]"
    assert (tmp_path / "kept-1.json").read_text() == "[[true, true, false, false]]"


def test_trls_notes_on_loss_and_sampling_level_go_to_the_logger(caplog):
    from grpo_lab import GRPOConfig
    from grpo_lab.core.build import log_setting_notes

    with caplog.at_level("WARNING", logger="grpo_lab"):
        log_setting_notes(GRPOConfig(importance_sampling_level="sequence", loss_type="dapo"))
        log_setting_notes(GRPOConfig(loss_type="luspo"))
        log_setting_notes(GRPOConfig(importance_sampling_level="sequence", loss_type="grpo"))  # the paper's setup
        log_setting_notes(GRPOConfig(importance_sampling_level="sequence", loss_type="vespo"))
    messages = [record.getMessage() for record in caplog.records if record.name == "grpo_lab"]
    assert len(messages) == 3
    assert messages[0].startswith("importance_sampling_level='sequence' with loss_type='dapo'")
    assert messages[1].startswith("loss_type='luspo' with importance_sampling_level='token'")
    # with the phrases of TRL's own warnings, which its users and tests search for
    assert "weights each sequence by its completion length" in messages[0]
    assert "should be set to `'sequence'` to mirror the paper's setup" in messages[1]
    assert "VESPO computes sequence-level importance weights internally" in messages[2]
