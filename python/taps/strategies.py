"""How several drafters' proposals become the one tree the target verifies.

Every strategy turns the EAGLE-2 candidates of the drafters that draft this step into a batch of trees
(``taps_ops`` tree format, [B, N]) plus a per-node ``source`` bitmask (bit t: drafter t proposed it).
Routing and budgeting use only the drafts and past acceptance, never the current target logits.

Strategies are classes registered under their names (:func:`register_strategy`, :data:`STRATEGIES`);
:func:`make_strategy` builds one by name. They receive the candidates of all drafting drafters stacked
(:class:`Candidates`, [T, B, M]: one tree build for all of them) and return a :class:`Combined` tree:

- ``single``: one drafter's tree of ``budget`` nodes.
- ``average``: the weight-space mean of drafters of one shape (built by the decoder with
  :func:`taps.drafters.average_drafters`), then ``single``.
- ``route-confidence`` / ``route-entropy``: every drafter builds its tree; per request the tree with the
  highest mean node confidence (mean exp(cumulative log-prob) over its draft nodes), or the lowest mean
  entropy of the drafter distributions read while expanding it, is verified.
- ``route-confidence-prompt`` / ``route-entropy-prompt``: the same signal routes per step for the first
  ``route_steps`` steps of a request and is summed; then the request keeps the best drafter for good,
  and drafters no request uses stop drafting.
- ``merged``: the trie union of the full trees (``taps_ops.merge_trees``, up to T * (budget - 1) + 1 nodes).
- ``merged-budget``: that union cut to ``budget`` nodes by score.
- ``adaptive``: the ``budget - 1`` draft nodes split between drafters in proportion to their running
  accepted tokens on this request (plus a prior; at least one node each): each drafter's best nodes of
  its share are reserved (:func:`reserve_nodes`), the union is cut to ``budget`` nodes keeping the
  reserved ones first, and the room their overlap leaves is filled with the best other nodes by score.
- ``autoregressive``: no drafter; the tree is the root alone (the baseline through the same loop).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Type, Union

import torch
from torch import Tensor

import taps_ops

from .expansion import DraftCandidates

__all__ = ["STRATEGIES", "Candidates", "Combined", "Strategy", "make_strategy", "register_strategy", "strategy_class",
           "strategy_names", "tree_confidence", "allocate_budget", "reserve_nodes", "root_tree", "sampled_tree"]


class Candidates(NamedTuple):
    """The candidates of the T drafters that drafted this step, stacked: scores, tokens, parents
    [T, B, M], entropy [T, B]; ``drafters[t]`` is the index of slab t's drafter."""

    scores: Tensor
    tokens: Tensor
    parents: Tensor
    entropy: Tensor
    drafters: Tuple[int, ...]

    @staticmethod
    def stack(cands: Mapping[int, DraftCandidates]) -> "Candidates":
        """From per-drafter candidates {drafter index: DraftCandidates [B, M]} (in index order)."""
        order = tuple(sorted(cands))
        return Candidates(*(torch.stack([getattr(cands[t], f) for t in order]) for f in DraftCandidates._fields),
                          order)


class Combined(NamedTuple):
    """The tree to verify ([B, N]): tokens, parents, depth, tree_mask [B, N, W], source (bitmask of
    drafters per node, 0 for the root and padding), choice ([B] routed drafter, or None)."""

    tokens: Tensor
    parents: Tensor
    depth: Tensor
    tree_mask: Tensor
    source: Tensor
    choice: Optional[Tensor]


def tree_confidence(tree) -> Tensor:
    """[..., B] mean exp(cumulative log-prob) over each tree's draft nodes (root and padding excluded)."""
    real = tree.tokens >= 0
    real[..., 0] = False
    conf = torch.where(real, tree.scores.exp(), torch.zeros_like(tree.scores)).sum(-1)
    return conf / real.sum(-1).clamp_min(1)


