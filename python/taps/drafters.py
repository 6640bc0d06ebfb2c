"""Drafters: models that propose a tree of candidate tokens for the target to verify.

Every drafter has the same small interface (:class:`Drafter`) and keeps its own KV cache of the
committed context. The decoding loop drives it as follows (B requests, ragged)::

    drafter.bind(target)                                  # checks + moves to the target's device/dtype
    drafter.start(prompt_ids, prompt_lens, root, hidden, max_len)   # after the target's prefill
    cand = drafter.draft(depth, top_k)                    # EAGLE-2 expansion (taps.expansion)
    ...  target verification ...
    drafter.advance(new_tokens, num_new, hidden)          # accepted drafts + bonus (the next root)

Cache convention: ``drafter.lengths[b]`` entries are committed, and the last of them is the current
root (the last token the target committed or sampled, which the target itself has not cached yet).
``drafter.root_logits [B, V]`` is the drafter's prediction after the root: the depth-1 candidates.

- :class:`ModelDrafter`: an independent small Hugging Face causal LM sharing the target's tokenizer;
  its entry t is token t.
- :class:`EagleDrafter`: the EAGLE-1/2 feature head. Entry t pairs the target's final hidden state at
  position t with token t + 1: ``fc([embed(token_{t+1}), h_t])`` -> Llama decoder layer(s) -> a predicted
  feature, read out by the target's lm_head. Checkpoints in the public EAGLE / HASS layout
  (``config.json`` + ``pytorch_model.bin`` or ``model.safetensors`` with ``fc.*`` and ``layers.0.*``
  weights) load unchanged with :meth:`EagleDrafter.from_pretrained`.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Dict, List, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import hf

__all__ = ["DraftCandidates", "Drafter", "ModelDrafter", "EagleDrafter", "average_drafters",
           "target_vocab_size", "target_hidden_size"]


class DraftCandidates(NamedTuple):
    """EAGLE-2 candidates of one drafter ([B, M] unless noted), the input of ``taps_ops.build_tree``.

    scores: float32 cumulative draft log-prob; tokens: int64; parents: int64 (-1 = child of the root,
    else an earlier candidate); entropy: [B] mean entropy (nats) of the distributions the expansion read.
    """

    scores: Tensor
    tokens: Tensor
    parents: Tensor
    entropy: Tensor


def target_vocab_size(model: nn.Module) -> int:
    """Rows of the model's lm_head (the logits width)."""
    return int(model.get_output_embeddings().weight.shape[0])


def target_hidden_size(model: nn.Module) -> int:
    """Width of the model's final hidden states (the lm_head input)."""
    return int(model.get_output_embeddings().weight.shape[1])


