"""Environment defaults applied before the process group and CUDA start."""

from __future__ import annotations

import dataclasses

from core.config import ParallelConfig
from distributed.init import prepare_process_env


def test_nccl_defaults_and_deterministic_cublas(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    applied = prepare_process_env(ParallelConfig(backend="nccl", device="cuda"), deterministic=True)
    assert applied == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def test_user_values_win(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    assert prepare_process_env(ParallelConfig(backend="nccl"), deterministic=True) == {}


def test_gloo_and_fast_mode_set_nothing(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    gloo = dataclasses.replace(ParallelConfig(), backend="gloo")
    assert prepare_process_env(gloo, deterministic=False) == {}