def _build(cands: Candidates, num_nodes: int, root: Tensor, stacked: bool = True):
    """One build_tree over every drafter's candidates: Tree fields [T, B, num_nodes] (``stacked``), or
    [T * B, num_nodes]. The engine's own candidates need no data checks (and on CUDA they would cost a
    device sync)."""
    t, b, m = cands.scores.shape
    tree = taps_ops.build_tree(cands.scores.reshape(t * b, m), cands.tokens.reshape(t * b, m),
                               cands.parents.reshape(t * b, m), num_nodes,
                               root_tokens=torch.cat([root] * t) if t > 1 else root, validate=root.device.type == "cpu")
    return type(tree)(*(f.view(t, b, *f.shape[1:]) for f in tree)) if stacked else tree


def _one_tree(cands: Candidates, budget: int, root: Tensor) -> Combined:
    """The tree of one drafter's candidates ([1, B, M]): build_tree's [B, budget] as it is, the draft nodes'
    source the drafter's bit."""
    tree = _build(cands, budget, root, stacked=False)
    t = cands.drafters[0]
    source = (tree.candidate_index >= 0).long()  # the draft nodes (the root's and padding's index is -1)
    return Combined(tree.tokens, tree.parents, tree.depth, tree.tree_mask, source << t if t else source, None)


def sampled_tree(cands: Candidates, root: Tensor, depth: Optional[int] = None) -> Combined:
    """The tree of drawn candidates (:func:`taps.expansion.expand_sampled`, one slab [1, B, M], drawn from
    the drafter ``cands.drafters`` or from the mean of theirs: each node's source holds all their bits):
    every candidate kept, node 1 + m = candidate m, so siblings stay in the order they were drawn (what
    recursive rejection sampling needs: a tree that kept or ordered draws by their probability would
    verify a biased sample). One ``build_tree`` with scores falling with the candidate index does it.

    ``depth``: the draft's levels, where every candidate is a real draw in the drawn layout (level l's chain
    c is candidate (l - 1) * width + c, its parent the chain's previous candidate, width = M / depth: what
    ``expand_sampled`` and ``taps_ops.ngram_table_draw`` return, with no padding): the tree is then the roots
    and candidates side by side on that layout's parents, depths, mask and source (:func:`_drawn_fields`,
    made once per shape), with no ``build_tree``."""
    t, b, m = cands.scores.shape
    if t != 1:
        raise ValueError(f"sampled_tree: one slab of drawn candidates, got {t}")
    bits = sum(1 << d for d in set(cands.drafters))
    if depth is not None:
        if depth < 1 or m % depth:
            raise ValueError(f"sampled_tree: {m} candidates are not {depth} levels of chains")
        parents, depths, mask, source = _drawn_fields(b, m // depth, depth, bits, root.device)
        return Combined(torch.cat([root.view(b, 1), cands.tokens[0]], 1), parents, depths, mask, source, None)
    order = -torch.arange(m, dtype=torch.float32, device=root.device).expand(b, m)
    tree = taps_ops.build_tree(order, cands.tokens[0], cands.parents[0], m + 1, root_tokens=root,
                               validate=root.device.type == "cpu")
    source = (tree.candidate_index >= 0).long() * bits
    return Combined(tree.tokens, tree.parents, tree.depth, tree.tree_mask, source, None)


_DRAWN_FIELDS: Dict[tuple, Tuple[Tensor, Tensor, Tensor, Tensor]] = {}


def _drawn_fields(batch: int, width: int, depth: int, bits: int, device) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """parents, depth, tree_mask and source [B, 1 + width * depth] of a drawn tree (`width` chains of `depth`
    draws under each root): the same for every draft of that shape, so built once (by ``build_tree`` itself, on
    the layout's parents) and shared: read them, never write them (a drawn step's tree cost ~50 us of small ops
    on the CPU)."""
    def make():
        m = width * depth
        index = torch.arange(m, device=device)
        parents = torch.where(index < width, -1, index - width).expand(batch, m)
        zeros = torch.zeros((batch, m), dtype=torch.int64, device=device)
        tree = taps_ops.build_tree(-index.float().expand(batch, m), zeros, parents, m + 1,
                                   root_tokens=zeros[:, 0], validate=True)
        return tree.parents, tree.depth, tree.tree_mask, (tree.candidate_index >= 0).long() * bits
    return _shared(_DRAWN_FIELDS, (batch, width, depth, bits, device), make)


def _shared(cache: dict, key: tuple, make: Callable[[], tuple]) -> tuple:
    """``cache[key]``, made by `make` when missing (at most 256 kept: the cache is emptied past that)."""
    fields = cache.get(key)
    if fields is None:
        if len(cache) > 256:
            cache.clear()
        fields = cache[key] = make()
    return fields


def _draft_nodes(tokens: Tensor) -> Tensor:
    real = tokens >= 0
    real[..., 0] = False
    return real


def allocate_budget(weights: Tensor, nodes: int) -> Tensor:
    """Split `nodes` draft nodes per request in proportion to weights [B, T] (>= 0), at least one node
    per drafter when nodes >= T; largest remainders get the leftovers. Returns [B, T] int64 summing to
    `nodes`."""
    batch, num = weights.shape
    base = 1 if nodes >= num else 0
    free = nodes - base * num
    share = weights.double() / weights.double().sum(1, keepdim=True).clamp_min(1e-30)
    exact = share * free
    alloc = exact.floor().long()
    left = free - alloc.sum(1, keepdim=True)                            # [B, 1] in [0, T)
    order = (exact - alloc).argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(num, device=weights.device).expand(batch, num))
    return alloc + (rank < left).long() + base


