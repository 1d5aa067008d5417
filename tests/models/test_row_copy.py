"""The one-kernel row copy (models/generation/row_copy.py) moves exactly the rows' bytes (on a GPU)."""

import pytest
import torch

from models.generation.kv_cache import KVCache
from models.generation.nucleus import CapturedGraph, triton_available
from models.generation.row_copy import RowCopy

gpu = pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(torch.device("cuda")),
                         reason="the Triton kernel runs on CUDA (benchmarks on a GPU)")


def _caches(batch: int, source_batch: int, dtype: torch.dtype) -> tuple[KVCache, KVCache]:
    settings = dict(num_layers=3, num_kv_heads=2, slots=40, head_dim=16, device=torch.device("cuda"), dtype=dtype)
    target, source = KVCache(batch=batch, **settings), KVCache(batch=source_batch, **settings)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for buffer in target.tensors() + source.tensors():
        buffer.copy_(torch.randn(buffer.shape, generator=generator, device="cuda").to(dtype))
    return target, source


def _expected(target: KVCache, source: KVCache, rows: list[int], source_rows: list[int]) -> list[torch.Tensor]:
    expected = [t.clone() for t in target.tensors()]
    for into, held in zip(expected, source.tensors()):
        into[rows] = held[source_rows]
    return expected


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_cache_rows_copied_by_the_kernel_bitwise(dtype):
    target, source = _caches(8, 6, dtype)
    rows, source_rows = [6, 1, 3], [5, 0, 2]
    expected = _expected(target, source, rows, source_rows)
    assert RowCopy.fits(target.tensors() + source.tensors())
    target.copy_rows(source, torch.tensor(rows, device="cuda"), torch.tensor(source_rows, device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(target.tensors(), expected))
    # The first k rows by default, and the scratch row (index batch) is a row like any other.
    expected = _expected(target, source, [8, 0], [0, 1])
    target.copy_rows(source, torch.tensor([8, 0], device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(target.tensors(), expected))


@gpu
def test_row_copy_replayed_in_a_cuda_graph():
    target, source = _caches(8, 4, torch.bfloat16)
    copy = CapturedGraph(lambda rows, source_rows: target.copy_rows(source, rows, source_rows))
    for rows, source_rows in (([0, 7], [3, 1]), ([2, 5], [0, 0])):
        expected = _expected(target, source, rows, source_rows)
        copy(torch.tensor(rows, device="cuda"), torch.tensor(source_rows, device="cuda"))
        assert all(torch.equal(a, b) for a, b in zip(target.tensors(), expected))


@gpu
def test_rows_of_no_whole_words_go_through_index_copy():
    settings = dict(num_layers=2, batch=4, num_kv_heads=1, slots=3, head_dim=1, device=torch.device("cuda"),
                    dtype=torch.bfloat16)
    target, source = KVCache(**settings), KVCache(**settings)
    for buffer in source.tensors():
        buffer.copy_(torch.arange(buffer.numel(), device="cuda").view(buffer.shape).to(torch.bfloat16))
    assert not RowCopy.fits(target.tensors() + source.tensors())  # a row is 6 bytes
    expected = _expected(target, source, [2], [3])
    target.copy_rows(source, torch.tensor([2], device="cuda"), torch.tensor([3], device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(target.tensors(), expected))


def test_row_copy_refuses_buffers_of_other_shapes():
    with pytest.raises(ValueError, match="one dtype and row shape"):
        RowCopy([torch.zeros(2, 4)], [torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="pairs of buffers"):
        RowCopy([torch.zeros(2, 4)], [])
