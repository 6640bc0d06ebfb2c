"""Shape functions of the taps_ops operators (FakeTensor / torch.compile / opcheck)."""

import torch


def _mask_words(n: int) -> int:
    return (n + 63) // 64


@torch.library.register_fake("taps_ops::verify_tree")
def _verify_tree_fake(logits, tokens, parents, temperature, top_k, top_p, draft_probs, uniforms, validate):
    b, n = logits.shape[0], logits.shape[1]
    out_tokens = logits.new_empty((b, n), dtype=torch.int64)
    return out_tokens, logits.new_empty((b,), dtype=torch.int64), logits.new_empty((b, n), dtype=torch.int64)


def _tree_fake(like, batch, num_nodes):
    i64 = dict(dtype=torch.int64)
    return (like.new_empty((batch, num_nodes), **i64), like.new_empty((batch, num_nodes), **i64),
            like.new_empty((batch, num_nodes), **i64),
            like.new_empty((batch, num_nodes, _mask_words(num_nodes)), **i64),
            like.new_empty((batch, num_nodes), dtype=torch.float32), like.new_empty((batch, num_nodes), **i64))


@torch.library.register_fake("taps_ops::build_tree")
def _build_tree_fake(scores, tokens, parents, num_nodes, root_tokens, validate=True):
    return _tree_fake(scores, scores.shape[0], num_nodes)


@torch.library.register_fake("taps_ops::merge_trees")
def _merge_trees_fake(tokens, parents, scores, num_nodes, weights, validate=True):
    return _tree_fake(scores, scores.shape[0], num_nodes)


@torch.library.register_fake("taps_ops::tree_attention")
def _tree_attention_fake(q, k, v, tree_mask, kv_lens, scale, validate=True, tree_nodes=None, num_queries=None):
    return q.new_empty(q.shape)  # contiguous, as the kernels allocate it (whatever q's strides)


@torch.library.register_fake("taps_ops::compact_kv")
def _compact_kv_fake(caches, path, prefix_lens, validate=True):
    return None


@torch.library.register_fake("taps_ops::rms_norm")
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("taps_ops::panel_linear")
def _panel_linear_fake(x, panels, bias=None):
    return x.new_empty((*x.shape[:-1], panels.shape[0] * panels.shape[2]))


@torch.library.register_fake("taps_ops::head_argmax")
def _head_argmax_fake(x, screen, meta, panels):
    return x.new_empty(x.shape[:-1], dtype=torch.int64)


@torch.library.register_fake("taps_ops::rope_")
def _rope_fake(x, cos, sin):
    return None


@torch.library.register_fake("taps_ops::expand_level")
def _expand_level_fake(logits, front_scores, front_cands, k, next_k, cand_offset, token_map, with_entropy):
    rows, children = logits.shape[0], logits.shape[1] * k
    f32, i64 = dict(dtype=torch.float32), dict(dtype=torch.int64)
    return (logits.new_empty((rows, children), **f32), logits.new_empty((rows, children), **i64),
            logits.new_empty((rows, children), **i64), logits.new_empty((rows,), **f32),
            logits.new_empty((rows, next_k), **f32), logits.new_empty((rows, next_k), **i64),
            logits.new_empty((rows, next_k), **i64), logits.new_empty((rows, next_k), **i64))


@torch.library.register_fake("taps_ops::decoder_layer")
def _decoder_layer_fake(x, emb, weights, eps, dims, cos, sin, keys, values, write_start, tree_mask, kv_lens,
                        tree_nodes, scale, write_positions=None, rows=None):
    return x.new_empty(x.shape)
