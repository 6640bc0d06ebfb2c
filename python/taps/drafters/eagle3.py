"""EAGLE-3 drafters: the head that reads the target's features at three depths and drafts over its own
reduced vocabulary.

The head (Li et al., EAGLE-3; the layout SafeAILab/EAGLE, SGLang and vLLM load):

- ``fc`` (no bias) fuses the target's hidden states taken at ``k`` depths (the inputs of target layers
  :attr:`Eagle3Drafter.feature_layers`, concatenated low to high, ``k * Ht`` wide) into one H-wide
  feature. At later draft steps the head feeds back its own output (H wide) and ``fc`` is skipped.
- ``midlayer``: one decoder layer whose attention reads ``cat(input_layernorm(embed(token)),
  hidden_norm(h))`` (q/k/v projections from 2H) while the residual stream is h
  (:func:`taps.lean.eagle3_layer`).
- ``norm`` and the head's own ``lm_head`` over a draft vocabulary of ``Vd`` tokens; ``d2t`` (int64
  [Vd]: target id = draft id + d2t[draft id]) and ``t2d`` (bool [V]: the target ids in the draft
  vocabulary) map it to the target's ids, so trees always hold target token ids and verification is
  unchanged. The fed-back feature is the layer's output before ``norm``.
- the token embedding is the target's (frozen, not saved), unless the checkpoint carries its own
  ``embed_tokens.weight``.

Alignment is EAGLE-2's: committed entry t pairs token t + 1 with the fused target features at position
t, and the tree is grown by the shared EAGLE-2 expansion (:mod:`taps.expansion`).

Which target layers. The reference reads the inputs of layers 2, N // 2 and N - 3 of an N-layer target
(low, middle, high). Those coincide or go out of order below 7 layers, so :func:`feature_layers` takes
them when they are strictly increasing and otherwise layers 1, N // 2 and N - 1 (N = 4 .. 6; the
shipped 4-layer target: 1, 2, 3), and every layer's input for N <= 3. A checkpoint may name its layers
in config.json (``eagle_aux_hidden_state_layer_ids``, at the top level or under ``eagle_config``, as
SGLang / vLLM configs do); the rule is used when it does not.

Files: ``config.json`` (Llama fields plus ``draft_vocab_size``, and ``target_hidden_size`` when the
head's width differs from the target's) and ``model.safetensors`` or ``pytorch_model.bin`` with the
keys ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight`` [, ``d2t``, ``t2d``,
``embed_tokens.weight``], unprefixed. :meth:`taps.EagleDrafter.from_pretrained` recognises the layout
by these names and returns an :class:`Eagle3Drafter` (so does :func:`taps.drafters.load_drafter`).

Heads of one shape and one draft vocabulary bound to one target run as one batched group in the
decoding loop (:class:`_Eagle3Group`), beside groups of other kinds (EAGLE-2 heads, small LMs).
"""

from __future__ import annotations

import copy
from typing import Collection, Dict, Hashable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..lean import Attend, LayerWeights, Linear, Norm, RopeTable, as_dtype, eagle3_layer
from .base import DraftGroup, Drafter, SoloMixin, target_hidden_size, target_vocab_size
from .checkpoint import config_from_dict, read_checkpoint, write_checkpoint
from .heads import FeatureHeadGroup, head_key

__all__ = ["Eagle3Drafter", "Eagle3Weights", "feature_layers", "is_eagle3_state", "vocab_mapping"]

#: config.json keys that may name the target layers an EAGLE-3 head reads
_LAYER_KEYS = ("eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids")


