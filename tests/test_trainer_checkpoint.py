"""Checkpoint bookkeeping: latest step, fault-injection hook (once per checkpoint dir), RNG."""

import random

import numpy as np
import torch

import moe_faults
from moe_trainer import checkpoint as ckpt


def test_latest_step(tmp_path):
    assert ckpt.latest_step(None) is None
    assert ckpt.latest_step(tmp_path) is None
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "latest").write_text("step-12\n")
    assert ckpt.latest_step(tmp_path) == 12
    (tmp_path / "ds" / "latest").write_text("global_step7")
    assert ckpt.latest_step(tmp_path) is None


def test_fault_fires_once_per_checkpoint_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_FAULT_EXIT_AT_STEP", "7")
    monkeypatch.setenv("MOE_FAULT_EXIT_CODE", "42")
    assert ckpt.test_faults() is moe_faults  # the trainer's one way to the dev package's hooks
    assert moe_faults.exit_due(6, tmp_path) is None
    assert moe_faults.exit_due(7, tmp_path) == 42
    moe_faults.mark_exit(7, tmp_path, rank=1)  # only rank 0 writes the marker
    assert moe_faults.exit_due(7, tmp_path) == 42
    moe_faults.mark_exit(7, tmp_path, rank=0)
    assert (tmp_path / "fault-injected-step-7").exists()
    assert moe_faults.exit_due(7, tmp_path) is None  # the restarted attempt runs through
    monkeypatch.delenv("MOE_FAULT_EXIT_CODE")
    assert moe_faults.exit_due(7, tmp_path / "other") == 75


def test_rng_roundtrip():
    state = ckpt.rng_state()
    a = (torch.rand(3), np.random.rand(), random.random())
    ckpt.set_rng_state(state)
    b = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