class Drafter(nn.Module):
    """Base class of drafters (see the module docstring for the call sequence).

    Subclasses implement :meth:`bind`, :meth:`start`, :meth:`advance`, :meth:`forward_nodes` and
    :meth:`clone`; :meth:`draft` (the EAGLE-2 expansion) is shared.
    """

    #: True for feature drafters that consume the target's hidden states.
    needs_hidden: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = None
        self._lengths: Optional[Tensor] = None
        self._root_logits: Optional[Tensor] = None

    # -- properties the expansion reads ----------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def lengths(self) -> Tensor:
        """[B] int64 committed cache entries per request (the root included)."""
        if self._lengths is None:
            raise RuntimeError(f"{type(self).__name__}: call start() first")
        return self._lengths

    @property
    def root_logits(self) -> Tensor:
        """[B, V] the drafter's logits for the token after the current root."""
        if self._root_logits is None:
            raise RuntimeError(f"{type(self).__name__}: call start() first")
        return self._root_logits

    # -- the interface ---------------------------------------------------------------------------
    def bind(self, target: nn.Module) -> None:
        """Check compatibility with `target` (raises ValueError) and move to its device and dtype."""
        raise NotImplementedError

    def start(self, input_ids: Tensor, prompt_lens: Tensor, root: Tensor, hidden: Optional[Tensor],
              max_len: int) -> None:
        """Allocate the cache and consume the prompts.

        Args:
            input_ids: [B, T] int64 right-padded prompts (padding ignored).
            prompt_lens: [B] int64 real tokens per row (>= 1).
            root: [B] int64 the first token the target produced after each prompt.
            hidden: [B, T, H] target final hidden states over the prompts (feature drafters), or None.
            max_len: cache positions per request (committed context plus scratch for the expansion).
        """
        raise NotImplementedError

    def advance(self, tokens: Tensor, num_new: Tensor, hidden: Optional[Tensor]) -> None:
        """Commit one verification step.

        Args:
            tokens: [B, K] int64: the accepted draft tokens then the bonus token (the next root),
                padded; num_new[b] of row b are real.
            num_new: [B] int64 accepted + 1 (>= 1).
            hidden: [B, K, H] the target's hidden states at the previous root and the accepted nodes
                (row b: root, a_1 .. a_A), or None.
        """
        raise NotImplementedError

    def forward_nodes(self, tokens: Tensor, parent_slot: Tensor, write_pos: Tensor, rope_pos: Tensor,
                      mask: Tensor, level: int) -> Tensor:
        """Run the drafter on one frontier of the expansion (scratch entries, not committed).

        Args:
            tokens: [B, K] int64 frontier tokens (nodes at depth `level`).
            parent_slot: [B, K] int64 index of each node's parent in the previous frontier (-1: the root).
            write_pos: [B, K] int64 cache positions to write (past ``lengths``).
            rope_pos: [B, K] int64 rotary positions.
            mask: [B, 1, K, S] bool, keys visible to each node (its prefix and its scratch ancestors).
            level: depth of the frontier nodes (1-based).
        Returns:
            logits [B, K, V].
        """
        raise NotImplementedError

    def clone(self) -> "Drafter":
        """An independent copy of the weights (bound to the same target)."""
        raise NotImplementedError

    def release(self) -> None:
        """Free the KV cache."""
        self._lengths = None
        self._root_logits = None

    def draft(self, depth: int, top_k: int, profiler=None, with_entropy: bool = True) -> DraftCandidates:
        """EAGLE-2 candidates after the current root: see :func:`taps.expansion.expand`."""
        from .expansion import expand
        return expand(self, depth, top_k, profiler, with_entropy)


def _causal_ragged(lengths: Tensor, num_tokens: int):
    """Write/rotary positions [B, T] and the causal mask [B, 1, T, S] for appending T tokens."""
    device = lengths.device
    positions = lengths.unsqueeze(1) + torch.arange(num_tokens, device=device)
    span = int(lengths.max()) + num_tokens
    mask = (torch.arange(span, device=device) <= positions.unsqueeze(-1)).unsqueeze(1)
    return positions, mask


# ---------------------------------------------------------------------------------------------------
# An independent causal LM
# ---------------------------------------------------------------------------------------------------