def feature_layers(num_layers: int) -> Tuple[int, ...]:
    """The target layers (by index; the head reads their inputs) an EAGLE-3 head uses for an N-layer
    target: (2, N // 2, N - 3) when strictly increasing (N >= 7), else (1, N // 2, N - 1) for N = 4 .. 6,
    else every layer (N <= 3)."""
    n = int(num_layers)
    if n < 1:
        raise ValueError(f"feature_layers: the target needs at least one layer, got {n}")
    low, mid, high = 2, n // 2, n - 3
    if low < mid < high:
        return (low, mid, high)
    if n >= 4:
        return (1, n // 2, n - 1)
    return tuple(range(n))


def is_eagle3_state(state: Collection[str]) -> bool:
    """Whether checkpoint weight names (a state dict or its keys, prefix ``model.`` removed) are an EAGLE-3
    head's."""
    return any(k.startswith("midlayer.") or k.startswith("layers.0.hidden_norm") for k in state) or "d2t" in state


def vocab_mapping(token_ids: Tensor, vocab_size: int) -> Tuple[Tensor, Tensor]:
    """(d2t int64 [Vd], t2d bool [V]) for a draft vocabulary of distinct target ids (any order; the draft
    ids follow increasing target id, as the reference builds them)."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten().sort().values
    if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size or bool((ids[1:] == ids[:-1]).any()):
        raise ValueError(f"vocab_mapping: need distinct ids in [0, {vocab_size})")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


class _Eagle3Attention(nn.Module):
    """q/k/v over the 2H-wide [normed embedding, normed hidden], o back to H."""

    def __init__(self, config, bias: bool):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        self.q_proj = nn.Linear(2 * hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)


class _Eagle3Layer(nn.Module):
    """The ``midlayer``: attention, MLP and three RMSNorms (embedding, hidden, post-attention)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.self_attn = _Eagle3Attention(config, bool(getattr(config, "attention_bias", False)))
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)


class Eagle3Weights:
    """The arithmetic of G EAGLE-3 heads of one shape (weights stacked when G > 1, see
    :class:`taps.lean.Linear`), shared by inference (:class:`_Eagle3Group`, packed, no autograd) and
    training (:mod:`taps.train.eagle3`, one head, the parameters themselves, autograd).

    Args:
        drafters: Eagle3Drafter modules of one shape.
        rows: None, or the draft ids (head rows) to compute logits for (a restricted vocabulary).
    """

    def __init__(self, drafters: Sequence["Eagle3Drafter"], rows: Optional[Tensor] = None):
        first = drafters[0]
        self.fc = Linear([d.fc.weight for d in drafters], [None] * len(drafters))
        self.layer = LayerWeights([d.midlayer for d in drafters])
        eps = float(first.midlayer.hidden_norm.variance_epsilon)
        self.hidden_norm = Norm([d.midlayer.hidden_norm.weight for d in drafters], eps)
        self.norm = Norm([d.norm.weight for d in drafters], float(first.norm.variance_epsilon))
        heads = [d.lm_head.weight if rows is None else d.lm_head.weight.detach()[rows.to(d.lm_head.weight.device)]
                 for d in drafters]
        self.head = Linear(heads, [None] * len(drafters))
        self.fused_width = int(first.fc.weight.shape[1])

    def pack(self) -> "Eagle3Weights":
        """Pre-pack the projections for the CPU (inference only, :meth:`taps.lean.Linear.pack`)."""
        self.fc.pack().choose_small_layout()
        self.layer.pack()
        self.head.pack().choose_small_layout(stacked=False)
        return self

    def hidden(self, emb: Tensor, h: Tensor, fused: bool, cos: Tensor, sin: Tensor, attend: Attend, rows: int,
               tokens: int) -> Tensor:
        """The head's output features [G, rows * tokens, H] (before ``norm``: what is fed back).

        emb: [G, rows * tokens, H] token embeddings; h: the fused target features [G, rows * tokens, k * Ht]
        (``fused``) or the head's own earlier outputs [G, rows * tokens, H]; cos / sin / attend as
        :func:`taps.lean.decoder_layer` takes them."""
        if fused:
            h = self.fc(h)
        return eagle3_layer(self.layer, self.hidden_norm, 0, emb, h, cos, sin, attend, rows, tokens)

    def logits(self, x: Tensor) -> Tensor:
        """Draft-vocabulary logits [G, R, Vd] of output features [G, R, H]."""
        return self.head(self.norm(x))


