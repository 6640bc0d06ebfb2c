"""The speculative decoding loop.

    decoder = SpeculativeDecoder(target, [drafter_a, drafter_b], strategy="merged", depth=5, top_k=8, budget=40)
    out = decoder.generate(["prompt one", "a longer prompt two"], max_new_tokens=64, temperature=0)
    out.tokens, out.text, out.stats[0].tau, out.summary

Per step: the drafters expand their EAGLE-2 candidates (drafters of one kind and shape as one batched
forward, :func:`taps.drafters.make_groups`) -> the strategy builds the tree to verify -> one target
forward over the tree (:class:`taps.forward.TargetForward`: the lean path for Llama-family targets, else
the Hugging Face module) -> ``taps_ops.verify_tree`` (deterministic candidates: ``draft_probs=None``;
lossless at any temperature / top-k / top-p) -> ``taps_ops.compact_kv`` of the target cache -> one
device-to-host copy of what the step decided (accepted tokens, counts, statistics) -> each drafter group
appends the accepted tokens and the bonus token to its own cache. Batches of ragged prompts; a request
that is done (EOS or ``max_new_tokens``) stops emitting and its caches stop growing while the others
continue. Sizes that masks need (the longest committed length) are kept on the host, so a step has one
device sync: that copy.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

import taps_ops

from . import hf
from .drafters import DraftGroup, Drafter, make_groups, target_vocab_size
from .expansion import scratch_positions
from .forward import TargetForward
from .kv import pack_bits
from .lean import stack_key
from .stats import Profiler, RequestStats, summarize
from .strategies import Candidates, Combined, Strategy, make_strategy, root_tree, strategy_class
from .tuner import Tuner, node_grid, shared_costs, time_call

__all__ = ["SpeculativeDecoder", "GenerateOutput", "check_same_tokenizer", "DEFAULT_SETTINGS"]

Prompt = Union[str, Sequence[int], Tensor]

#: Tree settings used when SpeculativeDecoder is not given them, per device type. CPU: chosen by measured
#: tokens/s of the shipped models (bench/bench_settings.py, bench/RESULTS.md): every node costs target
#: compute and every level a drafter forward there, so shallow trees win (depth 3 beat 4 and 5 for every
#: strategy with trained drafters). CUDA: EAGLE-2's usual tree (not measured here).
DEFAULT_SETTINGS: Dict[str, Dict[str, int]] = {
    "cpu": dict(depth=3, top_k=4, budget=16),
    "cuda": dict(depth=5, top_k=8),
}


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
        strategy: a registered strategy name (:func:`taps.strategies.strategy_names`: the built-in ones
            and any registered with :func:`taps.register_strategy`).
        depth: tree depth below the root (EAGLE-2 expansion levels); default per device type
            (:data:`DEFAULT_SETTINGS`).
        top_k: children per expanded node and frontier width; default per device type.
        budget: nodes of one drafter's tree, root included (default depth * top_k + 1, capped by the
            number of candidates + 1). ``merged`` verifies up to T * (budget - 1) + 1 nodes. ``"auto"``:
            the default budget as the largest shape, and a :class:`taps.tuner.Tuner` choosing each step's
            draft (see `tuner`).
        tokenizer: the target's tokenizer (needed for text prompts; checked against drafters' ones).
        route_steps: steps a ``route-*-prompt`` strategy observes before deciding per request.
        adaptive_prior: pseudo-count of accepted tokens per drafter for ``adaptive``.
        lean: run the target on the lean path (:mod:`taps.lean`): None = when the architecture is
            covered (Llama, Mistral, Qwen2, Qwen3), True = require it, False = the Hugging Face module.
        tuner: a :class:`taps.tuner.Tuner` that chooses each step's drafters, depth and node budget
            (within depth / budget), or no draft at all, by measured costs and running acceptance; None:
            the fixed settings every step. Ignored without drafters.
    """

    def __init__(self, target: nn.Module, drafters: Sequence[Drafter] = (), strategy: str = "single", *,
                 depth: Optional[int] = None, top_k: Optional[int] = None, budget: Union[int, str, None] = None,
                 tokenizer=None, route_steps: int = 3, adaptive_prior: float = 1.0, lean: Optional[bool] = None,
                 tuner: Optional[Tuner] = None):
        strategy_cls = strategy_class(strategy)  # ValueError for an unknown name
        if isinstance(drafters, Drafter):
            drafters = [drafters]
        drafters = list(drafters)
        for d in drafters:
            if not isinstance(d, Drafter):
                raise TypeError(f"drafters must be taps Drafter instances, got {type(d).__name__}")
        self.target = hf.use_taps_attention(target.eval())
        defaults = DEFAULT_SETTINGS.get(self.device.type, DEFAULT_SETTINGS["cuda"])
        depth = defaults["depth"] if depth is None else depth
        top_k = defaults["top_k"] if top_k is None else top_k
        if depth < 1 or top_k < 1:
            raise ValueError(f"depth and top_k must be >= 1, got depth={depth}, top_k={top_k}")
        self.tokenizer = tokenizer
        if isinstance(budget, str):
            if budget != "auto":
                raise ValueError(f"budget must be a node count, None or 'auto', got {budget!r}")
            budget, tuner = None, tuner if tuner is not None else Tuner()
        drafters = strategy_cls.prepare_drafters(drafters, self.target)
        for d in drafters:
            check_same_tokenizer(tokenizer, d.tokenizer)
            d.bind(self.target)
        self.drafters = drafters
        self.depth, self.top_k = int(depth), int(top_k)
        k = min(self.top_k, target_vocab_size(self.target))
        max_budget = k + (self.depth - 1) * k * k + 1
        if budget is None:
            budget = defaults.get("budget", self.depth * k + 1)
        self.budget = min(int(budget), max_budget)
        self.strategy: Strategy = make_strategy(strategy, len(drafters), self.budget, route_steps=route_steps,
                                                prior=adaptive_prior)
        self.needs_hidden = any(d.target_features == "final" for d in drafters)
        self.forward = TargetForward(self.target, lean=lean)
        #: compute the target's lm_head only for the rows verification visits (None: on the CPU)
        self.lazy_head: Optional[bool] = None
        self._groups: Optional[Tuple[tuple, List[DraftGroup]]] = None
        #: chooses each step's draft (None: the fixed settings)
        self.tuner: Optional[Tuner] = tuner if drafters else None

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    # ---------------------------------------------------------------------------------------------
    def _prepare(self, inputs) -> List[List[int]]:
        if isinstance(inputs, str):
            inputs = [inputs]
        if isinstance(inputs, Tensor):
            if inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool:
                raise TypeError(f"input_ids must hold integer token ids, got dtype {inputs.dtype}")
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
                    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
                        raise TypeError(f"prompt tensors must hold integer token ids, got dtype {x.dtype}")
                    rows.append(x.reshape(-1).tolist())
                else:
                    row = []
                    for t in x:
                        if isinstance(t, bool) or not float(t).is_integer():
                            raise TypeError(f"prompt token ids must be integers, got {t!r}")
                        row.append(int(t))
                    rows.append(row)
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

    def _draft_groups(self) -> List[DraftGroup]:
        """The drafters' batched groups, rebuilt when a drafter's weights (or the target's) changed."""
        key = tuple((id(d), id(d.draft_vocab), stack_key(list(d.parameters()))) for d in self.drafters)
        key += (stack_key(list(self.target.parameters())),)
        if self._groups is None or self._groups[0] != key:
            self._groups = (key, make_groups(self.drafters))
        return self._groups[1]

    @torch.no_grad()
    def generate(self, inputs, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, eos_token_id=None, stream: Optional[Callable[[int, List[int]], None]] = None,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                 profile: bool = False) -> GenerateOutput:
        """Generate up to `max_new_tokens` tokens for each prompt.

        Args:
            inputs: a string, a list of strings (needs the tokenizer), a list of token ids, a list of
                token-id lists (ragged), or an int64 tensor [T] / [B, T].
            max_new_tokens: per request (>= 0).
            temperature, top_k, top_p: the target's sampling (0 = greedy; scalars or [B] tensors), as
                ``taps_ops.verify_tree`` applies them; the output distribution is the target's own.
            eos_token_id: an id or a collection of ids that end a request (kept in its output).
            stream: called as ``stream(request_index, new_tokens)`` after each step with new tokens.
            generator / seed: the random source of the acceptance coins (``seed`` makes a generator).
            profile: record mean seconds per step of each phase in ``GenerateOutput.profile``.

        Returns:
            :class:`GenerateOutput`.
        """
        if isinstance(max_new_tokens, bool) or not float(max_new_tokens).is_integer() or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        rows = self._prepare(inputs)
        device = self.device
        batch = len(rows)
        limit = getattr(self.target.config, "max_position_embeddings", None)
        longest = max(len(r) for r in rows)
        if limit is not None and longest + max_new_tokens > limit:
            warnings.warn(f"SpeculativeDecoder.generate: a prompt of {longest} tokens plus max_new_tokens="
                          f"{max_new_tokens} passes the target's max_position_embeddings ({limit}); positions "
                          "past it are outside what the model was trained on", stacklevel=2)
        if generator is None and seed is not None:
            generator = torch.Generator(device=device).manual_seed(int(seed))
        eos = self._eos_set(eos_token_id)
        prof = Profiler(enabled=profile, sync=profile and device.type == "cuda")
        sample = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
                      validate=device.type == "cpu")

        host_lengths = [len(r) for r in rows]
        lens = torch.tensor(host_lengths, dtype=torch.int64, device=device)
        ids = torch.zeros((batch, longest), dtype=torch.int64, device=device)
        for b, r in enumerate(rows):
            ids[b, :len(r)] = torch.tensor(r, dtype=torch.int64)
        strategy = self.strategy
        strategy.reset(batch, device)
        n_nodes = strategy.num_nodes
        cap = longest + max_new_tokens + self.depth + n_nodes + 4
        drafter_cap = cap + self.depth + 2 + scratch_positions(self.depth, self.top_k)
        cache = self.forward.new_cache(batch, cap)

        num_drafters = len(self.drafters)
        stats = [RequestStats(prompt_tokens=len(r), drafter_accepted=[0] * num_drafters) for r in rows]
        out_tokens: List[List[int]] = [[] for _ in rows]
        done = [max_new_tokens == 0] * batch

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

        if max_new_tokens == 0:
            for s in stats:
                s.finish_reason = "length"
            return GenerateOutput(out_tokens, [""] * batch if self.tokenizer is not None else None, stats,
                                  summarize(stats), {} if profile else None, 0)

        groups = self._draft_groups()
        sampling = bool(torch.as_tensor(temperature).gt(0).any())
        for g in groups:
            g.sampling = sampling
        try:
            # Prefill: the target reads the prompts; its next token (sampled like any other) is the first root.
            with prof.section("prefill"):
                capture = self._capture_layers(groups)
                pre = self.forward.prefill(cache, ids, lens, 0, return_hidden=self.needs_hidden,
                                           capture_layers=capture)
                one = torch.zeros((batch, 1), dtype=torch.int64, device=device)
                root = taps_ops.verify_tree(pre.logits.unsqueeze(1), one, one - 1, **sample).tokens[:, 0]
                for b, t in enumerate(root.tolist()):
                    emit(b, [t])
                # with a tuner, a group starts when it first drafts (never, when drafting does not pay)
                starts = {}
                for g in groups:
                    args = (ids, lens, root, _features(pre, g.target_features), drafter_cap, list(host_lengths))
                    if self.tuner is None:
                        g.start(*args)
                    else:
                        starts[id(g)] = args
            if self.tuner is not None:
                with prof.section("calibrate"):
                    self._calibrate(cache, root, host_lengths, sample, self._capture_layers(groups))
            steps = self._loop(groups, cache, root, host_lengths, done, stats, emit, sample, prof, starts)
        finally:
            for g in groups:
                g.release()
        for b in range(batch):
            stats[b].new_tokens = len(out_tokens[b])
        text = None
        if self.tokenizer is not None:
            text = [self.tokenizer.decode(t) for t in out_tokens]
        return GenerateOutput(out_tokens, text, stats, summarize(stats), prof.per_step() if profile else None, steps)

    @staticmethod
    def _capture_layers(groups: Sequence[DraftGroup]) -> Tuple[int, ...]:
        """The target layers whose inputs some drafter reads (EAGLE-3 heads)."""
        return tuple(sorted({i for g in groups if isinstance(g.target_features, tuple) for i in g.target_features}))

    def _calibrate(self, cache: hf.TreeKVCache, root: Tensor, host_lengths: List[int], sample: dict,
                   capture: Tuple[int, ...]) -> None:
        """Measure what the tuner's cost model lacks for this batch size: the target's tree forward with
        verification per node count (scratch trees written past every request's committed cache, with
        coins of a private generator: nothing is committed). Drafter groups are measured when they start
        (:meth:`_calibrate_group`)."""
        tuner = self.tuner
        batch = root.shape[0]
        if tuner.costs is None:
            p = next(self.target.parameters())
            tuner.costs = shared_costs((id(self.target), p.device, p.dtype, torch.get_num_threads()))
        tuner.begin(batch, bool(torch.as_tensor(sample["temperature"]).gt(0).any()))
        costs = tuner.costs
        if not tuner.calibrate:
            return
        sync = torch.cuda.synchronize if root.device.type == "cuda" else None
        if costs.needs_forward(batch):
            longest = max(host_lengths)
            uniform = min(host_lengths) == longest
            coins = dict(sample, generator=torch.Generator(device=root.device).manual_seed(0))
            points = []
            for n in node_grid(self.strategy.num_nodes):
                tree = _scratch_tree(root, n, self.top_k)

                def run(tree=tree):
                    fwd = self.forward.tree(cache, tree.tokens, tree.tree_mask, tree.depth, longest,
                                            capture_layers=capture, uniform=uniform)
                    self.forward.verify(fwd.hidden_states, tree.tokens, tree.parents, tree.tree_mask,
                                        lazy=self.lazy_head, **coins)
                points.append((n, time_call(run, repeats=4, sync=sync, timer=tuner.timer)))
            costs.set_forward(batch, points)

    def _calibrate_group(self, g: DraftGroup, batch: int) -> None:
        """Measure a started group's expansion at depth 1 and at the decoder's depth when the tuner's cost
        model lacks it (scratch entries only: nothing is committed)."""
        costs, members = self.tuner.costs, tuple(g.members)
        if self.tuner.calibrate and costs.needs_draft(members, batch):
            sync = torch.cuda.synchronize if self.device.type == "cuda" else None
            entropy = self.strategy.needs_entropy
            shallow = time_call(lambda: g.draft(1, self.top_k, None, entropy), sync=sync, timer=self.tuner.timer)
            deep = time_call(lambda: g.draft(self.depth, self.top_k, None, entropy), sync=sync, timer=self.tuner.timer)
            costs.set_draft(members, batch, (1, shallow), (self.depth, deep))

    def _loop(self, groups: List[DraftGroup], cache: hf.TreeKVCache, root: Tensor, host_lengths: List[int],
              done: List[bool], stats: List[RequestStats], emit, sample: dict, prof: Profiler,
              starts: Optional[Dict[int, tuple]] = None) -> int:
        """Verification steps until every request is done; returns the number of steps. ``starts``: the
        start arguments of groups not started yet (with a tuner)."""
        strategy = self.strategy
        tuner = self.tuner
        device = root.device
        batch = root.shape[0]
        num_drafters = len(self.drafters)
        depth_bins = self.depth
        bit_range = torch.arange(max(num_drafters, 1), device=device)
        alive = strategy.alive()
        capture = self._capture_layers(groups)
        # with a tuner, groups append what they missed when they next draft (see taps.tuner)
        pending = _Pending(groups, starts or {}, lambda g: self._calibrate_group(g, batch), tuner.timer) if tuner else None
        now = tuner.timer if tuner is not None else time.perf_counter
        steps = 0
        while not all(done):
            steps += 1
            prof.steps += 1
            with prof.section("step"):
                start = now()
                if strategy.alive() != alive:  # a routing decision dropped drafters
                    alive = strategy.alive()
                    if pending is not None:  # every group started and up to date
                        pending.catch_up(groups)
                    old = groups
                    groups = [g.subset([i for i, t in enumerate(g.members) if t in alive]) for g in groups]
                    if pending is not None:
                        pending.replace(old, groups)
                    groups = [g for g in groups if g is not None]
                shape, drafting, depth, parts = None, groups, self.depth, {}
                if tuner is not None:
                    active = [b for b in range(batch) if not done[b]]
                    shape = tuner.plan([tuple(g.members) for g in groups],
                                       lambda i, d: groups[i].tree_depth(d, self.top_k),
                                       [pending.count(g) for g in groups], active, batch, self.depth,
                                       self.budget)
                    drafting = [g for g in groups if set(g.members) <= set(shape.drafters)]
                    depth = shape.depth
                with prof.section("draft"):
                    updates = pending.catch_up(drafting) if pending is not None else []
                    drafted = []
                    for g in drafting:
                        t0 = now()
                        drafted.append(g.draft(depth, self.top_k, prof, strategy.needs_entropy))
                        if tuner is not None:
                            parts[("draft", tuple(g.members), depth, batch)] = (
                                now() - t0, tuner.costs.draft(tuple(g.members), depth, batch))
                with prof.section("tree"):
                    cands = None
                    if drafted:
                        order = tuple(t for g in drafting for t in g.members)
                        fields = ("scores", "tokens", "parents", "entropy")
                        cands = Candidates(*((torch.cat([getattr(c, f) for c in drafted]) if len(drafted) > 1
                                              else getattr(drafted[0], f))  # one group: no copy
                                             .view(len(order), batch, *drafted[0][i].shape[1:])
                                             for i, f in enumerate(fields)), order)
                        with strategy.step_budget(None if shape is None else shape.budget):
                            tree = strategy.combine(cands, root)
                    else:
                        tree = strategy.combine(None, root) if not groups else root_tree(root)
                    if device.type == "cpu":  # (a host read: free on the CPU, a sync elsewhere)
                        tree = _trim(tree)
                t0 = now()
                with prof.section("target_forward"):
                    longest = max(host_lengths)
                    fwd = self.forward.tree(cache, tree.tokens, tree.tree_mask, tree.depth, longest,
                                            capture_layers=capture, uniform=min(host_lengths) == longest)
                with prof.section("verify"):
                    ver = self.forward.verify(fwd.hidden_states, tree.tokens, tree.parents, tree.tree_mask,
                                              lazy=self.lazy_head, **sample)
                accepted, path = ver.num_accepted, ver.path
                any_done = any(done)
                if any_done:
                    done_t = torch.tensor(done, device=device)
                    accepted = accepted.masked_fill(done_t, 0)
                    path = path.masked_fill(done_t.unsqueeze(1) & (torch.arange(path.shape[1], device=device) > 0), -1)
                num_new = accepted + 1
                if any_done:
                    num_new = num_new.masked_fill(done_t, 0)
                with prof.section("compact"):
                    taps_ops.compact_kv(cache.kv_tensors(), path, cache.lengths, validate=device.type == "cpu")
                    cache.lengths.add_(num_new)
                # what the host needs of this step, in one copy: tokens, counts, statistics
                parts_host = [ver.tokens, accepted.unsqueeze(1), (tree.tokens >= 0).sum(1, keepdim=True)]
                if num_drafters and drafted:
                    on_path = path[:, 1:]
                    src = tree.source.gather(1, on_path.clamp_min(0)).masked_fill(on_path < 0, 0)
                    by_drafter = ((src.unsqueeze(-1) >> bit_range) & 1).sum(1)  # [B, T]
                    strategy.observe(by_drafter)
                    parts_host.append(by_drafter)
                if tree.choice is not None:
                    parts_host.append(tree.choice.unsqueeze(1))
                host = torch.cat(parts_host, 1).tolist()
                forward_seconds = now() - t0
                n = ver.tokens.shape[1]
                acc_list = [row[n] for row in host]
                width = max(a for a, d in zip(acc_list, done) if not d) + 1
                num_new_host = [0 if d else a + 1 for a, d in zip(acc_list, done)]
                tokens_host = [row[:a + 1] for row, a in zip(host, acc_list)]
                with prof.section("draft_update"):
                    if groups:
                        new_tokens = ver.tokens[:, :width]
                        idx = path[:, :width].clamp_min(0)
                        on_path = {}  # target features at the root and the accepted nodes, per kind
                        for g in groups:
                            spec = g.target_features
                            if spec is not None and spec not in on_path:
                                feats = _features(fwd, spec)
                                on_path[spec] = feats if feats.shape[1] == 1 else \
                                    feats.gather(1, idx.unsqueeze(-1).expand(-1, -1, feats.shape[-1]))
                        if pending is not None:
                            pending.add(new_tokens, num_new, on_path, num_new_host, tokens_host)
                        else:
                            for g in groups:
                                g.advance(new_tokens, num_new, on_path.get(g.target_features), num_new_host,
                                          tokens_host)
                root = ver.tokens.gather(1, accepted.unsqueeze(1)).squeeze(1)
                observed = [None] * batch
                for b in range(batch):
                    host_lengths[b] += num_new_host[b]
                    if done[b]:
                        continue
                    row, a = host[b], acc_list[b]
                    observed[b] = a
                    stats[b].record(a, depth_bins, nodes=row[n + 1])
                    if shape is not None:
                        stats[b].draft_shapes.append(shape.label)
                    if num_drafters and drafted:
                        for t in range(num_drafters):
                            stats[b].drafter_accepted[t] += row[n + 2 + t]
                    if tree.choice is not None:
                        stats[b].route_decisions.append(row[-1])
                    emit(b, row[:a + 1])
                if tuner is not None:
                    # the columns the forward ran: a batch's trees are as wide as its widest (trimmed on the CPU)
                    nodes = tree.tokens.shape[1]
                    cap = max([g.tree_depth(depth, self.top_k) for g in drafting], default=0)
                    parts[("forward", batch, round(nodes))] = (forward_seconds, tuner.costs.forward(nodes, batch))
                    tuner.observe(shape, observed, min(cap, shape.budget - 1), nodes, batch,
                                  now() - start, parts, updates)
        return steps