#: added to the scores of reserved nodes; cumulative log-probs of real drafts stay far above -RESERVE
RESERVE = 1000.0


def reserve_nodes(scores: Tensor, tokens: Tensor, alloc: Tensor) -> Tensor:
    """Scores [B, T, N] of T trees with each tree's root and best ``alloc[b, t]`` draft nodes (by score,
    ties: lower index first) raised by :data:`RESERVE`, so that ``merge_trees`` cut to a budget keeps
    every reserved node first and fills what the overlap of the reserved sets leaves free with the best
    of the rest. Scores never increase along a path, so a reserved set is closed under ancestors."""
    real = tokens >= 0
    key = torch.where(real, scores, torch.full_like(scores, float("-inf")))
    key[..., 0] = float("inf")  # the root first
    order = key.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    n = order.shape[-1]
    rank.scatter_(-1, order, torch.arange(n, device=order.device).expand_as(order))
    keep = (rank <= alloc.unsqueeze(-1)) & real
    return scores + keep.to(scores.dtype) * RESERVE


_ROOT_FIELDS: Dict[tuple, Tuple[Tensor, Tensor, Tensor]] = {}


def root_tree(root: Tensor) -> Combined:
    """The tree of the roots [B] alone (a plain one-token step). Its parents, depth, mask and source are
    constants shared by every call of the batch size and device (made once: four tensors a step cost about
    12 us): read them, never write them."""
    batch = root.shape[0]
    def make():
        ones = torch.ones((batch, 1), dtype=torch.int64, device=root.device)
        return -ones, ones * 0, ones.view(batch, 1, 1)
    parents, zeros, mask = _shared(_ROOT_FIELDS, (batch, root.device), make)
    return Combined(root.view(batch, 1), parents, zeros, mask, zeros, None)


# ---------------------------------------------------------------------------------------------------
# The strategies
# ---------------------------------------------------------------------------------------------------

_REGISTRY: Dict[str, Type["Strategy"]] = {}


def register_strategy(*names: str) -> Callable[[Type["Strategy"]], Type["Strategy"]]:
    """Class decorator: make a :class:`Strategy` subclass available to :func:`make_strategy` (and to
    ``SpeculativeDecoder(strategy=...)``) under each of `names`."""
    def wrap(cls):
        for name in names:
            _REGISTRY[name] = cls
        return cls
    return wrap


