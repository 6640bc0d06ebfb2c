"""The speculative decoding loop.

    decoder = SpeculativeDecoder(target, [drafter_a, drafter_b], strategy="merged", depth=5, top_k=8, budget=40)
    out = decoder.generate(["prompt one", "a longer prompt two"], max_new_tokens=64, temperature=0)
    out.tokens, out.text, out.stats[0].tau, out.summary

Per step: every alive drafter expands its EAGLE-2 candidates -> the strategy builds the tree to verify
-> one target forward over the tree (:func:`taps.hf.tree_verify_forward`) -> ``taps_ops.verify_tree``
(deterministic candidates: ``draft_probs=None``; lossless at any temperature / top-k / top-p) ->
``compact_kv`` of the target cache (:func:`taps.hf.compact_cache`) -> each drafter appends the accepted
tokens and the bonus token to its own cache. Batches of ragged prompts; a request that is done (EOS or
``max_new_tokens``) stops emitting and its caches stop growing while the others continue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

import taps_ops

from . import hf
from .drafters import Drafter, average_drafters, target_vocab_size
from .expansion import scratch_positions
from .stats import Profiler, RequestStats, summarize
from .strategies import STRATEGIES, Strategy, make_strategy

__all__ = ["SpeculativeDecoder", "GenerateOutput", "check_same_tokenizer"]

Prompt = Union[str, Sequence[int], Tensor]


@dataclass
class GenerateOutput:
    """tokens: the new tokens of each request (EOS included when it ended the request); text: their
    decoding when the decoder has a tokenizer; stats: per-request :class:`RequestStats`; summary:
    :func:`taps.stats.summarize` of them; profile: mean seconds per step of each phase (when asked);
    steps: verification steps run."""

    tokens: List[List[int]]
    text: Optional[List[str]]
    stats: List[RequestStats]
    summary: dict
    profile: Optional[Dict[str, float]]
    steps: int


def check_same_tokenizer(a, b, what: str = "drafter") -> None:
    """Raise ValueError unless tokenizers `a` and `b` map the same strings to the same ids."""
    if a is None or b is None or a is b:
        return
    if len(a) != len(b) or a.get_vocab() != b.get_vocab():
        raise ValueError(f"the {what}'s tokenizer differs from the target's ({len(b)} vs {len(a)} tokens or "
                         "different ids); drafters must share the target's tokenizer")


class SpeculativeDecoder:
    """Speculative decoding of a Hugging Face causal LM with tree drafts from one or more drafters.

    Args:
        target: the target causal LM (switched to the ``"taps"`` attention; put in eval mode).
        drafters: :class:`taps.drafters.Drafter` instances (empty for ``strategy="autoregressive"``).
        strategy: one of :data:`taps.strategies.STRATEGIES`.
        depth: tree depth below the root (EAGLE-2 expansion levels).
        top_k: children per expanded node and frontier width.
        budget: nodes of one drafter's tree, root included (default depth * top_k + 1, capped by the
            number of candidates + 1). ``merged`` verifies up to T * (budget - 1) + 1 nodes.
        tokenizer: the target's tokenizer (needed for text prompts; checked against drafters' ones).
        route_steps: steps a ``route-*-prompt`` strategy observes before deciding per request.
        adaptive_prior: pseudo-count of accepted tokens per drafter for ``adaptive``.
    """

    def __init__(self, target: nn.Module, drafters: Sequence[Drafter] = (), strategy: str = "single", *,
                 depth: int = 5, top_k: int = 8, budget: Optional[int] = None, tokenizer=None,
                 route_steps: int = 3, adaptive_prior: float = 1.0):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if isinstance(drafters, Drafter):
            drafters = [drafters]
        drafters = list(drafters)
        for d in drafters:
            if not isinstance(d, Drafter):
                raise TypeError(f"drafters must be taps Drafter instances, got {type(d).__name__}")
        if depth < 1 or top_k < 1:
            raise ValueError(f"depth and top_k must be >= 1, got depth={depth}, top_k={top_k}")
        self.target = hf.use_taps_attention(target.eval())
        self.tokenizer = tokenizer
        if strategy == "average":
            if len(drafters) < 1:
                raise ValueError("strategy 'average' needs at least one drafter (got an empty list)")
            for d in drafters:
                d.bind(self.target)
            drafters = [average_drafters(drafters)] if len(drafters) > 1 else drafters
        for d in drafters:
            check_same_tokenizer(tokenizer, d.tokenizer)
            d.bind(self.target)
        self.drafters = drafters
        self.depth, self.top_k = int(depth), int(top_k)
        k = min(self.top_k, target_vocab_size(self.target))
        max_budget = k + (self.depth - 1) * k * k + 1
        self.budget = min(int(budget) if budget is not None else self.depth * k + 1, max_budget)
        self.strategy: Strategy = make_strategy(strategy, len(drafters), self.budget, route_steps=route_steps,
                                                prior=adaptive_prior)
        self.needs_hidden = any(d.needs_hidden for d in drafters)

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    # ---------------------------------------------------------------------------------------------
    def _prepare(self, inputs) -> List[List[int]]:
        if isinstance(inputs, str):
            inputs = [inputs]
        if isinstance(inputs, Tensor):
            if inputs.dim() == 1:
                inputs = inputs.unsqueeze(0)
            if inputs.dim() != 2:
                raise ValueError(f"input_ids must be [T] or [B, T], got shape {tuple(inputs.shape)}")
            rows = inputs.tolist()
        elif isinstance(inputs, (list, tuple)) and inputs and all(isinstance(x, int) for x in inputs):
            rows = [list(inputs)]
        else:
            rows = []
            for x in inputs:
                if isinstance(x, str):
                    if self.tokenizer is None:
                        raise ValueError("text prompts need SpeculativeDecoder(..., tokenizer=...)")
                    rows.append(list(self.tokenizer(x)["input_ids"]))
                elif isinstance(x, Tensor):
                    rows.append(x.reshape(-1).tolist())
                else:
                    rows.append([int(t) for t in x])
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("every prompt needs at least one token")
        vocab = target_vocab_size(self.target)
        for r in rows:
            if min(r) < 0 or max(r) >= vocab:
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return rows

    @staticmethod
    def _eos_set(eos_token_id) -> set:
        if eos_token_id is None:
            return set()
        if isinstance(eos_token_id, int):
            return {eos_token_id}
        return {int(e) for e in eos_token_id}

    @torch.no_grad()
    def generate(self, inputs, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, eos_token_id=None, stream: Optional[Callable[[int, List[int]], None]] = None,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                 profile: bool = False) -> GenerateOutput:
        """Generate up to `max_new_tokens` tokens for each prompt.

        Args:
            inputs: a string, a list of strings (needs the tokenizer), a list of token ids, a list of
                token-id lists (ragged), or an int64 tensor [T] / [B, T].
            max_new_tokens: per request.
            temperature, top_k, top_p: the target's sampling (0 = greedy; scalars or [B] tensors), as
                ``taps_ops.verify_tree`` applies them; the output distribution is the target's own.
            eos_token_id: an id or a collection of ids that end a request (kept in its output).
            stream: called as ``stream(request_index, new_tokens)`` after each step with new tokens.
            generator / seed: the random source of the acceptance coins (``seed`` makes a generator).
            profile: record mean seconds per step of each phase in ``GenerateOutput.profile``.

        Returns:
            :class:`GenerateOutput`.
        """
        rows = self._prepare(inputs)
        device = self.device
        batch = len(rows)
        if generator is None and seed is not None:
            generator = torch.Generator(device=device).manual_seed(int(seed))
        eos = self._eos_set(eos_token_id)
        prof = Profiler(enabled=profile, sync=profile and device.type == "cuda")
        sample = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)

        lens = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=device)
        longest = int(lens.max())
        ids = torch.zeros((batch, longest), dtype=torch.int64, device=device)
        for b, r in enumerate(rows):
            ids[b, :len(r)] = torch.tensor(r, dtype=torch.int64)
        strategy = self.strategy
        strategy.reset(batch, device)
        n_nodes = strategy.num_nodes
        cap = longest + max_new_tokens + self.depth + n_nodes + 4
        drafter_cap = cap + self.depth + 2 + scratch_positions(self.depth, self.top_k)
        cache = hf.TreeKVCache.for_model(self.target, batch, cap)

        stats = [RequestStats(prompt_tokens=len(r), drafter_accepted=[0] * len(self.drafters)) for r in rows]
        out_tokens: List[List[int]] = [[] for _ in rows]
        done = [False] * batch

        def emit(b: int, new: List[int]) -> None:
            room = max_new_tokens - len(out_tokens[b])
            new = new[:room]
            for i, t in enumerate(new):
                if t in eos:
                    new = new[:i + 1]
                    stats[b].finish_reason = "eos"
                    done[b] = True
                    break
            out_tokens[b].extend(new)
            if len(out_tokens[b]) >= max_new_tokens and not done[b]:
                stats[b].finish_reason = "length"
                done[b] = True
            if stream is not None and new:
                stream(b, new)

        # Prefill: the target reads the prompts; its next token (sampled like any other) is the first root.
        with prof.section("prefill"):
            pre = hf.prefill(self.target, cache, ids, lens, return_hidden=self.needs_hidden)
            one = torch.zeros((batch, 1), dtype=torch.int64, device=device)
            root = taps_ops.verify_tree(pre.logits.unsqueeze(1), one, one - 1, **sample).tokens[:, 0]
            if max_new_tokens > 0:
                for b, t in enumerate(root.tolist()):
                    emit(b, [t])
            else:
                done = [True] * batch
            for t in strategy.alive():
                self.drafters[t].start(ids, lens, root, pre.hidden_states, drafter_cap)

        steps = 0
        depth_bins = self.depth
        num_drafters = len(self.drafters)
        bit_range = torch.arange(max(num_drafters, 1), device=device)
        entropy = "entropy" in strategy.name  # only entropy routing reads it
        try:
            while not all(done):
                steps += 1
                prof.steps += 1
                with prof.section("step"):
                    alive = strategy.alive()
                    with prof.section("draft"):
                        cands = {t: self.drafters[t].draft(self.depth, self.top_k, prof, entropy) for t in alive}
                    with prof.section("tree"):
                        tree = strategy.combine(cands, root)
                    with prof.section("target_forward"):
                        fwd = hf.tree_verify_forward(self.target, cache, tree.tokens, tree.tree_mask, tree.depth,
                                                     return_hidden=self.needs_hidden)
                    with prof.section("verify"):
                        ver = taps_ops.verify_tree(fwd.logits, tree.tokens, tree.parents, **sample)
                    done_t = torch.tensor(done, device=device)
                    accepted = ver.num_accepted.masked_fill(done_t, 0)
                    path = ver.path.clone()
                    path[:, 1:].masked_fill_(done_t.unsqueeze(1), -1)
                    acc_list = accepted.tolist()
                    width = max(acc_list) + 1
                    with prof.section("compact"):
                        prefix = cache.lengths.clone()
                        hf.compact_cache(cache, path)
                        cache.lengths.copy_(torch.where(done_t, prefix, cache.lengths))  # done: frozen
                    new_tokens = ver.tokens[:, :width]
                    num_new = accepted + 1
                    hidden = None
                    if self.needs_hidden:
                        idx = path[:, :width].clamp_min(0)
                        hidden = fwd.hidden_states.gather(1, idx.unsqueeze(-1).expand(-1, -1, fwd.hidden_states.shape[-1]))
                    with prof.section("draft_update"):
                        for t in alive:
                            d = self.drafters[t]
                            d.advance(new_tokens, num_new, hidden)
                            d.lengths.sub_(done_t.long())  # done requests: frozen caches
                    root = ver.tokens.gather(1, accepted.unsqueeze(1)).squeeze(1)
                    # statistics
                    if num_drafters:
                        on_path = path[:, 1:width]
                        src = tree.source.gather(1, on_path.clamp_min(0)).masked_fill(on_path < 0, 0)
                        by_drafter = ((src.unsqueeze(-1) >> bit_range) & 1).sum(1)  # [B, T]
                        strategy.observe(by_drafter)
                        by_drafter = by_drafter.tolist()
                    choice = tree.choice.tolist() if tree.choice is not None else None
                    token_rows = new_tokens.tolist()
                    for b in range(batch):
                        if done[b]:
                            continue
                        a = acc_list[b]
                        stats[b].record(a, depth_bins)
                        if num_drafters:
                            for t in range(num_drafters):
                                stats[b].drafter_accepted[t] += by_drafter[b][t]
                        if choice is not None:
                            stats[b].route_decisions.append(choice[b])
                        emit(b, token_rows[b][:a + 1])
        finally:
            for d in self.drafters:
                d.release()
        for b in range(batch):
            stats[b].new_tokens = len(out_tokens[b])
        text = None
        if self.tokenizer is not None:
            text = [self.tokenizer.decode(t) for t in out_tokens]
        return GenerateOutput(out_tokens, text, stats, summarize(stats),
                              prof.per_step() if profile else None, steps)
