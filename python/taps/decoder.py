"""The speculative decoding loop.

    decoder = SpeculativeDecoder(target, [drafter_a, drafter_b], strategy="merged", depth=5, top_k=8, budget=40)
    out = decoder.generate(["prompt one", "a longer prompt two"], max_new_tokens=64, temperature=0)
    out.tokens, out.text, out.stats[0].tau, out.summary

A batch of requests is a :class:`DecodeState` (:meth:`SpeculativeDecoder.start`: prefill, the first
token, the drafter groups started); :meth:`SpeculativeDecoder.step` runs one verification step over it as
named phases:

1. route: drop the groups of drafters a routing decision retired;
2. plan: the draft (the fixed settings, or the tuner's choice of drafters, depth and budget, down to none);
3. draft: each drafting group expands its EAGLE-2 candidates (drafters of one kind and shape as one
   batched forward, :func:`taps.drafters.make_groups`);
4. tree: the strategy combines them into the tree to verify;
5. verify: one target forward over the tree (:class:`taps.forward.TargetForward`: the lean path for
   Llama-family targets, else the Hugging Face module) and ``taps_ops.verify_tree`` (deterministic
   candidates, ``draft_probs=None``: lossless at any temperature / top-k / top-p);
6. commit: the accepted path compacted in the target cache, the next roots;
7. read back: what the step decided (tokens, counts, statistics) in one device-to-host copy
   (:class:`_HostRecord`);
8. advance: each drafter group appends the committed tokens (queued until it next drafts, with a tuner);
9. record: per-request statistics, emitted tokens, the tuner's observation.

Batches of ragged prompts; a request that is done (EOS or ``max_new_tokens``) stops emitting and its
caches stop growing while the others continue. Sizes that masks need (the longest committed length) are
kept on the host, so a step has one device sync: the read-back. Requests join and leave a running state
between steps (:meth:`SpeculativeDecoder.join`, :meth:`SpeculativeDecoder.drop`; continuous batching in
:mod:`taps.batching`).
"""

from __future__ import annotations

import functools
import numbers
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn

import taps_ops

from . import hf
from .drafters import DraftGroup, Drafter, make_groups, target_vocab_size
from .expansion import DraftSampler, num_candidates, scratch_positions, target_probs
from .forward import TargetForward
from .judge import GenerationJudge, WindowJudge
from .kv import pack_bits
from .lean import stack_key
from .stats import Profiler, RequestStats, summarize
from .strategies import Candidates, Combined, Strategy, make_strategy, root_tree, sampled_tree, strategy_class
from .tuner import DRAWN, NONE, CoastToken, Shape, Tuner, identity, node_grid, shared_costs, time_call