class Strategy:
    """Base class: `combine` the drafters' candidates each step, `observe` what was accepted.

    Args:
        name: the registered name it was made under.
        num_drafters: T.
        budget: N, the node budget of one drafter's tree (root included).
        route_steps, prior: options of the routing and adaptive strategies.
    """

    #: whether combine reads the candidates' entropy (the expansion computes it only then)
    needs_entropy = False
    #: whether a step where one drafter drafts may verify its sampled candidates whole
    #: (:func:`sampled_tree`) instead of combining them: true where combining one drafter's candidates
    #: changes no state of the strategy's (the routing strategies' signals would be left out)
    takes_sampled = True
    min_drafters, max_drafters = 1, 63

    @classmethod
    def prepare_drafters(cls, drafters: List, target) -> List:
        """The drafters the strategy drafts with, from those the decoder was given (bound to `target`
        afterwards); checkpoint averaging replaces them by their weight-space mean. Default: unchanged."""
        return drafters

    def __init__(self, name: str, num_drafters: int, budget: int, route_steps: int = 3, prior: float = 1.0):
        self.name = name
        self.num_drafters = num_drafters
        self.budget = budget
        self.route_steps = route_steps
        self.prior = prior
        self._alive: List[int] = list(range(num_drafters))
        self.accepted: Optional[Tensor] = None

    @property
    def accepted(self) -> Optional[Tensor]:
        """[B, T] float64: the draft tokens of each drafter's accepted so far per request (the counts
        :meth:`observe_drafter` queued on the host added first)."""
        if self._queued:
            self._fold()
        return self._accepted

    @accepted.setter
    def accepted(self, value: Optional[Tensor]) -> None:
        # (a change of the tally reads it first, folding what was queued: what is queued here is dropped)
        self._accepted, self._queued = value, []

    def _fold(self) -> None:
        queued, self._queued = self._queued, []
        rows = [[0.0] * self.num_drafters for _ in queued[0][1]]
        for drafter, counts in queued:
            for row, n in zip(rows, counts):
                row[drafter] += n
        self._accepted += torch.tensor(rows, dtype=self._accepted.dtype, device=self._accepted.device)

    #: per-request state, [B, ...] tensors (made by :meth:`reset`), that requests joining or leaving a
    #: running batch carry (:meth:`add_requests`, :meth:`select_requests`)
    _row_state: Tuple[str, ...] = ("accepted",)

    def reset(self, batch: int, device: torch.device) -> None:
        """Start a new batch of requests."""
        self._alive = list(range(self.num_drafters))
        self.accepted = torch.zeros((batch, self.num_drafters), dtype=torch.float64, device=device)

    def add_requests(self, count: int, device: torch.device) -> None:
        """`count` new requests after the running ones, in the state :meth:`reset` gives a request; every
        drafter drafts again."""
        fresh = copy.copy(self)
        fresh.reset(count, device)
        for name in self._row_state:
            setattr(self, name, torch.cat([getattr(self, name), getattr(fresh, name)]))
        self._alive = list(range(self.num_drafters))

    def select_requests(self, index: Tensor) -> None:
        """Keep only the requests `index` ([B'] int64 positions, in that order)."""
        for name in self._row_state:
            value = getattr(self, name)
            setattr(self, name, value.index_select(0, index.to(value.device)))

    def alive(self) -> List[int]:
        """Drafters that draft (and must be kept up to date) from now on; the list only shrinks."""
        return list(self._alive)

    @property
    def num_nodes(self) -> int:
        """N of the verified tree."""
        return self.budget

    def combine(self, cands: Union[Candidates, Mapping[int, DraftCandidates]], root: Tensor) -> Combined:
        """Candidates of the alive drafters (stacked, or {t: DraftCandidates [B, M]}) and root [B] ->
        Combined."""
        if not isinstance(cands, Candidates):
            cands = Candidates.stack(cands)
        return self._combine(cands, root)

    def _combine(self, cands: Candidates, root: Tensor) -> Combined:
        raise NotImplementedError

    @contextlib.contextmanager
    def step_budget(self, budget: Optional[int]) -> Iterator[None]:
        """Combine with a node budget of `budget` (at most the strategy's own) inside the block; None:
        the strategy's own."""
        own = self.budget
        if budget is not None:
            self.budget = min(int(budget), own)
        try:
            yield
        finally:
            self.budget = own

    def observe(self, accepted_by_drafter: Tensor) -> None:
        """Accepted draft tokens each drafter had proposed in the last step, [B, T]."""
        self.accepted += accepted_by_drafter.to(self.accepted.dtype)

    def observe_drafter(self, drafter: int, accepted: Sequence[int]) -> None:
        """The same for a step whose every node drafter `drafter` proposed: each request's accepted draft
        tokens (host ints, [B]); the other drafters had none accepted. Queued on the host and added to
        :attr:`accepted` when it is next read (or after 64 steps): a step's add cost ~15 us of small ops on the
        CPU, where most strategies never read the tally."""
        self._queued.append((drafter, list(accepted)))
        if len(self._queued) >= 64:
            self._fold()