class _Pending:
    """Committed tokens (with the target features drafters read) that drafter groups have not appended
    yet: a group that does not draft in a step skips its update, and appends every step it missed in
    one call before it next drafts."""

    def __init__(self, groups: Sequence[DraftGroup], starts: Dict[int, tuple], on_start: Callable[[DraftGroup], None],
                 timer: Callable[[], float] = time.perf_counter):
        self.queue: Dict[int, list] = {id(g): [] for g in groups}
        self.tokens: Dict[int, int] = {id(g): 0 for g in groups}
        self.starts, self.on_start, self.timer = starts, on_start, timer

    def add(self, tokens: Tensor, num_new: Tensor, features: Dict, num_host: List[int], tokens_host) -> None:
        """One step's accepted tokens and bonus [B, K] (num_new [B] real), features {spec: [B, K, H]}."""
        entry = (tokens, num_new, features, num_host, tokens_host)
        most = max(num_host)
        for key in self.queue:
            self.queue[key].append(entry)
            self.tokens[key] += most

    def count(self, group: DraftGroup) -> int:
        """Tokens per request (the most of any) the group has yet to append: a group not started yet
        appends its prompts too."""
        args = self.starts.get(id(group))
        return self.tokens[id(group)] + (0 if args is None else max(args[-1]))

    def replace(self, old: Sequence[DraftGroup], new: Sequence[Optional[DraftGroup]]) -> None:
        """Groups replaced by their subsets (None: dropped)."""
        for a, b in zip(old, new):
            queue, count = self.queue.pop(id(a)), self.tokens.pop(id(a))
            if b is not None:
                self.queue[id(b)], self.tokens[id(b)] = queue, count

    def catch_up(self, groups: Sequence[DraftGroup]) -> List[Tuple[tuple, int, float]]:
        """Start the groups not started yet, and append what each of `groups` missed; returns (drafters,
        tokens, seconds) per append."""
        out = []
        for g in groups:
            args = self.starts.pop(id(g), None)
            if args is not None:
                g.start(*args)
                self.on_start(g)
            entries = self.queue[id(g)]
            if not entries:
                continue
            t0 = self.timer()
            tokens, num_new, features, num_host, tokens_host = _join(entries, g.target_features)
            g.advance(tokens, num_new, features, num_host, tokens_host)
            out.append((tuple(g.members), self.tokens[id(g)], self.timer() - t0))
            self.queue[id(g)], self.tokens[id(g)] = [], 0
        return out


