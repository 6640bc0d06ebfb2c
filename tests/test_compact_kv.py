"""taps_ops.compact_kv against taps_ops.reference.compact_kv_ref (exact: it only moves bytes)."""

import pytest
import torch

import taps_ops
from taps_ops.reference import compact_kv_ref

from conftest import assert_compiles_like_eager


def random_paths(batch: int, cols: int, max_node: int) -> torch.Tensor:
    """[B, cols] strictly increasing paths from 0, random lengths, -1 padded (row 0 is a lone root)."""
    path = torch.full((batch, cols), -1, dtype=torch.int64)
    for b in range(batch):
        length = 1 if b == 0 else int(torch.randint(1, cols + 1, ()))
        rest = torch.randperm(max_node - 1)[: length - 1] + 1
        path[b, :length] = torch.cat([torch.zeros(1, dtype=torch.int64), rest.sort().values])
    return path


@pytest.mark.parametrize("num_nodes,cols", [(8, 4), (64, 10), (130, 40)])
def test_matches_reference(device, num_nodes, cols):
    batch, cache_len = 4, 200
    prefix_lens = torch.randint(0, cache_len - num_nodes + 1, (batch,))
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32]  # 2 layers, K and V each
    caches = [torch.randn(batch, 3, cache_len, 72).to(dt) for dt in dtypes]
    caches.append(torch.randn(batch, 2, cache_len, 5, dtype=torch.float16))  # odd row size
    path = random_paths(batch, cols, num_nodes)
    expected = compact_kv_ref(caches, path, prefix_lens)
    caches = [c.to(device) for c in caches]
    taps_ops.compact_kv(caches, path.to(device), prefix_lens.to(device))
    for got, want in zip(caches, expected):
        assert torch.equal(got.cpu(), want)


def test_literal_and_strided(device):
    # One request, prefix 2, path [0, 2, 3]: node 2 -> pos 3, node 3 -> pos 4 (overlapping move).
    cache = torch.arange(8, dtype=torch.float32).view(1, 1, 8, 1).expand(1, 1, 8, 3).contiguous().to(device)
    big = torch.zeros(1, 2, 8, 3, device=device)
    big[:, 1] = cache[:, 0]
    view = big[:, 1:]  # non-contiguous in the head dimension
    taps_ops.compact_kv([cache, view], torch.tensor([[0, 2, 3, -1]], device=device), torch.tensor([2], device=device))
    expected = torch.tensor([0, 1, 2, 4, 5, 5, 6, 7], dtype=torch.float32, device=device)
    assert torch.equal(cache[0, 0, :, 0], expected)
    assert torch.equal(big[0, 1, :, 2], expected)


def test_no_caches_and_root_only(device):
    taps_ops.compact_kv([], torch.zeros(2, 1, dtype=torch.int64, device=device),
                        torch.zeros(2, dtype=torch.int64, device=device))
    cache = torch.randn(2, 1, 5, 4, device=device)
    before = cache.clone()
    taps_ops.compact_kv([cache], torch.tensor([[0, -1], [0, -1]], device=device),
                        torch.tensor([1, 3], device=device))
    assert torch.equal(cache, before)


def test_opcheck(device):
    caches = [torch.randn(2, 2, 16, 8, device=device) for _ in range(2)]
    path = torch.tensor([[0, 1, 3, -1], [0, 2, -1, -1]], device=device)
    torch.library.opcheck(torch.ops.taps_ops.compact_kv.default, (caches, path, torch.tensor([4, 0], device=device)))


@pytest.mark.parametrize(
    "path,prefix,message",
    [
        ([[1, 2, -1]], [0], "path\\[0, 0\\] must be 0"),
        ([[-1, -1, -1]], [0], "must be 0"),
        ([[0, 3, 2]], [0], "strictly increasing"),
        ([[0, 2, 2]], [0], "strictly increasing"),
        ([[0, 1, 9]], [2], "must be < S"),
        ([[0, 1, 2]], [-1], "prefix_lens"),
    ],
)
def test_bad_paths(device, path, prefix, message):
    cache = torch.randn(1, 1, 10, 4, device=device)
    before = cache.clone()
    with pytest.raises(ValueError, match=message):
        taps_ops.compact_kv([cache], torch.tensor(path, device=device), torch.tensor(prefix, device=device))
    assert torch.equal(cache, before)