@register_strategy("single")
class Single(Strategy):
    """One drafter's tree."""

    def __init__(self, name, num_drafters, budget, **options):
        if num_drafters != 1:
            raise ValueError(f"strategy {name!r} takes exactly one drafter, got {num_drafters}")
        super().__init__(name, num_drafters, budget, **options)

    def _combine(self, cands, root):
        return _one_tree(cands, self.budget, root)


@register_strategy("average")
class Average(Single):
    """Checkpoint averaging: the weight-space mean of the drafters (:func:`taps.drafters.average_drafters`)
    drafts alone, as ``single``."""

    @classmethod
    def prepare_drafters(cls, drafters, target):
        if not drafters:
            raise ValueError("strategy 'average' needs at least one drafter (got an empty list)")
        from .drafters import average_drafters

        for d in drafters:
            d.bind(target)
        return [average_drafters(drafters)] if len(drafters) > 1 else drafters


@register_strategy("route-confidence", "route-entropy", "route-confidence-prompt", "route-entropy-prompt")
class Route(Strategy):
    """Per request, the tree of the drafter with the best signal (confidence, or low entropy); the
    ``-prompt`` variants decide once per request after ``route_steps`` steps."""

    takes_sampled = False

    def __init__(self, name, num_drafters, budget, **options):
        super().__init__(name, num_drafters, budget, **options)
        self.by_entropy = "entropy" in name
        self.needs_entropy = self.by_entropy
        self.per_prompt = name.endswith("-prompt")

    #: per request: the summed signal of each drafter, steps observed and the decision (-1: none yet)
    _row_state = Strategy._row_state + ("signal_sum", "steps", "fixed")

    def reset(self, batch, device):
        super().reset(batch, device)
        self.signal_sum = torch.zeros((batch, self.num_drafters), dtype=torch.float64, device=device)
        self.steps = torch.zeros(batch, dtype=torch.int64, device=device)
        self.fixed = torch.full((batch,), -1, dtype=torch.int64, device=device)
        self._undecided = batch if self.per_prompt else 0  # requests without a decision (on the host)
        self._observed = [0] * batch  # steps each request has observed (host copy of `steps`)

    def add_requests(self, count, device):
        super().add_requests(count, device)
        if self.per_prompt:
            self._undecided += count
        self._observed += [0] * count

    def select_requests(self, index):
        super().select_requests(index)
        self._observed = [self._observed[i] for i in index.tolist()]
        self._undecided = sum(n < self.route_steps for n in self._observed) if self.per_prompt else 0

    def _combine(self, cands, root):
        order = list(cands.drafters)
        trees = _build(cands, self.budget, root)                       # [T, B, N]
        device = root.device
        if self.per_prompt and not self._undecided:  # every request has decided
            choice = self.fixed
        else:
            sig = (-cands.entropy if self.by_entropy else tree_confidence(trees)).t()  # [B, T]
            choice = torch.tensor(order, device=device)[sig.argmax(1)]  # ties: the lower drafter index
        if self._undecided:
            # every drafter is alive while a request is undecided; each decides after route_steps steps
            # of its own, and a request decided before this step keeps its drafter
            observe = self.fixed < 0
            choice = torch.where(observe, choice, self.fixed)
            self.signal_sum[:, order] += sig.double() * observe.unsqueeze(1)
            self.steps += observe
            self._observed = [n + (n < self.route_steps) for n in self._observed]
            self.fixed = torch.where(observe & (self.steps >= self.route_steps), self.signal_sum.argmax(1), self.fixed)
            self._undecided = sum(n < self.route_steps for n in self._observed)
            if not self._undecided:
                self._alive = sorted(set(self.fixed.tolist()))
        lookup = torch.zeros(self.num_drafters, dtype=torch.int64, device=device)
        lookup[torch.tensor(order, device=device)] = torch.arange(len(order), device=device)
        idx = lookup[choice]  # position of the chosen drafter among those that drafted
        rows = torch.arange(root.shape[0], device=device)
        tokens = trees.tokens[idx, rows]
        return Combined(tokens, trees.parents[idx, rows], trees.depth[idx, rows], trees.tree_mask[idx, rows],
                        _draft_nodes(tokens).long() << choice.unsqueeze(1), choice)


