"""TreeKVCache's rows as requests join and leave: the K/V views keep storage rows that later requests take,
and what each request holds is what a cache built afresh by concatenation and gathering would hold."""

import random

import pytest
import torch
from transformers import LlamaConfig

from taps.kv import TreeKVCache

CONFIG = LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                     intermediate_size=32, vocab_size=32)


def filled(batch, max_len, gen):
    cache = TreeKVCache(CONFIG, batch, max_len)
    for layer in cache.layers:
        layer.keys.copy_(torch.randn(layer.keys.shape, generator=gen))
        layer.values.copy_(torch.randn(layer.values.shape, generator=gen))
    cache.lengths.copy_(torch.randint(0, max_len + 1, (batch,), generator=gen))
    return cache


def rows_of(cache):
    """Per request: (length, [per layer (keys, values) of its first max_len... columns it holds])."""
    return [(int(cache.lengths[b]), [(layer.keys[b].clone(), layer.values[b].clone()) for layer in cache.layers])
            for b in range(cache.lengths.shape[0])]


def same(expected, cache):
    got = rows_of(cache)
    assert len(got) == len(expected)
    for (len_e, kv_e), (len_g, kv_g) in zip(expected, got):
        assert len_e == len_g
        for (ke, ve), (kg, vg) in zip(kv_e, kv_g):
            width = ke.shape[1]
            assert kg.shape[1] >= width
            assert torch.equal(kg[:, :width], ke) and torch.equal(vg[:, :width], ve)
            assert not kg[:, width:].any() and not vg[:, width:].any()  # columns a request never had: zeros


@pytest.mark.parametrize("seed", range(6))
def test_rows_follow_joins_and_leaves(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cache = filled(rng.randint(1, 4), rng.randint(3, 9), gen)
    expected = rows_of(cache)
    for _ in range(40):
        batch = cache.lengths.shape[0]
        if rng.random() < 0.5 or batch == 0:
            other = filled(rng.randint(1, 3), rng.randint(2, 14), gen)
            expected += rows_of(other)
            cache.append_requests(other)
        else:
            keep = sorted(rng.sample(range(batch), rng.randint(0, batch)))
            if rng.random() < 0.3:
                rng.shuffle(keep)
            expected = [expected[b] for b in keep]
            cache.select_requests(torch.tensor(keep, dtype=torch.int64))
        same(expected, cache)
        for layer in cache.layers:  # views the ops can take: [B, Hkv, max_len, D], contiguous
            assert layer.keys.shape == (cache.lengths.shape[0], 1, cache.max_len, 8)
            assert layer.keys.is_contiguous() and layer.values.is_contiguous()


def test_holes_are_filled_from_the_end():
    from taps.batching import _fill_holes

    assert _fill_holes([0, 1, 2]) == [0, 1, 2]
    assert _fill_holes([0, 2, 3, 5]) == [0, 5, 2, 3]
    assert _fill_holes([3, 4]) == [3, 4]
    assert _fill_holes([1, 4, 6]) == [4, 1, 6]
    for keep in ([0, 2, 3, 5], [1, 4, 6], [2], [0, 1, 5, 7, 8]):
        order = _fill_holes(keep)
        assert sorted(order) == keep and sum(o != i for i, o in enumerate(order)) <= sum(b >= len(keep) for b in keep)


def test_a_join_after_leaves_reuses_the_rows():
    gen = torch.Generator().manual_seed(0)
    cache = filled(4, 8, gen)
    store = cache.layers[0].storage["keys"]
    cache.select_requests(torch.tensor([1, 3]))
    cache.append_requests(filled(2, 8, gen))
    assert cache.layers[0].storage["keys"] is store and cache.layers[0].keys.data_ptr() == store.data_ptr()
    cache.append_requests(filled(1, 8, gen))  # past the rows held: the storage grows
    assert cache.layers[0].storage["keys"] is not store and cache.lengths.shape[0] == 5


def test_longer_requests_grow_the_positions_by_a_quarter_at_least():
    gen = torch.Generator().manual_seed(1)
    cache = filled(2, 40, gen)
    cache.append_requests(filled(1, 41, gen))
    assert cache.max_len == 50
    cache.append_requests(filled(1, 90, gen))
    assert cache.max_len == 90