def test_bad_shapes(device):
    path = torch.tensor([[0, 1]], device=device)
    prefix = torch.tensor([0], device=device)
    with pytest.raises(ValueError, match="4 dimensions"):
        taps_ops.compact_kv([torch.randn(1, 10, 4, device=device)], path, prefix)
    with pytest.raises(ValueError, match="B = 1"):
        taps_ops.compact_kv([torch.randn(2, 1, 10, 4, device=device)], path, prefix)
    with pytest.raises(ValueError, match="floating"):
        taps_ops.compact_kv([torch.zeros(1, 1, 10, 4, dtype=torch.int32, device=device)], path, prefix)
    with pytest.raises(ValueError, match="one length"):
        taps_ops.compact_kv([torch.randn(1, 1, 10, 4, device=device), torch.randn(1, 1, 12, 4, device=device)],
                            path, prefix)
    with pytest.raises(ValueError, match="dtype"):
        taps_ops.compact_kv([torch.randn(1, 1, 10, 4, device=device)], path.int(), prefix)
    with pytest.raises(ValueError, match="contiguous last"):
        taps_ops.compact_kv([torch.randn(1, 1, 4, 10, device=device).transpose(2, 3)], path, prefix)


def test_validate_false_same_result_and_opcheck(device):
    batch, cache_len = 3, 60
    caches = [torch.randn(batch, 2, cache_len, 8, device=device) for _ in range(2)]
    path = random_paths(batch, 6, 20).to(device)
    prefix_lens = torch.tensor([0, 17, 40], device=device)
    unchecked = [c.clone() for c in caches]
    taps_ops.compact_kv(caches, path, prefix_lens)
    taps_ops.compact_kv(unchecked, path, prefix_lens, validate=False)
    assert all(torch.equal(a, b) for a, b in zip(caches, unchecked))
    torch.library.opcheck(torch.ops.taps_ops.compact_kv.default, (unchecked, path, prefix_lens, False))


def test_validate_false_still_checks_on_cpu():
    # The CPU checks cost no device sync: they run with validate=False too.
    cache = torch.randn(1, 1, 10, 4)
    with pytest.raises(ValueError, match="strictly increasing"):
        taps_ops.compact_kv([cache], torch.tensor([[0, 3, 2]]), torch.tensor([0]), validate=False)


@pytest.mark.skipif(not (torch.cuda.is_available() and taps_ops.has_cuda_kernels()), reason="no GPU or no CUDA kernels")
def test_validate_false_cuda_leaves_invalid_requests():
    # CUDA without validate: a request with an invalid path is left untouched, the valid one is moved.
    cache = torch.randn(2, 1, 10, 4, device="cuda")
    before = cache.clone()
    taps_ops.compact_kv([cache], torch.tensor([[0, 3, 2], [0, 2, 3]], device="cuda"),
                        torch.tensor([0, 1], device="cuda"), validate=False)
    assert torch.equal(cache[0], before[0])
    assert torch.equal(cache[1, 0, 2], before[1, 0, 3]) and torch.equal(cache[1, 0, 3], before[1, 0, 4])


def test_torch_compile_fullgraph(device):
    caches = [torch.randn(3, 2, 40, 8, device=device) for _ in range(4)]
    path = random_paths(3, 6, 12).to(device)
    prefix_lens = torch.tensor([0, 5, 20], device=device)

    def step(caches, path, prefix_lens):
        taps_ops.compact_kv(caches, path, prefix_lens)
        return tuple(caches)

    assert_compiles_like_eager(step, caches, path, prefix_lens)
    moved = step([c.clone() for c in caches], path, prefix_lens)
    for got, want in zip(moved, compact_kv_ref(caches, path, prefix_lens)):  # and it did move entries
        assert torch.equal(got, want)
    assert not all(torch.equal(a, b) for a, b in zip(moved, caches))