class ModelDrafter(Drafter):
    """A small Hugging Face causal LM as a drafter (it must share the target's tokenizer).

    Args:
        model: a causal LM (Llama, Qwen2/3, Mistral, ... as supported by :mod:`taps.hf`); switched to
            the ``"taps"`` attention. It may be the target itself (a perfect drafter, for tests).
        tokenizer: optional; when given, the decoder checks it against the target's.
    """

    def __init__(self, model: nn.Module, tokenizer=None):
        super().__init__()
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise ValueError("ModelDrafter: the model must be a causal LM with an lm_head")
        self.model = hf.use_taps_attention(model.eval())
        self.tokenizer = tokenizer
        self.cache: Optional[hf.TreeKVCache] = None

    @classmethod
    def from_pretrained(cls, path: str, tokenizer=None, **kwargs) -> "ModelDrafter":
        """Load with ``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` (and its tokenizer when
        `tokenizer` is True)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        if tokenizer is True:
            tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(model, tokenizer)

    @property
    def vocab_size(self) -> int:
        return target_vocab_size(self.model)

    def bind(self, target: nn.Module) -> None:
        if self.vocab_size != target_vocab_size(target):
            raise ValueError(f"ModelDrafter: the drafter's vocabulary has {self.vocab_size} tokens, the "
                             f"target's {target_vocab_size(target)}; a drafter must share the target's tokenizer")
        param = next(target.parameters())
        self.model.to(device=param.device)

    def start(self, input_ids, prompt_lens, root, hidden, max_len):
        batch, longest = input_ids.shape
        device = next(self.model.parameters()).device
        self.cache = hf.TreeKVCache.for_model(self.model, batch, max_len)
        ids = torch.zeros((batch, longest + 1), dtype=torch.int64, device=device)
        ids[:, :longest] = input_ids.clamp_min(0)
        lens = prompt_lens.to(device)
        ids[torch.arange(batch, device=device), lens] = root.to(device)  # the root after each prompt
        self._root_logits = hf.prefill(self.model, self.cache, ids, lens + 1).logits
        self._lengths = self.cache.lengths

    def advance(self, tokens, num_new, hidden):
        self._root_logits = hf.prefill(self.model, self.cache, tokens.clamp_min(0), num_new).logits

    def forward_nodes(self, tokens, parent_slot, write_pos, rope_pos, mask, level):
        hidden = hf.masked_forward(self.model, self.cache, tokens, write_pos, rope_pos, mask)
        return self.model.get_output_embeddings()(hidden)

    def clone(self) -> "ModelDrafter":
        return ModelDrafter(copy.deepcopy(self.model), self.tokenizer)

    def release(self) -> None:
        super().release()
        self.cache = None


# ---------------------------------------------------------------------------------------------------
# The EAGLE feature head
# ---------------------------------------------------------------------------------------------------

class _EagleAttention(nn.Module):
    """Llama self-attention over the drafter's own preallocated cache with an explicit mask."""

    def __init__(self, config, bias: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: List[Tensor], write_pos: Tensor,
                mask: Tensor) -> Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        batch, num, _ = x.shape
        q = self.q_proj(x).view(batch, num, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, num, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, num, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = kv
        rows = torch.arange(batch, device=x.device).unsqueeze(1)
        keys[rows, :, write_pos] = k.transpose(1, 2).to(keys.dtype)
        values[rows, :, write_pos] = v.transpose(1, 2).to(values.dtype)
        span = mask.shape[-1]
        out = F.scaled_dot_product_attention(q, keys[:, :, :span], values[:, :, :span], attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, num, -1))