__all__ = ["SpeculativeDecoder", "GenerateOutput", "DecodeState", "RequestState", "check_same_tokenizer",
           "check_max_new_tokens", "DEFAULT_SETTINGS"]

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
        sampled_drafts: where some request samples (temperature > 0) and one drafter group drafts a step
            (one model drafter, or drafters of one shape batched together, e.g. two EAGLE heads of a target:
            then the mean of their distributions), its tree may be *drawn* instead of taken as top-k
            (:func:`taps.expansion.expand_sampled`: ``(budget - 1) // depth`` independent draws at the root,
            at most top_k below depth 1, each continued by one draw per level; every draw kept) and verified by recursive
            rejection sampling (``taps_ops.verify_tree(draft_probs=...)``). Lossless as the top-k tree is; a draw is accepted
            with probability 1 - TV(target, drafter) at its node, where top-k children carry the target's
            mass on those k tokens only: drawn trees accept more at high temperatures (shipped drafters,
            T = 1: tau 1.6 -> 2.4-2.7), top-k trees at low ones (T = 0.3-0.5). ``"auto"`` (default): a
            tuner weighs the drawn shapes beside the top-k ones by their measured acceptance; with fixed
            settings, top-k trees (an n-gram table's drafts drawn, its top-k trees left out of a tuner's
            candidates too: see below). True: drawn wherever allowed. False: never. Not for prompt lookup (no
            distribution), steps where drafters of different groups draft (their trees would be merged), or
            the routing strategies (they rank trees by their draws). A greedy request of such a batch draws
            from q all on its drafter's argmax (its chains are the drafter's modes), which verification at
            temperature 0 accepts as a top-1 chain: its tokens stay the target's greedy ones. An n-gram
            table (:attr:`taps.drafters.base.DraftGroup.draws_greedy`) draws where no request samples too: one
            chain of its modes a request, its cheap draft (one host call against the expansion over its logits);
            unless ``sampled_drafts=False``, its drafts are drawn, with fixed settings or a tuner.
    """

    def __init__(self, target: nn.Module, drafters: Sequence[Drafter] = (), strategy: str = "single", *,
                 depth: Optional[int] = None, top_k: Optional[int] = None, budget: Union[int, str, None] = None,
                 tokenizer=None, route_steps: int = 3, adaptive_prior: float = 1.0, lean: Optional[bool] = None,
                 tuner: Optional[Tuner] = None, sampled_drafts: Union[bool, str] = "auto"):
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
        #: a ragged batch's tree forward computes each request's real nodes only, not B times the widest
        #: tree's (the lean path on the CPU, where the node counts are on the host; see TargetForward.tree),
        #: and its prefill each prompt's tokens only, not B times the longest's (TargetForward.prefill)
        self.pack_trees = True
        #: with a tuner, a started drafter group far behind when requests join a running batch is parked
        #: (returned to not started, see _Pending.park); each started group then keeps its requests' history
        #: (their tokens and the target features it reads: B x length x hidden per group). False: no history,
        #: no parking (a server whose drafters pay on most steps, with a large target)
        self.park_groups = True
        #: with a tuner, a drafter group that runs a model and has not been the tuner's choice for this many
        #: steps in a row (its probes apart) leaves the batch for good (:meth:`_retire`): in a continuous batch
        #: a drafter that does not pay still costs its upkeep at every join, drop and plan. None (the default
        #: here; ``taps serve`` takes RETIRE_AFTER): never, so a drafter that pays in bursts stays
        self.retire_after: Optional[int] = None
        #: with a tuner: coasting plain steps (no draft chosen, nothing changed) are reported to it as runs of at
        #: least this many (:meth:`_observe_coast`); None: one in the tuner's plain_sample timed on its own
        self.coast_block: Optional[int] = COAST_BLOCK
        #: with a tuner: judges :meth:`generate`'s generations against this decoder's own autoregressive decoding
        #: and runs the next ones of a batch size plain where drafting lost (:class:`taps.judge.GenerationJudge`);
        #: None: every generation tuned
        self.judge: Optional[GenerationJudge] = GenerationJudge() if tuner is not None else None
        #: with a tuner: a drafter group that runs a model and that the tuner chose (its probes apart) on at
        #: most one step in IDLE_SHARE of :meth:`generate`'s for this many generations in a row (of one
        #: verification mode: greedy or sampled; generations of MIN_VERDICT_STEPS steps or more) is left out of
        #: the next generations of that mode, tried again after 1, 2, 4, ... up to LEAVE_OUT_MOST left out: its
        #: upkeep on the plain steps (queued appends, the plan's and the coast's checks of it) is gone, and a
        #: generation that leaves out every group runs autoregressive steps. Prompt lookup is left out only from
        #: generations where every request samples (greedy, whether it pays depends on the prompt's loops: left
        #: out after two prompts without, it missed the next ones'; at T > 0 its upkeep cost the T = 1 rows
        #: ~3%). None: never left out
        self.leave_out_after: Optional[int] = LEAVE_OUT_AFTER
        #: (sampling, group members) -> [generations idle in a row, generations still to leave it out]
        self._idle: Dict[Tuple[bool, Tuple[int, ...]], List[int]] = {}
        #: (rows, requests, tree width) of the target forwards run so far (see _first_shape)
        self._shapes_run: set = set()
        self._groups: Optional[Tuple[tuple, List[DraftGroup]]] = None
        #: chooses each step's draft (None: the fixed settings)
        self.tuner: Optional[Tuner] = tuner if drafters else None
        if sampled_drafts not in (True, False, "auto"):
            raise ValueError(f"sampled_drafts must be True, False or 'auto', got {sampled_drafts!r}")
        #: drawn trees where some request samples and one drafter group drafts (see the class docstring)
        self.sampled_drafts = sampled_drafts

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @property
    def leave_out_after(self) -> Optional[int]:
        """Generations in a row a drafter group may go (almost) unchosen by the tuner before the next ones leave
        it out (see ``__init__``); None: never left out."""
        return self._leave_out_after

    @leave_out_after.setter
    def leave_out_after(self, value: Optional[int]) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"leave_out_after must be None or an integer >= 1, got {value!r}")
        self._leave_out_after = value

    # -- the tuner's state across processes --------------------------------------------------------------
    def tuner_fingerprint(self) -> dict:
        """What a tuner's measurements and acceptance hold for: the target and drafters (their class,
        config and a digest of their weights), the strategy and settings, device, dtype, torch threads and
        the CPU (taps_ops.cpu_info), the taps version. :meth:`load_tuner` refuses state saved under another."""
        import taps_ops

        from . import __version__

        p = next(self.target.parameters())
        return {"taps": __version__, "target": _module_digest(self.target),
                "drafters": [_module_digest(d) for d in self.drafters], "strategy": type(self.strategy).__name__,
                "depth": self.depth, "top_k": self.top_k, "budget": self.budget, "device": p.device.type,
                "dtype": str(p.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
                "cpu": taps_ops.cpu_info()["summary"]}

    def save_tuner(self, path, window_judge: Optional[WindowJudge] = None) -> None:
        """Write what the tuner measured and learned (its costs, pooled acceptance, probe schedule) and what the
        generation judge holds (:attr:`judge`: per batch size, whether drafting lost against this decoder's
        autoregressive decoding, and its plain steps' times) to `path` (JSON), for :meth:`load_tuner` in a later
        process: a new decoder then starts where this one is, not with a calibration, a tuner's first tries of
        each draft (a short first answer of a fresh tuner read 0.62x taps autoregressive on the shipped models)
        and the tuned generations a judge runs before its first verdict (at a batch of 8 where drafting loses,
        the 5-7 of a bench's first 32 rounds that cost such a row 3-5%). `window_judge`: a continuous batch's
        judge of this decoder's steps (``taps.batching.ContinuousBatch.judge``, the server's), kept too."""
        if self.tuner is None:
            raise ValueError("save_tuner: this decoder has no tuner (budget='auto' or tuner=...)")
        judges = {}
        if self.judge is not None:
            judges["generation"] = self.judge.state_dict()
        if window_judge is not None:
            judges["window"] = window_judge.state_dict()
        self.tuner.save(path, self.tuner_fingerprint(), judges=judges)

    def load_tuner(self, path, window_judge: Optional[WindowJudge] = None) -> None:
        """Take the state :meth:`save_tuner` wrote (and the judges' states it holds: this decoder's generation
        judge, and `window_judge`'s when given and saved); ValueError when it was saved by a decoder of another
        target, drafters, settings, device, dtype, thread count or CPU (naming what differs), or holds a judge
        state that is not one."""
        if self.tuner is None:
            raise ValueError("load_tuner: this decoder has no tuner (budget='auto' or tuner=...)")
        judges = self.tuner.load(path, self.tuner_fingerprint()) or {}
        if self.judge is not None and "generation" in judges:
            self.judge.load_state_dict(judges["generation"])
        if window_judge is not None and "window" in judges:
            window_judge.load_state_dict(judges["window"])

    # ---------------------------------------------------------------------------------------------
    def prompt_ids(self, inputs) -> List[List[int]]:
        """Prompts as token-id lists, checked: `inputs` as :meth:`generate` takes them (ValueError /
        TypeError for empty prompts, ids outside the target's vocabulary, text without a tokenizer)."""
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

    def new_groups(self) -> List[DraftGroup]:
        """Drafter groups for a new batch (not started), sharing the decoder's packed weights."""
        return [g.spawn() for g in self._draft_groups()]

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
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        rows = self.prompt_ids(inputs)
        device = self.device
        limit = getattr(self.target.config, "max_position_embeddings", None)
        longest = max(len(r) for r in rows)
        if limit is not None and longest + max_new_tokens > limit:
            warnings.warn(f"SpeculativeDecoder.generate: a prompt of {longest} tokens plus max_new_tokens="
                          f"{max_new_tokens} passes the target's max_position_embeddings ({limit}); positions "
                          "past it are outside what the model was trained on", stacklevel=2)
        if generator is None and seed is not None:
            generator = torch.Generator(device=device).manual_seed(int(seed))
        eos = frozenset(self._eos_set(eos_token_id))
        requests = [RequestState(b, max_new_tokens, eos, RequestStats(prompt_tokens=len(r),
                                                                  drafter_accepted=[0] * len(self.drafters)))
                    for b, r in enumerate(rows)]
        on_tokens = None if stream is None else (lambda request, new: stream(request.key, new))
        prof = Profiler(enabled=profile, sync=profile and device.type == "cuda")
        sample = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        if max_new_tokens == 0:
            for r in requests:
                r.stats.finish_reason = "length"
        left_out: List[int] = []
        judged_plain = False
        if max_new_tokens > 0:
            groups = self._draft_groups()
            tuner = self.tuner
            # prompt lookup is judged only where every request samples (see __init__)
            sampling, free_judged, _ = _sample_modes(sample, len(requests))
            # (a tuner of injected costs chooses by them: not judged)
            judge = self.judge if (tuner is not None and groups and tuner._learns_fix()
                                   and self.judge is not None and self.judge.judges(len(requests))) else None
            verdict = (sampling, len(requests))
            # a generation the judge runs plain: its decoder's own autoregressive decoding (no group started)
            judged_plain = judge is not None and judge.plain(verdict)
            kept = [] if judged_plain else self._leave_out(groups, sampling, free_judged)
            if not judged_plain:
                left_out = sorted(t for g in groups if g not in kept for t in g.members)
            if tuner is not None and not kept:
                self.tuner = None  # every group left out: the generation's steps are autoregressive ones
            try:
                state = self.start(rows, requests, sample, kept, prof, generator=generator, on_tokens=on_tokens)
                clock = tuner.timer if judge is not None else None
                began = clock() if clock is not None else 0.0
                steps: List[Tuple[int, float]] = []
                while not state.finished:
                    t0, batch = (clock(), state.batch) if judged_plain else (0.0, 0)
                    self.step(state)
                    self._drop_finished(state)
                    if judged_plain:
                        steps.append((batch, clock() - t0))
                decoded = clock() - began if clock is not None else 0.0
            finally:
                self.tuner = tuner
                for g in groups:
                    g.release()
            if judged_plain:
                judge.reference(verdict, steps)
            elif judge is not None and kept:
                judge.tuned(verdict, decoded, [len(r.tokens) for r in requests])
            if tuner is not None and kept:
                self._judge_idle(kept, state, prof.steps, sampling, free_judged)
            elif tuner is not None:  # (each step a plain one: what a tuner's statistics call it)
                for r in requests:
                    r.stats.draft_shapes = ["none"] * len(r.stats.tree_nodes)
        for r in requests:
            r.stats.new_tokens = len(r.tokens)
        tokens = [r.tokens for r in requests]
        text = None if self.tokenizer is None else [self.tokenizer.decode(t) for t in tokens]
        stats = [r.stats for r in requests]
        summary = summarize(stats)
        if self.tuner is not None:
            summary["left_out"] = left_out
            summary["judged_plain"] = judged_plain
        return GenerateOutput(tokens, text, stats, summary, prof.per_step() if profile else None, prof.steps)

    def _leave_out(self, groups: List[DraftGroup], sampling: bool, free_judged: bool) -> List[DraftGroup]:
        """The groups a generation in this verification mode starts (:attr:`leave_out_after`): all but
        those the last generations left idle, each left out for its count of generations (prompt lookup only
        where `free_judged`: every request samples)."""
        if self.tuner is None or self.leave_out_after is None:
            return list(groups)
        kept = []
        for g in groups:
            idle = self._idle.get((sampling, tuple(g.members))) if _judged(g, free_judged) else None
            if idle is not None and idle[1] > 0:
                idle[1] -= 1
            else:
                kept.append(g)
        return kept

    def _judge_idle(self, kept: List[DraftGroup], state: "DecodeState", steps: int, sampling: bool,
                    free_judged: bool) -> None:
        """After a generation that started groups `kept`: each one that runs a model (and prompt lookup where
        `free_judged`; never an n-gram table, kept current at little cost: :func:`_judged`) and that the tuner
        chose (probes apart) on at most one step in IDLE_SHARE was idle (the
        steps a routing strategy's subset of a group drafted count for the group); idle for
        :attr:`leave_out_after` generations in a row, it is left out of the next ones (1, 2, 4, ...,
        LEAVE_OUT_MOST); chosen more often, its count starts over. A generation of fewer than MIN_VERDICT_STEPS
        steps judges nothing."""
        if self.leave_out_after is None or steps < MIN_VERDICT_STEPS:
            return
        for g in kept:
            if not _judged(g, free_judged):
                continue
            members = tuple(g.members)
            chosen = sum(n for m, n in state.chosen.items() if set(m) <= set(members))
            idle = self._idle.setdefault((sampling, members), [0, 0])
            if chosen * IDLE_SHARE > steps:
                idle[0] = idle[1] = 0
                continue
            idle[0] += 1
            if idle[0] >= self.leave_out_after:
                idle[1] = min(2 ** (idle[0] - self.leave_out_after), LEAVE_OUT_MOST)

    # -- a batch of requests: start, step ------------------------------------------------------------
    def start(self, rows: List[List[int]], requests: List["RequestState"], sample: dict, groups: List[DraftGroup],
              prof: Profiler, *, generator: Optional[torch.Generator] = None, on_tokens=None,
              fresh: bool = True) -> "DecodeState":
        """Prefill the prompts `rows` (one per request), sample each request's first token and start the
        drafter `groups` (not started yet, for these rows): the state :meth:`step` continues.

        ``sample``: temperature / top_k / top_p (scalars or [B] tensors); the coins come from each
        request's own generator (``RequestState.coins``) when every request has one, else from `generator`.
        With a tuner a group starts when it first drafts (never, when drafting does not pay). ``fresh``: a
        new batch (the strategy's and the tuner's per-request state start over); False: requests that
        :meth:`join` adds to a running batch (nothing of the running batch reset)."""
        device = self.device
        batch = len(rows)
        host_lengths = [len(r) for r in rows]
        longest = max(host_lengths)
        lens = torch.tensor(host_lengths, dtype=torch.int64, device=device)
        ids = torch.zeros((batch, longest), dtype=torch.int64, device=device)
        for b, r in enumerate(rows):
            ids[b, :len(r)] = torch.tensor(r, dtype=torch.int64)
        # a request's last step can accept its drafters' deepest path past max_new (prompt lookup's chains
        # are longer than the decoder's depth), and a finished request stays in a generate() batch, so the
        # others' trees go after its length
        deepest = max([self.depth] + [g.tree_depth(self.depth, self.top_k) for g in groups])
        cap = max(len(r) + q.max_new for r, q in zip(rows, requests)) + deepest + self.strategy.num_nodes + 4
        drafter_cap = cap + self.depth + 2 + scratch_positions(self.depth, self.top_k)
        if fresh:
            self.strategy.reset(batch, device)
        state = DecodeState(requests, self.forward.new_cache(batch, cap), groups,
                            dict(sample, validate=device.type == "cpu"), generator, prof, on_tokens,
                            self.strategy.alive(), self.strategy.num_nodes)
        for g in groups:
            g.sampling = state.sampling
        state.capture = self.forward.capture_layers(g.target_features for g in groups)
        with prof.section("prefill"):
            pre = self.forward.prefill(state.cache, ids, lens, 0, return_hidden=self.needs_hidden,
                                       capture_layers=state.capture,
                                       host_lengths=host_lengths if device.type == "cpu" and self.pack_trees
                                       else None)
            state.root = self.forward.sample(pre.logits, uniforms=state.coins(1, 1), generator=generator,
                                             **state.sample)
            for request, length, t in zip(requests, host_lengths, state.root.tolist()):
                request.length = length
                state.emit(request, [t])
            for g in groups:
                args = (ids, lens, state.root, self.forward.features(pre, g.target_features), drafter_cap,
                        list(host_lengths))
                if self.tuner is None:
                    g.start(*args)
                else:
                    state.starts[id(g)] = args
        if self.tuner is not None:
            state.pending = _Pending(groups, state.starts, lambda g: self._calibrate_group(g, state),
                                     self.tuner.timer, history=self.park_groups)
            if fresh:
                with prof.section("calibrate"):
                    self.tuner.begin(batch, state.sampling)
                    self._calibrate(state)
        return state

    def step(self, state: "DecodeState") -> None:
        """One verification step of every unfinished request of `state`: route, draft, build the tree,
        the target's tree forward and verification, commit the accepted path, read the step back to the
        host, advance the drafters, record."""
        prof = state.prof
        prof.steps += 1
        with prof.section("step"):
            # the clock is read only for a step the tuner observes (from after its plan, below): a run of coasting
            # plain steps reads it where it starts and where it is reported (_observe_coast), none between (a
            # CPU-time clock can cost 100 us a read inside a VM)
            self._route(state)
            if state.coast is not None and self._coasts(state):
                if self.coast_block is not None:
                    # coasting plain steps are timed as a run (two clock reads a run, see _observe_coast)
                    block = state.coast_block
                    if block is None:
                        block = state.coast_block = [self._now(), 0]
                    self._plain_step(state)
                    block[1] += 1
                    if block[1] >= self.coast_block and self.tuner.observes(NONE):
                        self._observe_coast(state)
                    return
                # (coast_block None: one coasting step in plain_sample timed on its own, through the whole step)
                if not self.tuner.observes(NONE):
                    self._plain_step(state)
                    return
                plan = _Plan(NONE, [], 0)
            elif state.coast_draft is not None and self._coasts_draft(state):
                last = state.coast_draft[0]
                plan = _Plan(last.shape, last.drafting, last.depth, coasted=True)
            else:
                state.coast_block = None
                plan = self._plan(state)
                state.coast_draft = None
                tuner = self.tuner
                if (tuner is not None and plan.drafting and not tuner.probing and tuner.repeats(plan.shape)
                        and all(g.kept_current for g in plan.drafting)):
                    ready = self._free_ready(state)
                    if ready is not None:
                        state.coast_draft = (plan, state.epoch, 0, ready)
            self._retire(state, plan)
            if plan.drafting and plan.shape is not None and not self.tuner.probing:
                for g in plan.drafting:  # (what the tuner chose, for _judge_idle)
                    key = tuple(g.members)
                    state.chosen[key] = state.chosen.get(key, 0) + 1
            timed = plan.shape is not None and not plan.coasted and self.tuner.observes(plan.shape)
            if timed:
                # a step is timed from after its plan: the plan's own work (a recomputation after a request joined
                # or finished, ~1 ms at a batch of 8; the plan that repeats the last draft unpriced, ~0.1 ms at a
                # batch of 1) is the same whichever shape it chooses, and the steps that coast, plain or drafted
                # (most of them), plan nothing. Plain steps: their price had stood 18-28% above their time in a
                # server load, within 3% since. Drafted ones: an n-gram table's drawn chains, timed with their
                # plans, were priced 1.2-1.7x what their steps take (fp32, batch 1), and whole answers ran plain.
                # (A drafted step's catch-ups of the groups asked for matches, run by its plan, stay its own.)
                start = self._now()
                if plan.shape.drafters:
                    start -= sum(u[2] for u in plan.updates)
            with prof.section("draft"):
                drafted = self._draft(state, plan, timed)
            with prof.section("tree"):
                tree, nodes = self._tree(state, plan, drafted)
            t0 = self._now() if timed else 0.0
            fwd, ver = self._verify(state, tree, nodes)
            # the rows the forward computed: the [B, N] grid, or packed, the real nodes (and half precision's
            # filler); the tuner prices a step at rows / B nodes per request
            rows = tree.tokens.numel() if fwd.packed is None else len(fwd.packed[0])
            first = timed and self._first_shape(rows, *tree.tokens.shape)
            with prof.section("compact"):
                path, num_new = self._commit(state, ver)
            record = self._read_back(state, tree, ver, path, drafted is not None, nodes, plan)
            forward_seconds = self._now() - t0 if timed else 0.0
            with prof.section("draft_update"):
                self._advance_drafters(state, plan, fwd, ver, path, num_new, record)
            self._record(state, plan, tree, record, forward_seconds,
                         self._now() - start if timed else 0.0, timed, first, rows)

    def _first_shape(self, rows: int, batch: int, width: int) -> bool:
        """Whether this step's target forward ran a shape (rows computed, requests, tree width) this decoder
        had not run before: its time may hold one-off costs (on the CPU oneDNN builds a bf16 product's kernel
        the first time it meets a row count, several times the call's own time), so the tuner's costs leave
        it out (:meth:`_record`)."""
        shape = (rows, batch, width)
        if shape in self._shapes_run:
            return False
        self._shapes_run.add(shape)
        return True

    def _may_draw(self, state: "DecodeState", group: DraftGroup) -> bool:
        """Whether a step where `group` drafts alone (one drafter, or several of one shape batched: their
        mean distribution) may draw its tree: where some request samples (a greedy request beside it drafts its
        drafter's modes, which verification at temperature 0 accepts exactly as a top-1 chain), or where the
        group's drawn draft is its cheap greedy one too (:attr:`DraftGroup.draws_greedy`: an n-gram table)."""
        return (self.sampled_drafts is not False and (state.sampling or group.draws_greedy)
                and self.strategy.takes_sampled and not group.free_draft)

    def _now(self) -> float:
        return self.tuner.timer() if self.tuner is not None else time.perf_counter()

    # -- the phases of a step ------------------------------------------------------------------------------
    def _route(self, state: "DecodeState") -> None:
        """Drop the groups of drafters the strategy no longer drafts with (a routing decision)."""
        alive = self.strategy.alive()
        if alive == state.alive or not state.can_drop:
            return
        state.alive = alive
        if state.pending is not None:  # every group started and up to date
            state.pending.catch_up(state.groups)
        old = state.groups
        groups = [g.subset([i for i, t in enumerate(g.members) if t in alive]) for g in old]
        if state.pending is not None:
            state.pending.replace(old, groups)
        state.groups = [g for g in groups if g is not None]
        state.epoch += 1

    def _plan(self, state: "DecodeState") -> "_Plan":
        """The step's draft: the fixed settings, or the tuner's choice of drafters, depth and budget."""
        tuner = self.tuner
        if tuner is None:
            groups = state.groups
            if any(g.free_draft for g in groups):
                # a group whose draft runs no model (prompt lookup) and has nothing to propose for any request
                # (no match) sits the step out: a step where no group drafts is a plain one (its draft, tree and
                # commit cost 150-200 us of host work on the shipped models, on ~70% of prompt lookup's steps)
                active = state.active()
                groups = [g for g in groups if not g.free_draft or any(g.has_draft(b) for b in active)]
            return _Plan(None, groups, self.depth)
        groups = state.groups
        state.coast = None
        active = state.active()
        # groups whose draft runs no model (prompt lookup) catch up now (once started they are kept
        # current) and say whether they have anything to propose: one without a match for any request is
        # left out of this step's plan (its match rate is then that of the steps it could draft, and a
        # step without a match drafts nothing)
        free = [g for g in groups if g.free_draft]
        updates = state.pending.catch_up(free) if free else []
        ready = self._ready(groups, active)
        drawn = tuple(i for i, g in enumerate(groups) if self._may_draw(state, g))
        shape = tuner.plan([tuple(g.members) for g in groups], lambda i, d: groups[i].tree_depth(d, self.top_k),
                           [state.pending.count(g) for g in groups], active, state.batch, self.depth, self.budget,
                           drawn=drawn, drawn_only=True if self.sampled_drafts is True else
                           [i for i in drawn if groups[i].draws_greedy],
                           candidates=lambda i, d: num_candidates(d, self.top_k), ready=ready,
                           starting=[self._starting(state, g) for g in groups],
                           drawn_nodes=functools.partial(self._drawn_nodes, sampling=state.sampling),
                           left=[state.requests[b].left for b in active] if state.closed else None,
                           previous=state.last_kind)
        if not shape.drafters:  # a plain step (most steps where no draft pays: kept lean)
            # repeated without planning until a probe could come due, while the groups idle now stay idle
            token = tuner.coast_token()
            if token is not None:
                state.coast = (token, state.epoch) + self._coast_checks(token, groups, active)
            return _Plan(shape, [], 0, updates=updates)
        chosen = set(shape.drafters)
        return _Plan(shape, [g for g in groups if chosen.issuperset(g.members)], shape.depth, updates=updates)

    @staticmethod
    def _starting(state: "DecodeState", group: DraftGroup) -> int:
        """Of the tokens `group` has yet to append (``state.pending.count``), those the tuner prices as its start
        (:meth:`taps.tuner.CostModel.start`, its measured seconds per token): a group not started yet starts on its
        prompts (and the steps folded into them), and appends the steps queued since; a host drafter kept current once
        started (prompt lookup, an n-gram table) starts on all of them, each appended as cheaply as its start
        indexes a prompt's token. (Its appends are never timed once it runs, so the append price stayed the
        calibration's guess for a drafter that runs a model, one expansion level: the n-gram table's 0.13 ms + 8 us a
        token, fp32, batch 1, against ~1 us a token measured; a generation that had not drafted yet priced its first
        draft higher with each step, and decoded its whole answer plain where the table's chains give 1.5x.)"""
        pending = state.pending
        if group.kept_current and not pending.started(group):
            return pending.count(group)
        return pending.start_tokens(group)

    def _coasts_draft(self, state: "DecodeState") -> bool:
        """Whether this step repeats the last drafted step's plan without planning or timing
        (:data:`DRAFT_COAST` steps in a row at most, then a step that plans and is timed): no request joined,
        finished or left since, and the tuner would repeat that draft unpriced (:meth:`Tuner.repeats`; its
        values stand). Only where the drafting groups are kept current (an n-gram table: nothing queued, whose
        appends would be priced) and the groups asked for matches (prompt lookup, kept current) have a match for the
        same requests as at that plan (:meth:`_free_ready`: the matches are a plan's inputs). Their acceptance is
        still observed every step (:meth:`Tuner.observe_accepted`). Why: a drawn table chain's step took ~0.1 ms
        longer under a tuner than with fixed settings (bf16, 1.11 against 1.02 ms), the plan, the clock reads and
        the observation's bookkeeping; prompt lookup's drafted steps from the shipped store ~0.1 ms each too (fp32,
        batch 1: 2.40 against 2.29 ms), most of them plans that repeat the last draft unpriced (Tuner.plan)."""
        plan, epoch, count, ready = state.coast_draft
        if (epoch != state.epoch or count >= DRAFT_COAST or (ready and self._free_ready(state) != ready)
                or not self.tuner.repeats(plan.shape, step=True)):
            state.coast_draft = None
            return False
        state.coast_draft = (plan, epoch, count + 1, ready)
        return True

    @classmethod
    def _free_ready(cls, state: "DecodeState") -> Optional[Tuple[Tuple[int, ...], ...]]:
        """Per group asked for matches (prompt lookup), the active requests it has a match for (:meth:`_ready`);
        () with no such group; None while one of them has not started (no matches to ask: only a plan starts
        it)."""
        free = [g for g in state.groups if g.free_draft]
        if not free:
            return ()
        if state.pending is not None and not all(state.pending.started(g) for g in free):
            return None
        return tuple(cls._ready(free, state.active()))

    def _coasts(self, state: "DecodeState") -> bool:
        """Whether this step repeats the last plan's answer, no draft, without planning (the tuner's clock
        counts it: :meth:`Tuner.coast`): the last plan chose no draft, no request joined, finished or left
        since, the groups idle then (a prompt lookup without a match) still are and the free groups have no
        more requests with a match than then (a free group is kept current every step, so asking it is a
        lookup of a flag per request; the checks that could fail were listed when the plan chose,
        :meth:`_coast_checks`: none once a plan with a match chose no draft at a batch of 1). A run of plain
        steps should cost what autoregressive steps do: within decoding, every microsecond of host work
        between two forwards costs about two."""
        token, epoch, checks, active = state.coast
        return (epoch == state.epoch and (not checks or all(sum(g.has_draft(b) for b in active) <= most
                                                            for g, most in checks))
                and self.tuner.coast(token, checked=True))

    def _observe_coast(self, state: "DecodeState") -> None:
        """Report the coasting plain steps since the last report (:attr:`DecodeState.coast_block`) to the tuner as
        one plain step of their mean time (from the start of the first to the end of the last, the host's work
        between them included, as autoregressive decoding pays it), the forward its part beyond the plain step's
        predicted rest. Single timed steps had priced plain steps 20-30% above what coasting ones take (bf16, a
        batch of 8 with prompt lookup from the store: 1.38-1.51 ms against a mean of 1.14-1.29): those right after
        a plan ran on the caches it had left, and a timed step goes through the whole step (draft, tree and
        timing bookkeeping for nothing); a price that high had drafts chosen that gave fewer tokens per second
        than plain steps."""
        t0, count = state.coast_block
        now = self._now()
        state.coast_block = [now, 0]
        tuner = self.tuner
        mean = (now - t0) / count
        part, predicted = tuner.forward_part(NONE, 1.0, state.batch)
        tuner.observe(NONE, [None] * state.batch, 0, 1.0, state.batch, mean,
                      {part: (max(mean - tuner.costs.rest(NONE.key), 0.0), predicted)}, [], drafting=(0, 0))

    def plain_step(self, state: "DecodeState") -> None:
        """A plain step of every unfinished request of `state` outside the tuner's plans (a
        :class:`taps.judge.WindowJudge`'s plain window): the target's one-token forward and verification, the
        commit, the tokens read back, the groups' appends queued (or kept current: a drafted step later resumes
        where they are), the statistics; no plan, draft or tuner observation (a run of coasting steps the tuner
        times starts over after it)."""
        state.prof.steps += 1
        state.coast_block = None
        self._plain_step(state)

    def _plain_step(self, state: "DecodeState") -> None:
        """A coasting step the tuner does not time (:meth:`_coasts`, :meth:`Tuner.observes`): what
        :meth:`step` does for a plain step, without the phases that do nothing in it (retiring, drafting,
        a tree, timing): the target's one-token forward and verification, the commit, the tokens read back,
        the groups' queued appends, the statistics."""
        # (no draft's distributions nor a drawn chain's layout carried over from a drafted step before it)
        state.draft_probs, state.chain = None, False
        tree = root_tree(state.root)
        nodes = [1] * state.batch
        fwd, ver = self._verify(state, tree, nodes)
        with state.prof.section("compact"):
            path, num_new = self._commit(state, ver)
        record = self._read_back(state, tree, ver, path, False, nodes)
        with state.prof.section("draft_update"):
            self._advance_drafters(state, _COASTING, fwd, ver, path, num_new, record)
        self._record(state, _COASTING, tree, record, 0.0, 0.0, False, False, state.batch)

    def _retire(self, state: "DecodeState", plan: "_Plan") -> None:
        """Drop, for the rest of the batch, each drafter group that runs a model and that the tuner has not
        chosen (its probes apart) for :attr:`retire_after` steps in a row: its start arguments or state, its
        queued steps and history are released, and the tuner's plans, joins and drops no longer carry it
        (in a server on a CPU, where the shipped heads seldom pay at a batch of 8, that upkeep cost more than
        the tuner's draft choices gained). Groups kept current (prompt lookup, an n-gram table: at little cost;
        prompt lookup's matches come and go) are never retired, nor the batch's last group; a batch made afresh
        has every group again."""
        if self.retire_after is None or state.pending is None or plan.shape is None:
            return
        chosen = set() if self.tuner.probing else set(plan.shape.drafters)
        retired = []
        for g in state.groups:
            if g.kept_current:
                continue
            if chosen and chosen.issuperset(g.members):
                state.unchosen[id(g)] = 0
                continue
            state.unchosen[id(g)] = state.unchosen.get(id(g), 0) + 1
            if state.unchosen[id(g)] >= self.retire_after and all(g is not d for d in plan.drafting):
                retired.append(g)  # (a group this step's probe drafts with leaves after it)
        if len(retired) == len(state.groups):  # (one group stays: a batch without any drafts with no drafter)
            retired = retired[1:]
        if not retired:
            return
        for g in retired:
            if state.pending.started(g):
                g.release()
            state.pending.replace([g], [None])
            del state.unchosen[id(g)]
        state.groups = [g for g in state.groups if all(g is not r for r in retired)]
        state.capture = self.forward.capture_layers(g.target_features for g in state.groups)
        state.retired += [t for g in retired for t in g.members]
        state.epoch += 1

    @staticmethod
    def _coast_checks(token: CoastToken, groups: Sequence[DraftGroup], active: List[int]) -> Tuple[tuple, List[int]]:
        """What a coasting step must check for `token` (:meth:`CoastToken.limits`, the conditions on the groups
        :meth:`Tuner.coast` would check): each group and the most requests it may have a draft for; with the
        active requests (they stay while the coast does: a finished one ends it)."""
        return tuple((groups[i], most) for i, most in token.limits(len(active))), active

    @staticmethod
    def _ready(groups: Sequence[DraftGroup], active: Sequence[int]) -> List[Optional[Tuple[int, ...]]]:
        """Per group: for a free group (prompt lookup), the active requests it has something to propose for
        (those with a match); None for the others (they always propose)."""
        return [tuple(b for b in active if g.has_draft(b)) if g.free_draft else None for g in groups]

    def _draft(self, state: "DecodeState", plan: "_Plan", timed: bool = False) -> Optional[Candidates]:
        """The drafting groups' candidates (a group behind on appends catches up first), stacked in the
        groups' member order; None when no group drafts. ``timed``: the step is timed for the tuner (each group's
        draft then timed against its price, a part of the step)."""
        state.draft_probs = None
        if not plan.drafting:  # a plain step
            return None
        if state.pending is not None:
            plan.updates = plan.updates + state.pending.catch_up(plan.drafting)
        drafted = []
        alone = len(plan.drafting) == 1 and len(plan.drafting[0].members) == 1
        if plan.shape is not None:
            sampled = plan.shape.drawn
        else:
            sampled = (len(plan.drafting) == 1 and (self.sampled_drafts is True or plan.drafting[0].draws_greedy)
                       and self._may_draw(state, plan.drafting[0]))
        for g in plan.drafting:
            g.alone = alone
            t0 = self._now() if timed else 0.0
            if sampled:
                width = self._drawn_width(self.budget if plan.shape is None else plan.shape.budget, plan.depth,
                                          state.sampling)
                draft = g.draft_sampled(plan.depth, width, state.sampler(), state.prof)
                state.draft_probs = (draft.probs, g.token_map)
                drafted.append(draft.candidates)
            else:
                drafted.append(g.draft(plan.depth, self.top_k, state.prof, self.strategy.needs_entropy))
            if timed:
                costs, members = self.tuner.costs, tuple(g.members)
                key = costs.draft_key(members, state.batch, sampled)
                plan.parts[("draft", key, plan.depth, state.batch)] = (
                    self._now() - t0, costs.draft(members, plan.depth, state.batch, drawn=sampled))
        if not drafted:
            return None
        order = tuple(t for g in plan.drafting for t in g.members)
        if sampled:  # one slab [1, B, M], drawn from the group's drafter or the mean of its drafters'
            cands = Candidates(*(f.unsqueeze(0) for f in drafted[0]), order)
        else:
            fields = ("scores", "tokens", "parents", "entropy")
            cands = Candidates(*((torch.cat([getattr(c, f) for c in drafted]) if len(drafted) > 1
                                  else getattr(drafted[0], f))  # one group: no copy
                                 .view(len(order), state.batch, *drafted[0][i].shape[1:])
                                 for i, f in enumerate(fields)), order)
        done = [b for b, r in enumerate(state.requests) if r.done]
        if done:
            # a finished request (still a row of the batch) proposes nothing: its candidates become padding
            # and its tree is its root, so the target's forward does not compute nodes no one reads (at
            # batch 16, a quarter of a late step's tree rows were finished requests')
            drop = torch.zeros(state.batch, dtype=torch.bool, device=cands.tokens.device)
            drop[done] = True
            cands = cands._replace(tokens=cands.tokens.masked_fill(drop.view(1, -1, 1), -1))
        return cands

    def _drawn_nodes(self, budget: int, depth: int, sampling: bool = True) -> int:
        """The nodes (root included) a drawn draft of `depth` levels under `budget` runs (:meth:`_drawn_width`
        chains)."""
        return 1 + self._drawn_width(budget, depth, sampling) * depth

    def _drawn_width(self, budget: int, depth: int, sampling: bool = True) -> int:
        """The chains a drawn draft of `depth` levels under a node budget draws at each root (the expansion's
        scratch columns hold top_k nodes a level); one where no request samples (every chain of a greedy
        request is its drafter's modes)."""
        if not sampling:
            return 1
        width = max(1, (budget - 1) // max(depth, 1))
        return min(width, self.top_k) if depth > 1 else width

    def _tree(self, state: "DecodeState", plan: "_Plan", cands: Optional[Candidates]) -> Tuple[Combined, Optional[List[int]]]:
        """The tree to verify: the strategy's combination of the candidates (the root alone without); and
        on the CPU each request's real nodes (root included; None elsewhere: a host read is a sync there)."""
        batch = state.root.shape[0]
        state.chain = False
        if cands is not None and state.draft_probs is not None:  # drawn: every draw, in order
            if not any(r.done for r in state.requests):  # every candidate a real draw: the drawn layout as it is
                tree = sampled_tree(cands, state.root, plan.depth)
                # one chain a request: its accepted path is a prefix of the tree, where the K/V already are
                state.chain = tree.tokens.shape[1] == plan.depth + 1
                return tree, [tree.tokens.shape[1]] * batch if state.root.device.type == "cpu" else None
            tree = sampled_tree(cands, state.root)
        elif cands is not None:
            with self.strategy.step_budget(None if plan.shape is None else plan.shape.budget):
                tree = self.strategy.combine(cands, state.root)
        else:
            tree = root_tree(state.root)
        if tree.tokens.shape[1] == 1:  # the root alone (a plain step): nothing to count or trim
            return tree, [1] * batch
        if state.root.device.type != "cpu":
            return tree, None
        nodes = (tree.tokens >= 0).sum(1).tolist()  # (a host read: free on the CPU)
        return _trim(tree, max(nodes)), nodes

    def _verify(self, state: "DecodeState", tree: Combined,
                nodes: Optional[List[int]] = None) -> Tuple[hf.ForwardOutput, taps_ops.VerifyOutput]:
        """The target's forward over the trees (their real `nodes` only, when known and ragged enough:
        :meth:`TargetForward.tree`) and ``taps_ops.verify_tree`` of what it predicts (with the distributions
        a sampled draft drew from: recursive rejection sampling)."""
        with state.prof.section("target_forward"):
            lengths = state.host_lengths
            longest = max(lengths)
            fwd = self.forward.tree(state.cache, tree.tokens, tree.tree_mask, tree.depth, longest,
                                    capture_layers=state.capture, uniform=min(lengths) == longest,
                                    nodes=nodes if self.pack_trees else None)
        with state.prof.section("verify"):
            extra = {}
            if state.draft_probs is not None:  # this step's drawn tree
                probs, token_map = state.draft_probs
                extra["draft_probs"] = target_probs(probs[:, :tree.tokens.shape[1]], token_map,
                                                    self.forward.head.weight.shape[0])
            ver = self.forward.verify(fwd.hidden_states, tree.tokens, tree.parents, tree.tree_mask,
                                      lazy=self.lazy_head, uniforms=state.coins(tree.tokens.shape[1], state.coin_width),
                                      generator=state.generator, packed=fwd.packed, **state.sample, **extra)
        return fwd, ver

    def _commit(self, state: "DecodeState", ver: taps_ops.VerifyOutput) -> Tuple[Tensor, Tensor]:
        """Commit each unfinished request's accepted path to the target cache and take its last token as
        the next root; returns the path and the tokens committed per request (0 for a finished one), [B, N]
        and [B]."""
        path, accepted = ver.path, ver.num_accepted
        done = [r.done for r in state.requests]
        if path.shape[1] == 1:
            # a plain step (every tree its root alone): the root's K/V were written at each request's length,
            # where they stay; compacting moves nothing (what compact_cache would do, one op instead of ~4)
            num_new = torch.tensor([0 if d else 1 for d in done], device=path.device) if any(done) else \
                torch.ones_like(accepted)
            state.cache.lengths.add_(num_new)
            state.root = ver.tokens[:, 0]
            return path, num_new
        if any(done):
            done_t = torch.tensor(done, device=path.device)
            accepted = accepted.masked_fill(done_t, 0)
            path = path.masked_fill(done_t.unsqueeze(1) & (torch.arange(path.shape[1], device=path.device) > 0), -1)
            num_new = (accepted + 1).masked_fill(done_t, 0)
        else:
            num_new = accepted + 1
        if state.chain:  # every accepted path a prefix of its chain: its K/V are in place (compaction moves nothing)
            state.cache.lengths.add_(num_new)
        else:
            self.forward.commit(state.cache, path, num_new, validate=state.sample["validate"])
        state.root = ver.tokens.gather(1, accepted.unsqueeze(1)).squeeze(1)
        return path, num_new

    def _read_back(self, state: "DecodeState", tree: Combined, ver: taps_ops.VerifyOutput, path: Tensor,
                   drafted: bool, nodes: Optional[List[int]] = None, plan: Optional["_Plan"] = None) -> "_HostRecord":
        """What the host needs of the step, in one device-to-host copy: each request's emitted tokens, its
        accepted count, the tree's real nodes (unless `nodes` gives them), the accepted tokens each drafter
        had proposed (also given to the strategy) and the routing choice."""
        num_drafters = len(self.drafters)
        if ver.tokens.shape[1] == 1 and nodes is not None and tree.choice is None:
            # a plain step (no draft, nothing accepted): each request's token alone
            return _HostRecord([[] if r.done else [t] for r, t in zip(state.requests, ver.tokens.view(-1).tolist())],
                               [0] * len(state.requests), nodes, None, None)
        parts = [ver.tokens, ver.num_accepted]  # (the counts as a column where more parts follow)
        if nodes is None:
            parts.append((tree.tokens >= 0).sum(1, keepdim=True))
        by_drafter = num_drafters > 0 and drafted
        # one drafter drafted the step's every node (the decoder's only one, or the tuner chose one, e.g. prompt
        # lookup of a merged decoder): its accepted tokens are each request's accepted count, read back anyway (no
        # gather of the path's sources: ~50 us a step on the CPU; with one drafter, no count of the path: ~20 us)
        alone = (plan.drafting[0].members[0] if by_drafter and plan is not None
                 and len(plan.drafting) == 1 and len(plan.drafting[0].members) == 1 else None)
        if by_drafter and alone is None:
            on_path = path[:, 1:]
            if num_drafters == 1:  # every draft node is the one drafter's: its count is the path's length
                counts = (on_path >= 0).sum(1, keepdim=True)
            else:
                src = tree.source.gather(1, on_path.clamp_min(0)).masked_fill(on_path < 0, 0)
                bits = torch.arange(num_drafters, device=src.device)
                counts = ((src.unsqueeze(-1) >> bits) & 1).sum(1)  # [B, T]
            self.strategy.observe(counts)
            parts.append(counts)
        if tree.choice is not None:
            parts.append(tree.choice.unsqueeze(1))
        if len(parts) == 2:  # tokens and accepted counts alone: two reads, no copy into one tensor (~5 us)
            host = [row + [a] for row, a in zip(ver.tokens.tolist(), ver.num_accepted.tolist())]
        else:
            host = torch.cat([parts[0], parts[1].unsqueeze(1), *parts[2:]], 1).tolist()
        n = ver.tokens.shape[1]
        first = n + 2 if nodes is None else n + 1  # the first per-drafter count
        record = _HostRecord([], [], [] if nodes is None else nodes, [] if by_drafter else None,
                             [] if tree.choice is not None else None)
        for row, request in zip(host, state.requests):
            a = 0 if request.done else row[n]
            record.accepted.append(a)
            record.tokens.append([] if request.done else row[:a + 1])
            if nodes is None:
                record.nodes.append(row[n + 1])
            if alone is not None:
                counts = [0] * num_drafters
                counts[alone] = a
                record.by_drafter.append(counts)
            elif by_drafter:
                record.by_drafter.append(row[first:first + num_drafters])
            if record.route is not None:
                record.route.append(row[-1])
        if alone is not None:
            self.strategy.observe_drafter(alone, record.accepted)
        return record

    def _advance_drafters(self, state: "DecodeState", plan: "_Plan", fwd: hf.ForwardOutput,
                          ver: taps_ops.VerifyOutput, path: Tensor, num_new: Tensor, record: "_HostRecord") -> None:
        """Each group appends the committed tokens (and the target features it reads at the root and the
        accepted nodes); with a tuner, queued until the group next drafts."""
        groups = state.groups
        if not groups:
            return
        counts = [len(t) for t in record.tokens]
        width = max(max(counts), 1)
        new_tokens = ver.tokens if ver.tokens.shape[1] == width else ver.tokens[:, :width]  # (a plain step: as is)
        idx = None
        features = {}
        for g in groups:
            spec = g.target_features
            if spec is not None and spec not in features:
                feats = self.forward.features(fwd, spec)
                if feats.shape[1] > 1:  # a tree's: the accepted path's rows
                    idx = path[:, :width].clamp_min(0) if idx is None else idx
                    feats = feats.gather(1, idx.unsqueeze(-1).expand(-1, -1, feats.shape[-1]))
                features[spec] = feats
        if state.pending is not None:
            state.pending.add(new_tokens, num_new, features, counts, record.tokens)
        else:
            for g in groups:
                g.advance(new_tokens, num_new, features.get(g.target_features), counts, record.tokens)

    def _record(self, state: "DecodeState", plan: "_Plan", tree: Combined, record: "_HostRecord",
                forward_seconds: float, seconds: float, timed: bool, first: bool, rows: int) -> None:
        """Per-request statistics and emission, and the tuner's observation (`timed`: the step was timed
        for it, :meth:`Tuner.observes`; ``first``: its forward ran a shape for the first time, so its times
        correct no cost, :meth:`_first_shape`; ``rows``: the rows the forward computed)."""
        observed: List[Optional[int]] = [None] * state.batch
        label = None if plan.shape is None else plan.shape.label
        drafted = plan.shape is not None and bool(plan.shape.drafters)
        drafting = below = 0  # requests whose tree held more than its root, and their nodes below the roots
        for b, request in enumerate(state.requests):
            new = record.tokens[b]
            request.length += len(new)
            if request.done:
                continue
            # a drafted step's request with its root alone (a prompt lookup without a match) is no trial of
            # the kind's acceptance: the tuner values such kinds over the requests with a match
            if not drafted or record.nodes[b] > 1:
                observed[b] = record.accepted[b]
                drafting += 1
                below += record.nodes[b] - 1
            stats = request.stats
            stats.record(record.accepted[b], self.depth, nodes=record.nodes[b])
            if label is not None:
                stats.draft_shapes.append(label)
            if record.by_drafter is not None:
                for t, c in enumerate(record.by_drafter[b]):
                    stats.drafter_accepted[t] += c
            if record.route is not None:
                stats.route_decisions.append(record.route[b])
            state.emit(request, new)
        if plan.coasted or timed:
            # nodes per request: a batch's trees are as wide as its widest (trimmed on the CPU), and a packed
            # forward costs about what its rows spread over every request would
            tuner, nodes = self.tuner, rows / state.batch
            cap = min(max([g.tree_depth(plan.depth, self.top_k) for g in plan.drafting], default=0),
                      plan.shape.budget - 1)
        if plan.coasted:
            tuner.observe_accepted(plan.shape, observed, cap, nodes)
        if timed:
            # measured against that node count's own prediction (its scale is what the measurement corrects),
            # or for prompt lookup the kind's (Tuner.forward_part)
            part, predicted = tuner.forward_part(plan.shape, nodes, state.batch)
            plan.parts[part] = (forward_seconds, predicted)
            # (a probe after a step of another kind corrects no cost: Tuner.observe's switched)
            tuner.observe(plan.shape, observed, cap, nodes, state.batch, seconds,
                          plan.parts, plan.updates, costs=not first, drafting=(drafting, below),
                          switched=state.last_kind != plan.shape.key)
        state.last_kind = NONE.key if plan.shape is None else plan.shape.key

    # -- requests joining and leaving a running batch --------------------------------------------------
    def join(self, state: "DecodeState", other: "DecodeState") -> None:
        """Add the requests of `other` (made by :meth:`start` with ``fresh=False`` from groups spawned off
        `state`'s) after `state`'s, between two steps. `other` is consumed.

        With a tuner, a group that has not started yet stays so (the new requests' prompts join its start
        arguments); one that has appends what it missed, and the group of the new requests starts now and
        joins it."""
        pending = state.pending
        state.epoch += 1
        state.cache.append_requests(other.cache)
        state.root = torch.cat([state.root, other.root])
        for g, h in zip(state.groups, other.groups):
            if pending is not None and pending.started(g):
                pending.park(g)  # a group far behind returns to not started (its arguments joined below)
            if pending is not None and not pending.started(g):
                pending.fold(g)
                pending.append_start(g, other.starts.pop(id(h)))
                continue
            if pending is not None:
                pending.catch_up([g])
                args = other.starts.pop(id(h), None)
                if args is not None:
                    h.start(*args)
                    pending.extend_history(g, args)
            g.append_requests(h)
        state.sample = _join_sample(state.sample, state.batch, other.sample, other.batch)
        state.requests += other.requests
        self.strategy.add_requests(other.batch, state.root.device)
        self._begin(state, added=other.batch)

    def _drop_finished(self, state: "DecodeState") -> None:
        """A generation's finished requests leave its batch once they are a share of it (1 / DROP_SHARE of the
        rows; a drop re-indexes the cache, the groups' states and the tuner's requests: ~0.3-0.7 ms on the
        shipped models), as :class:`taps.batching.ContinuousBatch` drops them: the requests left no longer pay
        the forward of rows that are done. Requests finish apart wherever drafts are accepted unevenly: at a
        batch of 8 (bf16, the n-gram table's chains) the last ~20 of 58 steps had run the whole batch for the
        few requests left."""
        if DROP_SHARE is None:
            return
        done = sum(1 for r in state.requests if r.done)
        if done and done < state.batch and done * DROP_SHARE >= state.batch:
            from .batching import _fill_holes

            self.drop(state, _fill_holes([b for b, r in enumerate(state.requests) if not r.done]))

    def drop(self, state: "DecodeState", keep: Sequence[int]) -> None:
        """Keep only the requests at positions `keep` of `state` (in that order), between two steps."""
        keep = list(keep)
        if keep == list(range(state.batch)):
            return
        index = torch.tensor(keep, dtype=torch.int64, device=state.root.device)
        state.epoch += 1
        if state.pending is not None:
            state.pending.select_requests(keep, index)
        state.cache.select_requests(index)
        state.root = state.root.index_select(0, index)
        for g in state.groups:
            if state.pending is None or state.pending.started(g):
                g.select_requests(keep)
        state.sample = _select_sample(state.sample, index, state.batch)
        state.requests = [state.requests[b] for b in keep]
        self.strategy.select_requests(index)
        if self.tuner is not None:
            self.tuner.acceptance.select_requests(keep)
        if state.batch:
            self._begin(state)

    def _begin(self, state: "DecodeState", added: int = 0) -> None:
        """After the batch changed: the sampling mode of the drafters and the tuner, and the costs the
        tuner lacks for the new batch size."""
        sampling, _, greedy = _sample_modes(state.sample, state.batch)
        for g in state.groups:
            g.sampling = sampling
        changed, state.sampling = sampling != state.sampling, sampling
        state.greedy_rows = greedy
        if self.tuner is None:
            return
        if changed:
            self.tuner.begin(state.batch, sampling)
        elif added:
            self.tuner.acceptance.add_requests(added)
        self._calibrate(state)
        for g in state.groups:
            if state.pending.started(g):
                self._calibrate_group(g, state)

    # -- the tuner's cost measurements -----------------------------------------------------------------
    def _calibrate(self, state: "DecodeState") -> None:
        """Measure what the tuner's cost model lacks for this batch size (nothing when a calibrated batch
        size within a factor ``CostModel.reach`` stands for it): the target's tree forward with
        verification per node count (scratch trees written past every request's committed cache, with
        coins of a private generator: nothing is committed); the first batch size on the whole node grid,
        later ones (requests joining and leaving a running batch meet many) on four node counts, in a
        third of the time; each point within the tuner's ``calibration_budget`` (a large target's forward is
        timed once per point). Drafter groups are measured when they start (:meth:`_calibrate_group`)."""
        tuner = self.tuner
        batch = state.batch
        if tuner.costs is None:
            p = next(self.target.parameters())
            tuner.costs = shared_costs((identity(self.target), tuple(identity(d) for d in self.drafters), p.device,
                                        p.dtype, torch.get_num_threads()))
        costs = tuner.costs
        if not tuner.calibrate or not costs.needs_forward(batch):
            return
        sync = torch.cuda.synchronize if state.root.device.type == "cuda" else None
        lengths = state.host_lengths
        longest = max(lengths)
        uniform = min(lengths) == longest
        coins = dict(state.sample, generator=torch.Generator(device=state.root.device).manual_seed(0))
        points = []
        grid = node_grid(self.strategy.num_nodes)
        first = not costs.forward_points
        if not first:
            top = grid[-1]
            grid = sorted({1, max(top // 4, 1), max(top // 2, 1), top})
        for n in grid:
            tree = _scratch_tree(state.root, n, self.top_k)

            def run(tree=tree):
                fwd = self.forward.tree(state.cache, tree.tokens, tree.tree_mask, tree.depth, longest,
                                        capture_layers=state.capture, uniform=uniform)
                self.forward.verify(fwd.hidden_states, tree.tokens, tree.parents, tree.tree_mask,
                                    lazy=self.lazy_head, **coins)
            # a warm-up call at every point: the first call at a new node count creates its kernels'
            # primitives (measured: a 0.5B target's first 2-node forward took 1.3x its later ones)
            points.append((n, time_call(run, repeats=4 if first else 2, sync=sync, timer=tuner.timer,
                                        budget=tuner.calibration_budget)))
        costs.set_forward(batch, points)

    def _calibrate_group(self, g: DraftGroup, state: "DecodeState") -> None:
        """Measure a started group's expansion at depth 1 and at the decoder's depth when the tuner's cost
        model lacks it (scratch entries only: nothing is committed); where the group may draw its drafts (every
        request samples), its drawn draft too, from a private generator (the requests' draws are left as they
        are)."""
        costs, members, batch = self.tuner.costs, tuple(g.members), state.batch
        if not self.tuner.calibrate:
            return
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        timing = dict(sync=sync, timer=self.tuner.timer, budget=self.tuner.calibration_budget)
        if costs.needs_draft(members, batch):
            entropy = self.strategy.needs_entropy
            shallow = time_call(lambda: g.draft(1, self.top_k, None, entropy), **timing)
            deep = time_call(lambda: g.draft(self.depth, self.top_k, None, entropy), **timing)
            costs.set_draft(members, batch, (1, shallow), (self.depth, deep))
        drawn = members + (DRAWN,)
        if self._may_draw(state, g) and costs.needs_draft(drawn, batch):
            sampler = DraftSampler(state.sample["temperature"], state.sample["top_k"], state.sample["top_p"],
                                   generator=torch.Generator(device=self.device).manual_seed(0))
            width = self._drawn_width(self.budget, self.depth, state.sampling)
            shallow = time_call(lambda: g.draft_sampled(1, width, sampler), **timing)
            deep = time_call(lambda: g.draft_sampled(self.depth, width, sampler), **timing)
            costs.set_draft(drawn, batch, (1, shallow), (self.depth, deep))


def check_max_new_tokens(value) -> int:
    """`value` as an int >= 0 (ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value).is_integer() or value < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {value!r}")
    return int(value)


@dataclass
class RequestState:
    """One request of a batch, on the host: what it emitted, its committed length and when it ends.

    key: the caller's name for it (``generate``: its index); max_new: tokens it may emit; eos: ids that
    end it; stats: its :class:`RequestStats`; coins: its own generator of acceptance coins (None: the
    batch's)."""

    key: Hashable
    max_new: int
    eos: frozenset
    stats: RequestStats
    coins: Optional[torch.Generator] = None
    tokens: List[int] = field(default_factory=list)
    length: int = 0
    done: bool = False

    @property
    def left(self) -> int:
        """Tokens it may still emit (``max_new`` less those emitted; an EOS may end it sooner)."""
        return self.max_new - len(self.tokens)

    def emit(self, new: Sequence[int]) -> List[int]:
        """Take `new` tokens up to ``max_new`` and the first EOS (kept); returns those taken."""
        if self.done:
            return []
        new = list(new[:self.max_new - len(self.tokens)])
        for i, t in enumerate(new):
            if t in self.eos:
                new = new[:i + 1]
                self.stats.finish_reason = "eos"
                self.done = True
                break
        self.tokens.extend(new)
        if len(self.tokens) >= self.max_new and not self.done:
            self.stats.finish_reason = "length"
            self.done = True
        return new


class DecodeState:
    """What a decoder keeps between the steps of one batch of requests (row b = ``requests[b]``): the
    requests' host records, the target cache, each request's current root (its last committed token,
    not cached yet), the drafter groups (with their queued appends and unstarted groups under a tuner),
    the sampling settings and the coins. Made by :meth:`SpeculativeDecoder.start`; requests join and
    leave it between steps (:meth:`SpeculativeDecoder.join`, :meth:`SpeculativeDecoder.drop`)."""

    def __init__(self, requests: List[RequestState], cache: hf.TreeKVCache, groups: List[DraftGroup], sample: dict,
                 generator: Optional[torch.Generator], prof: Profiler, on_tokens, alive: List[int], coin_width: int):
        self.requests = requests
        self.cache = cache
        self.groups = groups
        #: temperature / top_k / top_p (scalars or [B] tensors) and validate, as verify_tree takes them
        self.sample = sample
        self.generator = generator
        self.prof = prof
        self.on_tokens = on_tokens
        self.alive = alive
        #: coins a request with its own generator draws per step (the widest tree), whatever its tree's size
        self.coin_width = coin_width
        self.root: Optional[Tensor] = None
        self.capture: Tuple[int, ...] = ()
        self.pending: Optional[_Pending] = None
        self.starts: Dict[int, tuple] = {}
        #: groups of drafters the strategy stops drafting with are dropped (False where requests join later)
        self.can_drop = True
        #: no request joins: the batch ends with its last request (a tuner values steps by that end,
        #: Tuner.plan's left); False where requests join later
        self.closed = True
        #: some request samples (drafts may be drawn); per request, whether it is greedy
        #: (temperature 0: it draws no coins, :meth:`coins`)
        self.sampling, _, self.greedy_rows = _sample_modes(sample, len(requests))
        #: this step's drawn tree: (the distributions it was drawn from [B, 1 + M, V'], the drafter's
        #: token_map), None for a top-k tree (SpeculativeDecoder(sampled_drafts=))
        self.draft_probs: Optional[tuple] = None
        #: this step's tree is one drawn chain a request (its accepted paths are prefixes: nothing to compact)
        self.chain = False
        #: the last step's draft kind (Shape.key; a plain step's before the first, after a coasting step and with
        #: fixed settings): what the tuner's plan and observation compare a step's kind with
        self.last_kind: tuple = NONE.key
        #: counts the changes a tuner's plan depends on (requests finishing, joining or leaving, groups
        #: dropped); coast: (the tuner's coast token, epoch) after a plan of no draft
        self.epoch = 0
        self.coast: Optional[tuple] = None
        #: while coasting: [the tuner's clock when the run's report period began, plain steps since]
        #: (SpeculativeDecoder._observe_coast)
        self.coast_block: Optional[list] = None
        #: after a drafted step the tuner chose (not a probe) where the drafting groups are kept current: (its plan,
        #: epoch, steps repeated since, the matches of the groups asked for them then) (SpeculativeDecoder._coasts_draft)
        self.coast_draft: Optional[tuple] = None
        #: with a tuner: per group, the steps since the tuner last chose it (SpeculativeDecoder._retire); the
        #: drafters (indices) of the groups retired so far
        self.unchosen: Dict[int, int] = {}
        self.retired: List[int] = []
        #: with a tuner: steps it chose each group (its members) to draft, probes apart
        self.chosen: Dict[Tuple[int, ...], int] = {}

    @property
    def batch(self) -> int:
        return len(self.requests)

    @property
    def host_lengths(self) -> List[int]:
        return [r.length for r in self.requests]

    def active(self) -> List[int]:
        """Positions of the requests still generating."""
        return [b for b, r in enumerate(self.requests) if not r.done]

    @property
    def finished(self) -> bool:
        return all(r.done for r in self.requests)

    def coins(self, width: int, draw: int) -> Optional[Tensor]:
        """[B, width] acceptance coins from each request's own generator (`draw` >= width drawn per
        request, so that what a request draws does not depend on its neighbours' trees); None when the
        requests use the batch's generator."""
        if not self.requests or any(r.coins is None for r in self.requests):
            return None
        device = self.requests[0].coins.device
        greedy = self.greedy_rows
        # a greedy request's coins are never read (verification takes the argmax): none drawn from its generator,
        # zeros in its row (8 generators' draws and their stack cost ~60 us a step at a batch of 8)
        if all(greedy):
            return torch.zeros((len(self.requests), width), device=device)
        return torch.stack([torch.zeros(draw, device=device) if g else torch.rand(draw, generator=r.coins, device=device)
                            for r, g in zip(self.requests, greedy)])[:, :width]

    def sampler(self) -> DraftSampler:
        """How a sampled draft draws, with the target's sampling settings: from each request's own
        generator when every request has one (its draws then do not depend on its neighbours'), else
        from the batch's."""
        own = None if not self.requests or any(r.coins is None for r in self.requests) else [r.coins for r in self.requests]
        return DraftSampler(self.sample["temperature"], self.sample["top_k"], self.sample["top_p"],
                            generator=self.generator, generators=own)

    def emit(self, request: RequestState, new: Sequence[int]) -> None:
        kept = request.emit(new)
        if request.done:
            self.epoch += 1
        if kept and self.on_tokens is not None:
            self.on_tokens(request, kept)


@dataclass
class _Plan:
    """A step's draft: the tuner's shape (None: the fixed settings), the groups that draft, the depth;
    the timed parts and group appends the tuner is told of."""

    shape: Optional[Shape]
    drafting: List[DraftGroup]
    depth: int
    parts: Dict[tuple, Tuple[float, float]] = field(default_factory=dict)
    updates: list = field(default_factory=list)
    #: a drafted step repeating the last one's plan unplanned and untimed (SpeculativeDecoder._coasts_draft)
    coasted: bool = False


#: the plan of :meth:`SpeculativeDecoder._plain_step` (read only: an untimed step records no parts)
_COASTING = _Plan(NONE, [], 0)


class _HostRecord(NamedTuple):
    """A step as the host reads it, per request: the tokens it emits (accepted drafts and the bonus;
    empty for a finished request), its accepted drafts, the tree's real nodes, the accepted tokens each
    drafter had proposed (None when nothing was drafted) and the routing choice (None without)."""

    tokens: List[List[int]]
    accepted: List[int]
    nodes: List[int]
    by_drafter: Optional[List[List[int]]]
    route: Optional[List[int]]


def _judged(group: DraftGroup, free_judged: bool) -> bool:
    """Whether generations judge `group` idle and leave it out (SpeculativeDecoder._judge_idle): a group that runs a
    model; prompt lookup only where `free_judged` (every request samples); not a group kept current at little cost
    that runs none (an n-gram table: left out after two generations where the tuner chose plain steps, say while it
    learned, it missed up to 16 generations where its chains paid: the bench's T = 1 auto row read 1.00x with plain
    steps on 76% of them, against 1.2-1.3x)."""
    if group.free_draft:
        return free_judged
    return not group.kept_current


def _sample_modes(sample: dict, batch: int) -> Tuple[bool, bool, List[bool]]:
    """For a batch of `batch` (>= 1) requests with these settings, from one read of the temperatures: whether
    verification samples (a temperature above 0 for some request), whether every request samples, and per
    request whether it is greedy (temperature 0)."""
    flags = torch.as_tensor(sample["temperature"]).le(0)
    greedy = flags.expand(batch).tolist() if flags.dim() == 0 else flags.tolist()
    return not all(greedy), not any(greedy), greedy


def _select_sample(sample: dict, index: Tensor, batch: int) -> dict:
    """Sampling settings of the requests `index`: [B] tensors re-indexed, scalars kept."""
    return {k: v.index_select(0, index.to(v.device)) if isinstance(v, Tensor) and v.dim() == 1 and v.shape[0] == batch
            else v for k, v in sample.items()}


def _join_sample(a: dict, batch_a: int, b: dict, batch_b: int) -> dict:
    """Sampling settings of two batches one after the other: equal scalars kept, else [B] tensors."""
    out = dict(a)
    for k in ("temperature", "top_k", "top_p"):
        x, y = a[k], b[k]
        if not isinstance(x, Tensor) and not isinstance(y, Tensor) and x == y:
            continue
        dtype = torch.int64 if k == "top_k" else torch.float32
        x = torch.as_tensor(x, dtype=dtype).expand(batch_a) if not isinstance(x, Tensor) or x.dim() == 0 else x
        y = torch.as_tensor(y, dtype=dtype).expand(batch_b) if not isinstance(y, Tensor) or y.dim() == 0 else y
        out[k] = torch.cat([x.to(dtype), y.to(device=x.device, dtype=dtype)])
    return out



#: a started drafter group (one that runs a model) behind by this many tokens (a request's most) when requests join
#: the batch is returned to not started (:meth:`_Pending.park`) rather than brought up to date
PARK_AFTER_TOKENS = 8

#: SpeculativeDecoder.leave_out_after: generations in a row (of one verification mode) in which the tuner chose a
#: drafter group that runs a model on at most one step in IDLE_SHARE (its probes apart) before the next generations
#: leave it out, 1, 2, 4, ... up to LEAVE_OUT_MOST of them between the generations that try it again; a generation of
#: fewer than MIN_VERDICT_STEPS steps judges nothing. On the shipped models the EAGLE heads' upkeep on plain steps
#: (their queued appends, the plans' and coasts' checks) cost the auto rows 2-8% where the tuner never chose them.
#: Prompt lookup is left out only where every request samples: judged greedy too, it was left out after two prompts
#: with few matches and missed the loops of the next ones (merged-budget + lookup auto, fp32, T = 0: 1.10x instead of
#: 1.5x; bench/RESULTS.md)
LEAVE_OUT_AFTER = 2
IDLE_SHARE = 32
LEAVE_OUT_MOST = 16
MIN_VERDICT_STEPS = 8

#: taps serve's SpeculativeDecoder.retire_after: steps a drafter group that runs a model may go unchosen by the
#: tuner (probes apart) before it leaves the batch (the tuner's probes of a kind that could still win come
#: at doubling intervals, 1 to max_probe_interval steps apart: by 32 steps a kind has had five). 32 rather than 128:
#: a server's load of 64 requests, 8 at a time, read 3-4% faster at T = 0 (three replica pairs), no slower mixed
RETIRE_AFTER = 32
#: drafted steps in a row that repeat the last plan unplanned and untimed (SpeculativeDecoder._coasts_draft)
DRAFT_COAST = 3
#: coasting plain steps reported to the tuner as one, at least (SpeculativeDecoder._observe_coast)
COAST_BLOCK = 4
#: a generation drops its finished requests from the batch once they are 1 / DROP_SHARE of its rows
#: (SpeculativeDecoder._drop_finished; None: never)
DROP_SHARE: Optional[int] = 4


class _Pending:
    """Committed tokens (with the target features drafters read) that drafter groups have not appended
    yet: a group that does not draft in a step skips its update, and appends every step it missed in
    one call before it next drafts."""

    def __init__(self, groups: Sequence[DraftGroup], starts: Dict[int, tuple], on_start: Callable[[DraftGroup], None],
                 timer: Callable[[], float] = time.perf_counter, history: bool = True):
        self.queue: Dict[int, list] = {id(g): [] for g in groups}
        self.tokens: Dict[int, int] = {id(g): 0 for g in groups}
        self.spec: Dict[int, object] = {id(g): g.target_features for g in groups}
        self.starts, self.on_start, self.timer = starts, on_start, timer
        #: started groups kept current (DraftGroup.kept_current: prompt lookup, an n-gram table): appended to at
        #: once, never queued
        self.free: Dict[int, DraftGroup] = {}
        #: per started group that runs a model: the start arguments it started from (with steps folded in) and
        #: the steps it appended since, what :meth:`park` returns it to
        self.history: Dict[int, tuple] = {}
        self.consumed: Dict[int, list] = {}
        self.keep_history = history

    def add(self, tokens: Tensor, num_new: Tensor, features: Dict, num_host: List[int], tokens_host) -> None:
        """One step's accepted tokens and bonus [B, K] (num_new [B] real), features {spec: [B, K, H]}."""
        entry = (tokens, num_new, features, num_host, tokens_host)
        most = max(num_host)
        for key in self.queue:
            group = self.free.get(key)
            if group is not None and not self.queue[key]:
                # a started group kept current (prompt lookup, an n-gram table): its append is host
                # bookkeeping of a few microseconds (prompt lookup is asked every plain step whether it has
                # anything to propose)
                group.advance(tokens, num_new, None, num_host, tokens_host)
                continue
            self.queue[key].append(entry)
            self.tokens[key] += most

    def count(self, group: DraftGroup) -> int:
        """Tokens per request (the most of any) the group has yet to append: a group not started yet
        appends its prompts too."""
        return self.tokens[id(group)] + self.start_tokens(group)

    def start_tokens(self, group: DraftGroup) -> int:
        """Of :meth:`count`, the tokens a group not started yet starts on (its prompts, with the steps folded
        into them); 0 for a started group."""
        args = self.starts.get(id(group))
        return 0 if args is None else max(args[-1], default=0)

    def replace(self, old: Sequence[DraftGroup], new: Sequence[Optional[DraftGroup]]) -> None:
        """Groups replaced by their subsets (None: dropped, with the start arguments of one not started)."""
        for a, b in zip(old, new):
            queue, count, spec = self.queue.pop(id(a)), self.tokens.pop(id(a)), self.spec.pop(id(a))
            free = self.free.pop(id(a), None)
            history, consumed = self.history.pop(id(a), None), self.consumed.pop(id(a), None)
            args = self.starts.pop(id(a), None)
            if b is not None:
                self.queue[id(b)], self.tokens[id(b)], self.spec[id(b)] = queue, count, spec
                if args is not None:
                    self.starts[id(b)] = args
                if free is not None:
                    self.free[id(b)] = b
                if history is not None:
                    self.history[id(b)], self.consumed[id(b)] = history, consumed

    def started(self, group: DraftGroup) -> bool:
        return id(group) not in self.starts

    def select_requests(self, keep: List[int], index: Tensor) -> None:
        """Keep only the requests `keep` (positions; `index` the same as a tensor) in every queued step and
        in the start arguments of the groups not started yet."""
        picked: Dict[int, tuple] = {}

        def pick(entry: tuple) -> tuple:
            if id(entry) not in picked:
                tokens, num_new, features, num_host, tokens_host = entry
                picked[id(entry)] = (tokens.index_select(0, index), num_new.index_select(0, index),
                                     {k: f.index_select(0, index) for k, f in features.items()},
                                     [num_host[b] for b in keep], [tokens_host[b] for b in keep])
            return picked[id(entry)]
        joined = []
        for key, entries in self.queue.items():
            if len(entries) > 1:  # one entry to re-index, not one per step missed (a drop per finished request)
                spec = self.spec[key]
                tokens, num_new, features, num_host, tokens_host = _join(entries, spec)
                entries = [(tokens, num_new, {} if spec is None else {spec: features}, num_host, tokens_host)]
                joined.append(entries[0])  # alive until the loop ends: pick() knows entries by id
            self.queue[key] = [pick(e) for e in entries]
            self.tokens[key] = _behind(self.queue[key])
        def select(args: tuple) -> tuple:
            ids, lens, root, hidden, cap, host = args
            return (ids.index_select(0, index), lens.index_select(0, index), root.index_select(0, index),
                    None if hidden is None else hidden.index_select(0, index), cap, [host[b] for b in keep])
        for key, args in self.starts.items():
            self.starts[key] = select(args)
        for key in self.history:
            self.history[key] = select(self._history(key))

    def fold(self, group: DraftGroup) -> None:
        """For a group not started yet: its queued steps folded into its start arguments (each request's
        prompt then holds every token committed before its current root, the hidden states with it), so
        that its requests can change; starting on them is starting on the prompts and appending the steps."""
        entries = self.queue[id(group)]
        if not entries:
            return
        self.starts[id(group)] = _folded(self.starts[id(group)], entries, group.target_features)
        self.queue[id(group)], self.tokens[id(group)] = [], 0

    def park(self, group: DraftGroup) -> bool:
        """Return a started group behind by at least :data:`PARK_AFTER_TOKENS` tokens to not started: its
        state released, its start arguments those it started from with every step since (what it appended
        and what it missed) queued after them. Then a join or a drop re-indexes its arguments (cheap host and
        tensor copies) instead of appending what it missed and starting the new requests' drafter now, and
        it restarts on the whole history when it next drafts (a drafter that seldom pays, probed now and then,
        costs nothing between its drafts). False (nothing done) for a group behind by fewer tokens, a free
        group (prompt lookup: kept current) or one without its history."""
        key = id(group)
        if key not in self.history or self.tokens[key] < PARK_AFTER_TOKENS:
            return False
        group.release()
        self.starts[key] = self.history.pop(key)
        self.queue[key] = self.consumed.pop(key) + self.queue[key]
        self.tokens[key] = _behind(self.queue[key])
        return True

    def append_start(self, group: DraftGroup, args: tuple) -> None:
        """Start arguments of more requests (those of a group spawned for them) after those of `group`, a
        group not started yet whose queue is folded."""
        self.starts[id(group)] = _concat_args(self.starts[id(group)], args)

    def extend_history(self, group: DraftGroup, args: tuple) -> None:
        """A started group's new requests (started on `args` and appended to it, up to date as it is): their
        start arguments after its history, which then holds every step so far (what :meth:`park` restores)."""
        key = id(group)
        if key in self.history:
            self.history[key] = _concat_args(self._history(key), args)

    def _history(self, key: int) -> tuple:
        """A started group's history with the steps it appended since folded in (none left aside)."""
        if self.consumed[key]:
            self.history[key] = _folded(self.history[key], self.consumed[key], self.spec[key])
            self.consumed[key] = []
        return self.history[key]

    def catch_up(self, groups: Sequence[DraftGroup]) -> List[tuple]:
        """Start the groups not started yet, and append what each of `groups` missed; returns (drafters,
        tokens, seconds) per append, and (drafters, tokens, seconds, True) per start."""
        out = []
        for g in groups:
            tokens = self.start_tokens(g)
            args = self.starts.pop(id(g), None)
            if args is not None:
                t0 = self.timer()
                g.start(*args)
                # its start, timed (the tuner prices a group not started by its measured starts)
                out.append((tuple(g.members), tokens, self.timer() - t0, True))
                self.on_start(g)
                if g.kept_current:
                    self.free[id(g)] = g
                elif self.keep_history:
                    self.history[id(g)], self.consumed[id(g)] = args, []
            entries = self.queue[id(g)]
            if not entries:
                continue
            t0 = self.timer()
            tokens, num_new, features, num_host, tokens_host = _join(entries, g.target_features)
            g.advance(tokens, num_new, features, num_host, tokens_host)
            out.append((tuple(g.members), self.tokens[id(g)], self.timer() - t0))
            self.queue[id(g)], self.tokens[id(g)] = [], 0
            consumed = self.consumed.get(id(g))
            if consumed is not None:
                consumed += entries
                if len(consumed) >= 32:  # (a bounded list: folded into the history now and then)
                    self._history(id(g))
        return out


def _join(entries: Sequence[tuple], spec):
    """Steps of (tokens [B, K_i], num_new [B], {spec: features [B, K_i, H]}, host counts, host tokens)
    as one: each row's real tokens (and features) of every step, in order, first in the row."""
    if len(entries) == 1:
        tokens, num_new, features, num_host, tokens_host = entries[0]
        return tokens, num_new, features.get(spec), num_host, tokens_host
    tokens = torch.cat([e[0] for e in entries], 1)
    # each row's order of the columns, its real ones first, from the host counts (each step's num_new as host
    # ints): a few array operations whatever the steps, where a tensor comparison per step cost ~0.4 ms a
    # join of a batch of 8 after ~50 plain steps (at each drop of a server's batch, for every waiting group)
    widths = np.array([e[0].shape[1] for e in entries])
    counts = np.array([e[3] for e in entries]).T  # [B, steps]
    step = np.repeat(np.arange(len(entries)), widths)  # each column's step
    within = np.arange(widths.sum()) - np.repeat(np.cumsum(widths) - widths, widths)
    order = np.argsort(within[None, :] >= counts[:, step], axis=1, kind="stable")
    batch, width = order.shape
    # (as flat rows: a gather along dim 1 with an expanded index took ~0.25 ms for [8, 60, 256] bf16 features)
    flat = torch.from_numpy((order + np.arange(batch)[:, None] * width).reshape(-1)).to(tokens.device)
    features = None
    if spec is not None:
        feats = torch.cat([e[2][spec] for e in entries], 1)
        features = feats.reshape(batch * width, -1).index_select(0, flat).view(batch, width, -1)
    num_host = counts.sum(1).tolist()
    num_new = torch.tensor(num_host, dtype=entries[0][1].dtype, device=entries[0][1].device)
    tokens_host = [[t for e in entries for t in e[4][b][:e[3][b]]] for b in range(len(num_host))]
    return tokens.reshape(-1).index_select(0, flat).view(batch, width), num_new, features, num_host, tokens_host


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


def _trim(tree: Combined, real: Optional[int] = None) -> Combined:
    """The tree without its padding columns past the largest real node count of the batch (`real`, counted
    here when not given; padding nodes come after every real node; a merged tree is padded to room for the
    whole union, which the drafters' overlap rarely fills), so that the target forward and the
    verification read only those."""
    num = tree.tokens.shape[1]
    if real is None:
        real = int((tree.tokens >= 0).sum(1).max())
    if real >= num:
        return tree
    words = (real + 63) // 64
    cut = lambda t: t[:, :real]  # noqa: E731
    return Combined(cut(tree.tokens), cut(tree.parents), cut(tree.depth), tree.tree_mask[:, :real, :words],
                    cut(tree.source), tree.choice)


def _behind(entries: Sequence[tuple]) -> int:
    """Tokens per request (the most of any, step by step) that queued steps `entries` hold."""
    return sum(max(e[3], default=0) for e in entries)


def _folded(args: tuple, entries: Sequence[tuple], spec) -> tuple:
    """Start arguments (ids [B, L], lens [B], root [B], hidden [B, L, H] or None, cap, host lengths) with the
    queued steps `entries` folded in: each request's prompt then holds every token committed before its
    current root (the target features with it)."""
    ids, lens, root, hidden, cap, host = args
    tokens, num_new, features, num_host, tokens_host = _join(entries, spec)
    rows = []
    for b in range(ids.shape[0]):
        m = num_host[b]
        rows.append(torch.cat([ids[b, :host[b]], root[b:b + 1], tokens[b, :m - 1]]) if m else ids[b, :host[b]])
    new_host = [host[b] + num_host[b] for b in range(len(host))]
    new_ids = ids.new_zeros((len(rows), max(new_host)))
    for b, r in enumerate(rows):
        new_ids[b, :r.shape[0]] = r
    new_root = torch.where(num_new > 0, tokens.gather(1, (num_new - 1).clamp_min(0).unsqueeze(1)).squeeze(1), root)
    new_hidden = None
    if hidden is not None:
        new_hidden = hidden.new_zeros((len(rows), max(new_host), hidden.shape[-1]))
        for b in range(len(rows)):
            new_hidden[b, :host[b]] = hidden[b, :host[b]]
            new_hidden[b, host[b]:new_host[b]] = features[b, :num_host[b]]
    return (new_ids, lens + num_new, new_root, new_hidden, cap, new_host)


def _concat_args(a: tuple, b: tuple) -> tuple:
    """Start arguments of two sets of requests as one (b's after a's; rows padded to the longer prompt)."""
    ids, lens, root, hidden, cap, host = a
    ids2, lens2, root2, hidden2, cap2, host2 = b
    width = max(ids.shape[1], ids2.shape[1])
    pad = lambda t: t if t.shape[1] == width else torch.cat(  # noqa: E731
        [t, t.new_zeros((t.shape[0], width - t.shape[1], *t.shape[2:]))], 1)
    return (torch.cat([pad(ids), pad(ids2)]), torch.cat([lens, lens2]), torch.cat([root, root2]),
            None if hidden is None else torch.cat([pad(hidden), pad(hidden2)]), max(cap, cap2), host + host2)


def _module_digest(module: nn.Module) -> dict:
    """A module's class, config (when it has one) and a digest of its weights: each parameter's name, shape
    and first values (what tells a model from another of the same shape without reading every weight)."""
    import hashlib
    import json

    h = hashlib.sha256()
    for name, t in module.named_parameters():
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(t.detach().reshape(-1)[:64].float().cpu().numpy().tobytes())
    config = getattr(module, "config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else {
        k: v for k, v in vars(module).items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}
    return {"class": type(module).__name__, "config": hashlib.sha256(
        json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16], "weights": h.hexdigest()[:16]}
