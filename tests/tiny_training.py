"""Tiny training fixtures shared by the training tests, and a torchrun worker.

- :func:`tiny_target`: a small random causal LM (Llama, Qwen2, Qwen3 or Mistral) with the shipped
  tokenizer's vocabulary;
- :func:`tiny_target_dir`: that target saved as a target folder (weights and the shipped tokenizer);
- :func:`fake_blocks`: random token blocks in place of :func:`taps.train.drafter.domain_blocks`, so
  tests never read the real datasets (math blocks use tokens 6..399, chat blocks 400..8191);
- ``python tests/tiny_training.py drafter|target ...``: ``python -m taps.train ...`` with
  :func:`fake_blocks` in place of the real data, for tests that start the training under torchrun.
"""

import shutil
import sys
from pathlib import Path

import torch


def tiny_target(vocab=8192, arch="llama"):
    import transformers

    torch.manual_seed(0)
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[arch]
    kw = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    if arch == "qwen3":
        kw.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e5})  # not hidden / heads
    cfg = getattr(transformers, prefix + "Config")(**kw)
    return getattr(transformers, prefix + "ForCausalLM")(cfg).eval()


def tiny_target_dir(folder: Path, arch="llama") -> Path:
    """Save :func:`tiny_target` with the shipped tokenizer's files in ``folder``; returns it."""
    from taps.train.data import REPO_ROOT

    tiny_target(arch=arch).save_pretrained(str(folder))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO_ROOT / "models" / "tokenizer" / f, Path(folder) / f)
    return Path(folder)


def fake_blocks(domain, tok, *, tokens, heldout_tokens, seq_len, seed, shared=None, sharegpt=None):
    """(train, heldout, info) like domain_blocks: random blocks, the two domains on disjoint tokens."""
    g = torch.Generator().manual_seed(seed + (0 if domain == "math" else 1))
    lo, hi = (6, 400) if domain == "math" else (400, 8192)
    n = -(-tokens // seq_len)
    blocks = torch.randint(lo, hi, (n + max(1, heldout_tokens // seq_len), seq_len), generator=g, dtype=torch.int32)
    return blocks[:n], blocks[n:], {"fake": True}


if __name__ == "__main__":
    from taps.train import drafter
    from taps.train.cli import main

    drafter.domain_blocks = fake_blocks
    sys.exit(main())