class _EagleLayer(nn.Module):
    """A Llama decoder layer (EAGLE-1/2 drop the input norm of layer 0)."""

    def __init__(self, config, bias: bool, input_norm: bool):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.self_attn = _EagleAttention(config, bias)
        self.mlp = LlamaMLP(config)
        if input_norm:
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)

    def forward(self, x, cos, sin, kv, write_pos, mask):
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        x = x + self.self_attn(h, cos, sin, kv, write_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _config_from_dict(d: dict):
    from transformers import LlamaConfig
    d = {k: v for k, v in d.items() if k not in ("architectures", "model_type", "transformers_version",
                                                    "torch_dtype", "dtype")}
    return LlamaConfig(**d)


_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class EagleDrafter(Drafter):
    """EAGLE-1/2 (and HASS) feature head: ``fc`` over [token embedding, target hidden state], then
    ``num_hidden_layers`` Llama decoder layers (one in EAGLE), read out by the target's lm_head.

    Args:
        config: a ``LlamaConfig`` (hidden_size must equal the target's; vocab_size the target's).
        bias: whether ``fc`` (and the q/k/v projections, when `attention_bias`) carry a bias; default
            ``config.bias`` if present, else True (the EAGLE default).
        input_norm_first_layer: whether layer 0 has an ``input_layernorm`` (False in EAGLE-1/2).
        own_embedding: give the head its own ``embed_tokens`` (some checkpoints ship one); by default
            it uses the target's embeddings, like its lm_head, after :meth:`bind`.

    The parameters it owns (and saves) are ``fc.*``, ``layers.{i}.*`` and optionally ``embed_tokens.*``.
    """

    needs_hidden = True

    def __init__(self, config, *, bias: Optional[bool] = None, input_norm_first_layer: bool = False,
                 own_embedding: bool = False):
        super().__init__()
        self.config = config
        if bias is None:
            bias = bool(getattr(config, "bias", True))
        self.fc_bias = bias
        hidden = config.hidden_size
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.fc = nn.Linear(2 * hidden, hidden, bias=bias)
        self.layers = nn.ModuleList(
            _EagleLayer(config, attention_bias, input_norm=(i > 0 or input_norm_first_layer))
            for i in range(config.num_hidden_layers))
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        # In a tuple: not a submodule, so .to(dtype) keeps its inverse frequencies in float32.
        self._rotary = (LlamaRotaryEmbedding(config=config),)
        self._bound: tuple = ()  # (embedding, lm_head) of the target; a tuple so they are not submodules
        self._kv: List[List[Tensor]] = []
        self._root_feature: Optional[Tensor] = None
        self._frontier_feature: Optional[Tensor] = None

    # -- checkpoints -----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, target: Optional[nn.Module] = None,
                        dtype: Optional[torch.dtype] = None) -> "EagleDrafter":
        """Load an EAGLE / HASS checkpoint directory (config.json + model.safetensors or
        pytorch_model.bin with ``fc.*``, ``layers.0.*`` [, ``embed_tokens.weight``]) as it is.

        The layout (fc bias, layer-0 input norm, own embedding) is read from the weight names; unknown
        weight names raise ValueError. Binds to `target` when given. Weights keep their stored dtype
        unless `dtype` is given.
        """
        with open(os.path.join(path, "config.json")) as f:
            config = _config_from_dict(json.load(f))
        state = _load_weights(path)
        state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
        state.pop("lm_head.weight", None)  # some exports repeat the target's head; ours is the target's
        if "fc.weight" not in state:
            raise ValueError(f"EagleDrafter.from_pretrained: {path} has no fc.weight; not an EAGLE checkpoint "
                             f"(weights: {sorted(state)[:8]}...)")
        layer_ids = {int(k.split(".")[1]) for k in state if k.startswith("layers.")}
        if layer_ids and max(layer_ids) + 1 != config.num_hidden_layers:
            config.num_hidden_layers = max(layer_ids) + 1
        drafter = cls(config, bias="fc.bias" in state,
                      input_norm_first_layer="layers.0.input_layernorm.weight" in state,
                      own_embedding="embed_tokens.weight" in state)
        if state.get("layers.0.self_attn.q_proj.bias") is not None and not getattr(config, "attention_bias", False):
            config.attention_bias = True
            drafter = cls(config, bias="fc.bias" in state,
                          input_norm_first_layer="layers.0.input_layernorm.weight" in state,
                          own_embedding="embed_tokens.weight" in state)
        expected = set(drafter.state_dict())
        unknown, missing = set(state) - expected, expected - set(state)
        if unknown or missing:
            raise ValueError(f"EagleDrafter.from_pretrained: weights do not match the EAGLE layout of "
                             f"{path}: unexpected {sorted(unknown)}, missing {sorted(missing)}")
        if dtype is None:
            dtype = state["fc.weight"].dtype
        drafter.to(dtype)
        drafter.load_state_dict(state)
        if target is not None:
            drafter.bind(target)
        return drafter

    def save_pretrained(self, path: str, safe_serialization: bool = True) -> None:
        """Write config.json and the owned weights (EAGLE layout names) to directory `path`."""
        os.makedirs(path, exist_ok=True)
        d = self.config.to_dict()
        d["bias"] = self.fc_bias
        d["architectures"] = ["LlamaForCausalLM"]
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(d, f, indent=2, sort_keys=True, default=str)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if safe_serialization:
            from safetensors.torch import save_file
            save_file(state, os.path.join(path, "model.safetensors"))
        else:
            torch.save(state, os.path.join(path, "pytorch_model.bin"))

    def clone(self) -> "EagleDrafter":
        twin = EagleDrafter(self.config, bias=self.fc_bias,
                            input_norm_first_layer=hasattr(self.layers[0], "input_layernorm"),
                            own_embedding=hasattr(self, "embed_tokens"))
        param = self.fc.weight
        twin.to(device=param.device, dtype=param.dtype)
        twin.load_state_dict(self.state_dict())
        twin._bound = self._bound
        return twin

    # -- binding ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        if self._bound:
            return int(self._bound[1].weight.shape[0])
        return int(self.config.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def bind(self, target: nn.Module) -> None:
        """Use `target`'s input embeddings and lm_head; move to the target's device and dtype."""
        h = target_hidden_size(target)
        if h != self.hidden_size:
            raise ValueError(f"EagleDrafter: built for hidden size {self.hidden_size}, the target's is {h}")
        v = target_vocab_size(target)
        if hasattr(self, "embed_tokens") and self.embed_tokens.weight.shape[0] != v:
            raise ValueError(f"EagleDrafter: its embedding has {self.embed_tokens.weight.shape[0]} tokens, "
                             f"the target's vocabulary {v}")
        if int(self.config.vocab_size) != v:
            raise ValueError(f"EagleDrafter: config vocab_size {self.config.vocab_size}, the target's is {v}")
        param = next(target.parameters())
        self.to(device=param.device, dtype=param.dtype)
        self._bound = (target.get_input_embeddings(), target.get_output_embeddings())

    def _embed(self, tokens: Tensor) -> Tensor:
        if hasattr(self, "embed_tokens"):
            return self.embed_tokens(tokens)
        if not self._bound:
            raise RuntimeError("EagleDrafter: bind(target) first (it uses the target's embeddings)")
        return self._bound[0](tokens)

    def _lm_head(self, feature: Tensor) -> Tensor:
        if not self._bound:
            raise RuntimeError("EagleDrafter: bind(target) first (it uses the target's lm_head)")
        head = self._bound[1]
        return head(feature.to(head.weight.dtype))

    # -- running ---------------------------------------------------------------------------------
    def features(self, tokens: Tensor, hidden: Tensor, write_pos: Tensor, rope_pos: Tensor,
                 mask: Tensor) -> Tensor:
        """Predicted features [B, T, H] for input pairs (tokens [B, T], target/predicted features
        [B, T, H]); K/V written at write_pos [B, T]; mask [B, 1, T, S] bool."""
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([self._embed(tokens).to(dtype), hidden.to(dtype)], dim=-1))
        cos, sin = self._rotary[0](x, rope_pos)
        for layer, kv in zip(self.layers, self._kv):
            x = layer(x, cos, sin, kv, write_pos, mask)
        return x

    def _append(self, tokens: Tensor, hidden: Tensor, num_new: Tensor) -> None:
        positions, mask = _causal_ragged(self._lengths, tokens.shape[1])
        out = self.features(tokens.clamp_min(0), hidden, positions, positions, mask)
        last = out[torch.arange(out.shape[0], device=out.device), num_new - 1]
        self._lengths += num_new
        self._root_feature = last
        self._root_logits = self._lm_head(last)

    def start(self, input_ids, prompt_lens, root, hidden, max_len):
        if hidden is None:
            raise ValueError("EagleDrafter.start: needs the target's hidden states")
        batch, longest = input_ids.shape
        device = self.fc.weight.device
        param = self.fc.weight
        attn = self.layers[0].self_attn
        shape = (batch, attn.num_kv_heads, max_len, attn.head_dim)
        self._kv = [[torch.zeros(shape, dtype=param.dtype, device=device),
                     torch.zeros(shape, dtype=param.dtype, device=device)] for _ in self.layers]
        self._lengths = torch.zeros(batch, dtype=torch.int64, device=device)
        lens = prompt_lens.to(device)
        # Pair h_t with token t + 1: the prompt shifted left, the root after each prompt's last token.
        shifted = torch.zeros((batch, longest), dtype=torch.int64, device=device)
        shifted[:, :longest - 1] = input_ids[:, 1:].clamp_min(0)
        shifted[torch.arange(batch, device=device), lens - 1] = root.to(device)
        self._append(shifted, hidden, lens)

    def advance(self, tokens, num_new, hidden):
        if hidden is None:
            raise ValueError("EagleDrafter.advance: needs the target's hidden states")
        self._append(tokens, hidden, num_new.to(self._lengths.device))

    def forward_nodes(self, tokens, parent_slot, write_pos, rope_pos, mask, level):
        if level == 1:
            feats = self._root_feature.unsqueeze(1).expand(-1, tokens.shape[1], -1)
        else:
            prev = self._frontier_feature
            feats = prev.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, prev.shape[-1]))
        out = self.features(tokens, feats, write_pos, rope_pos, mask)
        self._frontier_feature = out
        return self._lm_head(out)

    def release(self) -> None:
        super().release()
        self._kv = []
        self._root_feature = self._frontier_feature = None


