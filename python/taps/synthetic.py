"""Small random Llama models that speculative decoding can be shown and measured on without a download: a
target whose layers after the first only refine the first one's guess (so the first layer read out by the
target's own norm and head, an early exit, drafts well), its early exit, and perturbed copies of a drafter
(a weaker second drafter). ``taps tour``, ``bench/bench_engine.py`` and the engine test suites build their
models here.
"""

from __future__ import annotations

import copy

import torch
import transformers

__all__ = ["refined_llama", "early_exit", "perturbed"]


def refined_llama(vocab: int, hidden: int, layers: int, *, heads: int = 4, kv_heads: int = 2,
                  intermediate: int = 0, head_scale: float = 8.0, refine: float = 0.3, seed: int = 0,
                  init: float = 0.05, max_positions: int = 1024) -> transformers.LlamaForCausalLM:
    """A random LlamaForCausalLM (eval mode) whose lm_head is scaled by `head_scale` (sharper next-token
    distributions) and whose layers after the first have their output projections (attention o_proj, MLP
    down_proj) scaled by `refine`: weak residual refinements of the first layer's guess."""
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 3 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=max_positions, initializer_range=init,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    target = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(head_scale)
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(refine)
            layer.mlp.down_proj.weight.mul_(refine)
    return target


def early_exit(target: transformers.LlamaForCausalLM, layers: int = 1) -> transformers.LlamaForCausalLM:
    """The target's first `layers` decoder layers with its embeddings, final norm and head, as a causal LM
    (copies of the target's weights)."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers})
    return model


def perturbed(model: transformers.LlamaForCausalLM, noise: float = 0.5, seed: int = 1) -> transformers.LlamaForCausalLM:
    """A copy of `model` whose first decoder layer's matrices get Gaussian noise of `noise` times each
    matrix's own standard deviation."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.model.layers[0].parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * noise)
    return out