class Eagle3Drafter(SoloMixin, Drafter):
    """An EAGLE-3 head (see the module docstring).

    Args:
        config: a ``LlamaConfig``: the head's widths and heads, ``vocab_size`` = the target's vocabulary,
            ``draft_vocab_size`` (default vocab_size), optionally ``target_hidden_size`` (default
            hidden_size) and the feature layers (``eagle_aux_hidden_state_layer_ids``).
        num_features: target layers fused by ``fc`` (default: the configured layers' count, else 3).
        own_embedding: give the head its own ``embed_tokens`` (needed when its width differs from the
            target's); by default it reads the target's embeddings after :meth:`bind`.

    The parameters it owns (and saves) are ``fc.weight``, ``midlayer.*``, ``norm.weight``,
    ``lm_head.weight`` [, ``embed_tokens.weight``], and the buffers ``d2t`` / ``t2d``.
    """

    needs_hidden = True

    def __init__(self, config, *, num_features: Optional[int] = None, own_embedding: bool = False):
        super().__init__()
        self.config = config
        hidden = int(config.hidden_size)
        vocab = int(config.vocab_size)
        draft = int(getattr(config, "draft_vocab_size", None) or vocab)
        if draft > vocab:
            raise ValueError(f"Eagle3Drafter: draft_vocab_size {draft} exceeds vocab_size {vocab}")
        config.draft_vocab_size = draft
        self.target_hidden = int(getattr(config, "target_hidden_size", None) or hidden)
        configured = _configured_layers(config)
        if num_features is None:
            num_features = len(configured) if configured else 3
        if configured and len(configured) != num_features:
            raise ValueError(f"Eagle3Drafter: {num_features} features but the config names layers {configured}")
        self.fc = nn.Linear(num_features * self.target_hidden, hidden, bias=False)
        self.midlayer = _Eagle3Layer(config)
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
        self.norm = LlamaRMSNorm(hidden, eps=getattr(config, "rms_norm_eps", 1e-6))
        self.lm_head = nn.Linear(hidden, draft, bias=False)
        self.register_buffer("d2t", torch.zeros(draft, dtype=torch.int64))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[:draft] = True
        self.register_buffer("t2d", t2d)
        if own_embedding:
            self.embed_tokens = nn.Embedding(vocab, hidden)
        # In a tuple: not a submodule, so .to(dtype) keeps its inverse frequencies in float32.
        self._rotary = (LlamaRotaryEmbedding(config=config),)
        self._bound: tuple = ()  # (the target's input embedding,)
        self._layers: Optional[Tuple[int, ...]] = tuple(configured) if configured else None

    # -- vocabulary --------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    def set_vocab_mapping(self, d2t: Tensor, t2d: Optional[Tensor] = None) -> "Eagle3Drafter":
        """Set the draft-to-target map (``d2t [Vd]``; ``t2d [V]`` is derived when not given, and checked
        against d2t when given). Returns self."""
        d2t = torch.as_tensor(d2t).to(torch.int64).flatten().cpu()
        vd, v = self.draft_vocab_size, self.vocab_size
        if d2t.numel() != vd:
            raise ValueError(f"Eagle3Drafter: d2t has {d2t.numel()} entries, the draft vocabulary {vd}")
        ids = torch.arange(vd) + d2t
        if int(ids.min()) < 0 or int(ids.max()) >= v or ids.unique().numel() != vd:
            raise ValueError(f"Eagle3Drafter: d2t maps the draft vocabulary to ids outside [0, {v}) or to "
                             "repeated ids")
        derived = torch.zeros(v, dtype=torch.bool)
        derived[ids] = True
        if t2d is not None:
            t2d = torch.as_tensor(t2d).flatten().cpu()
            if t2d.numel() != v:
                raise ValueError(f"Eagle3Drafter: t2d has {t2d.numel()} entries, the vocabulary {v}")
            if not torch.equal(t2d.bool(), derived):
                raise ValueError("Eagle3Drafter: t2d does not mark exactly the target ids d2t maps to")
        self.d2t.copy_(d2t.to(self.d2t.device))
        self.t2d.copy_(derived.to(self.t2d.device))
        return self

    def draft_token_ids(self) -> Tensor:
        """[Vd] int64: the target id of each draft id (``arange(Vd) + d2t``)."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def _head_rows(self) -> Optional[Tensor]:
        """The draft ids the head computes: all (None), or those whose target id is in the restricted
        vocabulary of :meth:`set_draft_vocab`."""
        if self.draft_vocab is None:
            return None
        keep = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.d2t.device)
        keep[self.draft_vocab.to(self.d2t.device)] = True
        rows = keep[self.draft_token_ids()].nonzero().flatten()
        if rows.numel() == 0:
            raise ValueError("Eagle3Drafter: no token of the restricted vocabulary is in the head's draft vocabulary")
        return rows

    @property
    def token_map(self) -> Optional[Tensor]:
        rows = self._head_rows()
        ids = self.draft_token_ids()
        if rows is None:
            identity = ids.numel() == self.vocab_size and bool((self.d2t == 0).all())
            return None if identity else ids
        return ids[rows]

    # -- features ------------------------------------------------------------------------------------
    @property
    def feature_layers(self) -> Tuple[int, ...]:
        """The target layers whose inputs the head reads (configured, or :func:`feature_layers` of the
        bound target's depth)."""
        if self._layers is None:
            raise RuntimeError("Eagle3Drafter: bind(target) first (the feature layers follow the target's depth)")
        return self._layers

    @property
    def target_features(self):
        return self.feature_layers

    @property
    def num_features(self) -> int:
        return int(self.fc.weight.shape[1]) // self.target_hidden

    # -- checkpoints ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, target: Optional[nn.Module] = None,
                        dtype: Optional[torch.dtype] = None) -> "Eagle3Drafter":
        """Load a published EAGLE-3 checkpoint directory (config.json + model.safetensors or
        pytorch_model.bin; see the module docstring) as it is. Binds to `target` when given; weights keep
        their stored dtype unless `dtype` is given. ValueError for missing or unknown weights, shapes
        that do not fit the config, or an inconsistent d2t / t2d."""
        raw, state = read_checkpoint(path)
        return cls.from_state(raw, state, target=target, dtype=dtype, where=path)

    @classmethod
    def from_state(cls, raw_config: dict, state: Dict[str, Tensor], target: Optional[nn.Module] = None,
                   dtype: Optional[torch.dtype] = None, where: str = "checkpoint") -> "Eagle3Drafter":
        """Build from a config dict and a state dict in the published layout (see :meth:`from_pretrained`)."""
        state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
        raw = dict(raw_config)
        nested = raw.pop("eagle_config", None)
        if isinstance(nested, dict):
            for key in _LAYER_KEYS:
                if key in nested and key not in raw:
                    raw[key] = nested[key]
        config = config_from_dict(raw)
        need = ("fc.weight", "lm_head.weight", "norm.weight", "midlayer.self_attn.q_proj.weight")
        missing = [k for k in need if k not in state]
        if missing:
            raise ValueError(f"Eagle3Drafter.from_pretrained: {where} lacks {missing}; not an EAGLE-3 checkpoint "
                             f"(weights: {sorted(state)[:8]}...)")
        hidden, fused = state["fc.weight"].shape
        draft = int(state["lm_head.weight"].shape[0])
        if int(config.hidden_size) != hidden:
            raise ValueError(f"Eagle3Drafter.from_pretrained: {where}: fc.weight is [{hidden}, {fused}] but "
                             f"config hidden_size is {config.hidden_size}")
        if getattr(config, "draft_vocab_size", None) not in (None, draft):
            raise ValueError(f"Eagle3Drafter.from_pretrained: {where}: lm_head.weight has {draft} rows but config "
                             f"draft_vocab_size is {config.draft_vocab_size}")
        config.draft_vocab_size = draft
        target_h = int(getattr(config, "target_hidden_size", None) or hidden)
        if fused % target_h:
            raise ValueError(f"Eagle3Drafter.from_pretrained: {where}: fc.weight reads {fused} features, not a "
                             f"multiple of the target hidden size {target_h}")
        if "midlayer.self_attn.q_proj.bias" in state:
            config.attention_bias = True
        if "d2t" not in state and draft != int(config.vocab_size):
            raise ValueError(f"Eagle3Drafter.from_pretrained: {where}: no d2t, yet the draft vocabulary ({draft}) "
                             f"differs from vocab_size ({config.vocab_size})")
        if "t2d" in state and state["t2d"].numel() != int(config.vocab_size):
            raise ValueError(f"Eagle3Drafter.from_pretrained: {where}: t2d has {state['t2d'].numel()} entries but "
                             f"config vocab_size is {config.vocab_size}")
        drafter = cls(config, num_features=fused // target_h, own_embedding="embed_tokens.weight" in state)
        d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
        expected = {k for k in drafter.state_dict() if k not in ("d2t", "t2d")}
        unknown, absent = set(state) - expected, expected - set(state)
        if unknown or absent:
            raise ValueError(f"Eagle3Drafter.from_pretrained: weights of {where} do not match the EAGLE-3 layout: "
                             f"unexpected {sorted(unknown)}, missing {sorted(absent)}")
        for k, v in state.items():
            want = drafter.state_dict()[k].shape
            if v.shape != want:
                raise ValueError(f"Eagle3Drafter.from_pretrained: {where}: {k} has shape {tuple(v.shape)}, the "
                                 f"config gives {tuple(want)}")
        if dtype is None:
            dtype = state["fc.weight"].dtype
        drafter.to(dtype)
        drafter.load_state_dict(state, strict=False)
        if d2t is not None:
            drafter.set_vocab_mapping(d2t, t2d)
        if target is not None:
            drafter.bind(target)
        return drafter

    def save_pretrained(self, path: str, safe_serialization: bool = True) -> None:
        """Write config.json and the owned weights in the published EAGLE-3 layout to directory `path`
        (d2t / t2d omitted when the draft vocabulary is the whole vocabulary in order)."""
        d = self.config.to_dict()
        d["architectures"] = ["LlamaForCausalLMEagle3"]
        d["draft_vocab_size"] = self.draft_vocab_size
        if self.target_hidden != int(self.config.hidden_size):
            d["target_hidden_size"] = self.target_hidden
        if self._layers is not None:
            d["eagle_aux_hidden_state_layer_ids"] = list(self._layers)
        state = self.state_dict()
        if self.draft_vocab_size == self.vocab_size and not bool(self.d2t.any()):
            state.pop("d2t")
            state.pop("t2d")
        write_checkpoint(path, d, state, safe_serialization)

    def clone(self) -> "Eagle3Drafter":
        twin = Eagle3Drafter(copy.deepcopy(self.config), num_features=self.num_features,
                             own_embedding=hasattr(self, "embed_tokens"))
        param = self.fc.weight
        twin.to(device=param.device, dtype=param.dtype)
        twin.load_state_dict(self.state_dict())
        twin._bound, twin._layers = self._bound, self._layers
        twin.draft_vocab = self.draft_vocab
        return twin

    # -- binding -------------------------------------------------------------------------------------
    def bind(self, target: nn.Module, move: bool = True) -> None:
        """Check that the head fits `target` (hidden size, vocabulary, layers; ValueError otherwise), use its
        input embeddings, and move to its device and dtype (unless ``move`` is False: training keeps its own)."""
        h = target_hidden_size(target)
        if h != self.target_hidden:
            raise ValueError(f"Eagle3Drafter: built for a target of hidden size {self.target_hidden}, the target's "
                             f"is {h}")
        v = target_vocab_size(target)
        if self.vocab_size != v:
            raise ValueError(f"Eagle3Drafter: built for a vocabulary of {self.vocab_size} tokens (config vocab_size / "
                             f"t2d), the target's has {v}")
        embed = target.get_input_embeddings()
        if not hasattr(self, "embed_tokens") and embed.weight.shape[1] != self.config.hidden_size:
            raise ValueError(f"Eagle3Drafter: the head is {self.config.hidden_size} wide but the target's embeddings "
                             f"are {embed.weight.shape[1]}; such a head needs its own embed_tokens")
        depth = int(getattr(target.config.get_text_config() if hasattr(target.config, "get_text_config")
                            else target.config, "num_hidden_layers"))
        layers = self._layers if self._layers is not None else feature_layers(depth)
        if len(layers) != self.num_features:
            raise ValueError(f"Eagle3Drafter: fc reads {self.num_features} target layers, but the layers for this "
                             f"{depth}-layer target are {list(layers)}; name them in config.json "
                             f"({_LAYER_KEYS[0]})")
        if min(layers) < 0 or max(layers) > depth:
            raise ValueError(f"Eagle3Drafter: feature layers {list(layers)} outside [0, {depth}] for this "
                             f"{depth}-layer target")
        if move:
            param = next(target.parameters())
            self.to(device=param.device, dtype=param.dtype)
        self._layers = tuple(int(i) for i in layers)
        self._bound = (embed,)

    @property
    def rotary(self) -> nn.Module:
        """The head's rotary-embedding module (kept out of the submodules, so its frequencies stay fp32)."""
        return self._rotary[0]

    def embedding_weight(self) -> Tensor:
        """The token embedding the head reads: its own, else the target's (after :meth:`bind`)."""
        if hasattr(self, "embed_tokens"):
            return self.embed_tokens.weight
        if not self._bound:
            raise RuntimeError("Eagle3Drafter: bind(target) first (it reads the target's embeddings)")
        return self._bound[0].weight

    # -- running ---------------------------------------------------------------------------------------
    @property
    def root_feature(self) -> Tensor:
        """[B, H] the head's output feature at the current root (what the depth-1 nodes read)."""
        return self._group().root_feature

    def group_key(self) -> Optional[Hashable]:
        if not self._bound or hasattr(self, "embed_tokens"):
            return None
        return ("eagle3", self._layers, tuple(self.d2t.tolist())) + head_key(self)

    @classmethod
    def make_group(cls, drafters: Sequence["Eagle3Drafter"]) -> DraftGroup:
        return _Eagle3Group(drafters)


def _configured_layers(config) -> Optional[Tuple[int, ...]]:
    for key in _LAYER_KEYS:
        value = getattr(config, key, None)
        if value:
            return tuple(int(i) for i in value)
    nested = getattr(config, "eagle_config", None)
    if isinstance(nested, dict):
        for key in _LAYER_KEYS:
            if nested.get(key):
                return tuple(int(i) for i in nested[key])
    return None


class _Eagle3Group(FeatureHeadGroup):
    """EAGLE-3 heads of one shape and draft vocabulary, bound to one target, run as one batched forward.

    The committed-cache bookkeeping (prompt alignment, appends, the root feature, the frontier) is
    :class:`taps.drafters.heads.FeatureHeadGroup`'s; the head's arithmetic is :class:`Eagle3Weights`:
    committed entries read the fused target features through ``fc``, draft nodes their parent's output
    feature."""

    def __init__(self, drafters: Sequence[Eagle3Drafter]):
        super().__init__(drafters)
        first = drafters[0]
        rows = first._head_rows()
        self.weights = Eagle3Weights(drafters, rows).pack()
        self.fc = self.weights.fc
        self.layers = [self.weights.layer]
        self.embed_weight = first.embedding_weight()
        token_map = first.token_map
        self.token_map = None if token_map is None else token_map.to(first.fc.weight.device)
        self.dtype = first.fc.weight.dtype
        self.rope = RopeTable(first.rotary, self.dtype)

    def features(self, tokens: Tensor, hidden: Tensor, rope_pos: Tensor, attend, fused: bool = True) -> Tensor:
        """[G * B, T, H] output features of (token, feature) pairs, rows group-major: ``fused`` target
        features [G * B, T, k * Ht], else the head's own features [G * B, T, H]."""
        rows, num = tokens.shape
        g = self.groups
        emb = as_dtype(F.embedding(tokens, self.embed_weight), self.dtype).view(g, rows // g * num, -1)
        h = as_dtype(hidden, self.dtype).reshape(g, rows // g * num, -1)
        cos, sin = self.rope(rope_pos, (rows, num))
        return self.weights.hidden(emb, h, fused, cos, sin, attend, rows // g, num).view(rows, num, -1)

    def _logits(self, feature: Tensor) -> Tensor:
        shape = feature.shape
        out = self.weights.logits(feature.reshape(self.groups, -1, shape[-1]))
        return out.view(*shape[:-1], -1)

    def _node_features(self, tokens: Tensor, feats: Tensor, rope_pos: Tensor, attend) -> Tensor:
        return self.features(tokens, feats, rope_pos, attend, fused=False)  # fc is skipped for the head's own
