"""``taps train store``: a token store of the target's own outputs, for prompt lookup (:mod:`taps.drafters.store`).

The target answers a sample of the training prompts (GSM8K / MATH train and ShareGPT first turns; every
prompt that is also an evaluation prompt is dropped), greedily by default, and the prompts with their
answers become a :class:`~taps.drafters.store.TokenStore`: what the target tends to say after a context,
which :class:`~taps.drafters.PromptLookupDrafter` then proposes (``store=``). The folder holds
``store.npz`` and a manifest with the target's weights digest, so that a store is never used with a
target it was not built from (:func:`taps.models.load_store`).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from ..data import eval_prompt_keys, normalize_prompt
from ..drafters.store import TokenStore
from .data import REPO_ROOT, chat_training_examples, math_training_examples

__all__ = ["first_turn", "store_prompts", "answers", "build_store", "write_store"]

STORE_FILE = "store.npz"


def first_turn(messages: Sequence[dict]) -> List[dict]:
    """The messages up to the first user turn (a system message before it kept)."""
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            return list(messages[:i + 1])
    return []


def store_prompts(math: int, chat: int, seed: int = 0, shared=None, sharegpt=None) -> tuple:
    """`math` GSM8K / MATH training prompts and `chat` ShareGPT first turns, drawn at random with `seed`,
    none of them an evaluation prompt. Returns (a list of message lists, facts for the manifest)."""
    keys = eval_prompt_keys()
    rng = random.Random(seed)
    out, facts = [], {}
    for domain, count in (("math", math), ("chat", chat)):
        if count <= 0:
            continue
        exs = math_training_examples(shared) if domain == "math" else chat_training_examples(sharegpt)
        turns = [t for t in (first_turn(e.messages) for e in exs) if t]
        kept = [t for t in turns if normalize_prompt(t[-1]["content"]) not in keys]
        rng.shuffle(kept)
        out += kept[:count]
        facts[domain] = {"available": len(turns), "eval_prompts_dropped": len(turns) - len(kept),
                         "used": min(count, len(kept))}
    return out, facts


def answers(target, encoded: Sequence[Sequence[int]], *, new_tokens: int, batch: int, temperature: float, seed: int,
            desc: str, quiet: bool = False) -> Iterator[Tuple[List[int], List[int]]]:
    """(prompt, answer) for each of `encoded` (token id lists), in order: the target's autoregressive decoding in
    ragged batches of `batch` (batch i draws with seed + i), a progress bar named `desc` over the prompts."""
    from tqdm import tqdm

    from ..decoder import SpeculativeDecoder

    decoder = SpeculativeDecoder(target, [], strategy="autoregressive")
    with tqdm(total=len(encoded), desc=desc, unit="prompt", disable=quiet, file=sys.stderr) as bar:
        for i in range(0, len(encoded), batch):
            chunk = encoded[i:i + batch]
            out = decoder.generate(chunk, max_new_tokens=new_tokens, temperature=temperature, seed=seed + i)
            yield from ((list(p), list(t)) for p, t in zip(chunk, out.tokens))
            bar.update(len(chunk))


def build_store(target, tok, prompts: Sequence[Sequence[dict]], *, new_tokens: int = 128, batch: int = 8,
                temperature: float = 0.0, seed: int = 0, max_prompt: int = 512, quiet: bool = False,
                meta: Optional[dict] = None) -> TokenStore:
    """The target's answers to `prompts` (message lists), each with its prompt, as a token store.

    Args:
        new_tokens: tokens generated per prompt (an answer ends earlier at EOS).
        batch: prompts decoded together (a ragged batch of the autoregressive decoder).
        temperature, seed: greedy by default; at T > 0 each batch draws with seed + its index.
        max_prompt: a longer prompt keeps its last `max_prompt` tokens.
    """
    from ..drafters.base import target_vocab_size

    if new_tokens < 1 or batch < 1 or max_prompt < 1:
        raise ValueError("build_store: new_tokens, batch and max_prompt must be >= 1")
    encoded = [tok.encode_chat(m, add_generation_prompt=True)[-max_prompt:] for m in prompts]
    sequences = [p + t for p, t in answers(target, encoded, new_tokens=new_tokens, batch=batch,
                                           temperature=temperature, seed=seed, desc="taps train store", quiet=quiet)]
    return TokenStore(sequences, target_vocab_size(target), meta=meta)


def start_answers(args, what: str, detail: str = ""):
    """What ``taps train store`` / ``table`` (`what`) start with: torch threads, the target and its tokenizer, the
    prompts (a line saying how many), the facts every manifest holds. Returns (target, tok, prompts, meta,
    start time)."""
    import torch

    from ..models import load_target, weights_digest

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tok = load_target(args.target)
    prompts, facts = store_prompts(args.math, args.chat, args.seed, args.shared_data)
    if not prompts:
        raise ValueError(f"taps train {what}: no prompts (--math and --chat are both 0)")
    counts = ", ".join(f"{k} {v['used']}" for k, v in facts.items())
    print(f"[train {what}] {len(prompts)} prompts ({counts}), "
          f"{args.new_tokens} new tokens each, T = {args.temperature}{detail}", flush=True)
    meta = {"target_weights_sha256": weights_digest(args.target),
            "prompts": facts, "new_tokens": args.new_tokens, "temperature": args.temperature, "seed": args.seed}
    return target, tok, prompts, meta, time.time()


def save_with_manifest(out: Path, file: str, save: Callable[[Path], None], manifest: dict) -> None:
    """`save` the product as out/file, then out's manifest.json: `manifest` and the file's sha256."""
    from ..files import sha256_file
    from ..models import MANIFEST

    out.mkdir(parents=True, exist_ok=True)
    save(out / file)
    manifest = {**manifest, "files": {file: sha256_file(out / file)}}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def write_store(args) -> Path:
    """``taps train store``: build a store of the target's answers and write it with its manifest."""
    target, tok, prompts, meta, started = start_answers(args, "store")
    store = build_store(target, tok, prompts, new_tokens=args.new_tokens, batch=args.batch,
                        temperature=args.temperature, seed=args.seed, meta=meta)
    out = Path(args.out)
    save_with_manifest(out, STORE_FILE, store.save, {
        "kind": "store", **meta, "sequences": store.num_sequences, "tokens": store.num_tokens,
        "elapsed_s": round(time.time() - started, 1),
        "command": (f"taps train store --math {args.math} --chat {args.chat} --new-tokens {args.new_tokens} "
                    f"--temperature {args.temperature} --seed {args.seed}")})
    print(f"[train store] saved {out}: {store}", flush=True)
    return out


def add_answer_arguments(p, out: Path, math: int, chat: int, temperature: float, seed: int) -> None:
    """The arguments of a command that has the target answer training prompts (``taps train store`` / ``table``)."""
    from ..arguments import float_at_least, int_at_least

    p.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "target")
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--math", type=int_at_least(0), default=math, help="GSM8K / MATH training prompts")
    p.add_argument("--chat", type=int_at_least(0), default=chat, help="ShareGPT first turns")
    p.add_argument("--new-tokens", type=int_at_least(1), default=128, help="tokens the target answers each with")
    p.add_argument("--batch", type=int_at_least(1), default=8, help="prompts decoded together")
    p.add_argument("--temperature", type=float_at_least(0), default=temperature)
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("--threads", type=int_at_least(0), default=0, help="torch threads (0: torch's default)")
    p.add_argument("--shared-data", type=Path, default=None,
                   help="folder of the shared training data (default ../shared/data or $TAPS_SHARED_DATA)")


def add_store_arguments(p) -> None:
    add_answer_arguments(p, REPO_ROOT / "models" / "stores" / "greedy", 4000, 3000, 0.0, 0)