def _join(entries: Sequence[tuple], spec):
    """Steps of (tokens [B, K_i], num_new [B], {spec: features [B, K_i, H]}, host counts, host tokens)
    as one: each row's real tokens (and features) of every step, in order, first in the row."""
    if len(entries) == 1:
        tokens, num_new, features, num_host, tokens_host = entries[0]
        return tokens, num_new, features.get(spec), num_host, tokens_host
    tokens = torch.cat([e[0] for e in entries], 1)
    valid = torch.cat([torch.arange(e[0].shape[1], device=tokens.device) < e[1].unsqueeze(1) for e in entries], 1)
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    features = None
    if spec is not None:
        feats = torch.cat([e[2][spec] for e in entries], 1)
        features = feats.gather(1, order.unsqueeze(-1).expand(-1, -1, feats.shape[-1]))
    num_new = sum(e[1] for e in entries)
    num_host = [sum(e[3][b] for e in entries) for b in range(len(entries[0][3]))]
    tokens_host = [[t for e in entries for t in e[4][b][:e[3][b]]] for b in range(len(num_host))]
    return tokens.gather(1, order), num_new, features, num_host, tokens_host


def _scratch_tree(root: Tensor, nodes: int, top_k: int) -> Combined:
    """A tree of `nodes` nodes per request for timing: node i's parent is (i - 1) // top_k (the shape of
    a full top-k expansion), every token the root's."""
    batch = root.shape[0]
    parents = [-1] + [(i - 1) // top_k for i in range(1, nodes)]
    depth = [0] * nodes
    anc = torch.eye(nodes, dtype=torch.bool)
    for i in range(1, nodes):
        depth[i] = depth[parents[i]] + 1
        anc[i] |= anc[parents[i]]
    device = root.device
    expand = lambda t: t.to(device).unsqueeze(0).expand(batch, *t.shape).contiguous()  # noqa: E731
    return Combined(root.view(batch, 1).expand(batch, nodes).contiguous(), expand(torch.tensor(parents)),
                    expand(torch.tensor(depth)), expand(pack_bits(anc)), torch.zeros_like(root).view(batch, 1), None)


def _trim(tree: Combined) -> Combined:
    """The tree without its padding columns past the largest real node count of the batch (padding nodes
    come after every real node; a merged tree is padded to room for the whole union, which the drafters'
    overlap rarely fills), so that the target forward and the verification read only those."""
    num = tree.tokens.shape[1]
    real = int((tree.tokens >= 0).sum(1).max())
    if real >= num:
        return tree
    words = (real + 63) // 64
    cut = lambda t: t[:, :real]  # noqa: E731
    return Combined(cut(tree.tokens), cut(tree.parents), cut(tree.depth), tree.tree_mask[:, :real, :words],
                    cut(tree.source), tree.choice)


def _features(out: hf.ForwardOutput, spec) -> Optional[Tensor]:
    """What a drafter group reads of a target forward (see :attr:`taps.drafters.Drafter.target_features`)."""
    if spec is None:
        return None
    if spec == "final":
        return out.hidden_states
    return torch.cat([out.layers[i] for i in spec], dim=-1)