@register_strategy("merged")
class Merged(Strategy):
    """The trie union of every drafter's tree (``taps_ops.merge_trees``)."""

    #: cut the union to `budget` nodes (False: room for the whole union)
    cut = False

    @property
    def num_nodes(self) -> int:
        return self.budget if self.cut else self.num_drafters * (self.budget - 1) + 1

    def _scores(self, cands: Candidates, tokens: Tensor, scores: Tensor) -> Tensor:
        return scores

    def _combine(self, cands, root):
        if cands.tokens.shape[0] == 1 and type(self)._scores is Merged._scores:
            # one drafter drafted (a tuner's step of one group, prompt lookup alone): the trie union of one
            # tree is that tree, node for node, when its siblings are distinct, as every drafter's are (top-k
            # tokens of a distribution, a lookup's trie of its continuations); no merge_trees, transposes or
            # source remapping (about 50 us a step at batch 8)
            return _one_tree(cands, self.budget, root)
        trees = _build(cands, self.budget, root)
        per_request = lambda f: f.transpose(0, 1).contiguous()  # noqa: E731  [T, B, N] -> [B, T, N]
        tokens = per_request(trees.tokens)
        scores = self._scores(cands, tokens, per_request(trees.scores))
        merged = taps_ops.merge_trees(tokens, per_request(trees.parents), scores,
                                      num_nodes=self.budget if self.cut else None, validate=root.device.type == "cpu")
        # merge_trees numbers its trees 0..T'-1; map bits back to drafter indices
        source = merged.source
        order = list(cands.drafters)
        if order != list(range(len(order))):
            remapped = torch.zeros_like(source)
            for i, t in enumerate(order):
                remapped |= ((source >> i) & 1) << t
            source = remapped
        source = source.masked_fill(~_draft_nodes(merged.tokens), 0)
        return Combined(merged.tokens, merged.parents, merged.depth, merged.tree_mask, source, None)


@register_strategy("merged-budget")
class MergedBudget(Merged):
    """The union cut to one drafter's budget by score."""

    cut = True


@register_strategy("adaptive")
class Adaptive(Merged):
    """The budget split by running acceptance, each drafter's share reserved (see the module docstring)."""

    cut = True

    def _scores(self, cands, tokens, scores):
        alloc = allocate_budget(self.accepted[:, list(cands.drafters)] + self.prior, self.budget - 1)  # [B, T]
        return reserve_nodes(scores, tokens, alloc)


@register_strategy("autoregressive")
class Autoregressive(Strategy):
    """No drafter: the tree is the root alone."""

    min_drafters, max_drafters = 0, 0

    @property
    def num_nodes(self) -> int:
        return 1

    def _combine(self, cands, root):
        return root_tree(root)

    def combine(self, cands, root):
        return self._combine(None, root)


#: the built-in strategy names (:func:`strategy_names` also lists the ones registered later)
STRATEGIES: Tuple[str, ...] = tuple(_REGISTRY)


def strategy_names() -> Tuple[str, ...]:
    """Every registered strategy name, the built-in ones and those registered since with
    :func:`register_strategy`."""
    return tuple(_REGISTRY)


def strategy_class(name: str) -> Type[Strategy]:
    """The class registered as `name`; ValueError for an unknown name."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(_REGISTRY)}")
    return cls


def make_strategy(name: str, num_drafters: int, budget: int, **options) -> Strategy:
    """The strategy registered as `name` (see :func:`strategy_names`); raises ValueError for unknown names
    or a drafter count the strategy cannot use."""
    cls = strategy_class(name)
    if num_drafters > cls.max_drafters:
        if cls.max_drafters == 0:
            raise ValueError(f"strategy {name!r} uses no drafter; pass drafters=[]")
        raise ValueError(f"at most {cls.max_drafters} drafters (the source bitmask is int64)")
    if num_drafters < cls.min_drafters:
        raise ValueError(f"strategy {name!r} needs at least one drafter (got an empty list); use "
                         "strategy='autoregressive' for plain decoding")
    if budget < 1:
        raise ValueError(f"budget must be >= 1 node, got {budget}")
    return cls(name, num_drafters, budget, **options)