def _load_weights(path: str) -> Dict[str, Tensor]:
    for name in _WEIGHT_FILES:
        file = os.path.join(path, name)
        if os.path.exists(file):
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                return load_file(file)
            return torch.load(file, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no weights ({' or '.join(_WEIGHT_FILES)}) in {path}")


# ---------------------------------------------------------------------------------------------------
# Checkpoint averaging
# ---------------------------------------------------------------------------------------------------

def average_drafters(drafters: Sequence[Drafter], weights: Optional[Sequence[float]] = None) -> Drafter:
    """Weight-space (checkpoint) average of drafters of the same kind and shapes: a new drafter.

    Args:
        drafters: two or more drafters of one class with identical parameter names and shapes.
        weights: optional mixing weights (normalised to sum 1); default the plain mean.
    Returns:
        a new drafter (a clone of the first) holding ``sum_i w_i * params_i``.
    """
    drafters = list(drafters)
    if not drafters:
        raise ValueError("average_drafters: no drafters given")
    first = drafters[0]
    kinds = {type(d).__name__ for d in drafters}
    if len(kinds) > 1:
        raise ValueError(f"average_drafters: drafters of different kinds {sorted(kinds)} cannot be averaged")
    states = [d.state_dict() for d in drafters]
    for i, s in enumerate(states[1:], 1):
        if set(s) != set(states[0]):
            raise ValueError(f"average_drafters: drafter {i} has different parameters than drafter 0")
        for k, v in s.items():
            if v.shape != states[0][k].shape:
                raise ValueError(f"average_drafters: drafter {i} parameter {k} has shape {tuple(v.shape)}, "
                                 f"drafter 0 {tuple(states[0][k].shape)}")
    if weights is None:
        weights = [1.0] * len(drafters)
    if len(weights) != len(drafters):
        raise ValueError("average_drafters: one weight per drafter")
    total = float(sum(weights))
    mixed = {}
    for k, v in states[0].items():
        if v.is_floating_point():
            acc = sum(float(w) / total * s[k].double() for w, s in zip(weights, states))
            mixed[k] = acc.to(v.dtype)
        else:
            mixed[k] = v
    out = first.clone()
    out.load_state_dict(mixed)
    return out
