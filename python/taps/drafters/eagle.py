"""EAGLE-1/2 and HASS drafters: the feature head that reads the target's final hidden states.

:class:`EagleDrafter`: entry t pairs the target's final hidden state at position t with token t + 1:
``fc([embed(token_{t+1}), h_t])`` -> Llama decoder layer(s) -> a predicted feature, read out by the
target's lm_head (draft nodes feed their parent's predicted feature back through ``fc``). Checkpoints in
the public EAGLE / HASS layout (``config.json`` + ``pytorch_model.bin`` or ``model.safetensors`` with
``fc.*`` and ``layers.0.*`` weights, :mod:`taps.drafters.checkpoint`) load unchanged with
:meth:`EagleDrafter.from_pretrained`, which also recognises an EAGLE-3 checkpoint and returns an
:class:`taps.drafters.eagle3.Eagle3Drafter`.

Heads of one shape bound to one target run as one batched :class:`EagleGroup` (the cache bookkeeping of
:class:`taps.drafters.heads.FeatureHeadGroup`).
"""

from __future__ import annotations

from typing import Hashable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kv import cache_attend
from ..lean import LayerWeights, Linear, RopeTable, as_dtype, decoder_layer
from .base import DraftGroup, Drafter, SoloMixin, head_rows, target_hidden_size, target_vocab_size
from .checkpoint import config_from_dict, read_checkpoint, write_checkpoint
from .eagle3 import Eagle3Drafter, is_eagle3_state
from .heads import FeatureHeadGroup, head_key

__all__ = ["EagleDrafter", "EagleGroup"]


class _EagleAttention(nn.Module):
    """Llama self-attention weights of an EAGLE head (run by :func:`taps.lean.decoder_layer`)."""

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


class _EagleLayer(nn.Module):
    """A Llama decoder layer's weights (EAGLE-1/2 drop the input norm of layer 0)."""

    def __init__(self, config, bias: bool, input_norm: bool):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.self_attn = _EagleAttention(config, bias)
        self.mlp = LlamaMLP(config)
        if input_norm:
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)


class EagleDrafter(SoloMixin, Drafter):
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
    Heads of one shape bound to one target run as one batched group in the decoding loop.
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

    # -- checkpoints -----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, target: Optional[nn.Module] = None,
                        dtype: Optional[torch.dtype] = None) -> "Drafter":
        """Load an EAGLE / HASS checkpoint directory (config.json + model.safetensors or
        pytorch_model.bin with ``fc.*``, ``layers.0.*`` [, ``embed_tokens.weight``]) as it is; an
        EAGLE-3 checkpoint (``midlayer.*``, ``d2t``, ...) loads as a :class:`taps.drafters.eagle3.Eagle3Drafter`.

        The layout (fc bias, layer-0 input norm, own embedding) is read from the weight names; unknown
        weight names raise ValueError. Binds to `target` when given. Weights keep their stored dtype
        unless `dtype` is given.
        """
        raw, state = read_checkpoint(path)
        if is_eagle3_state(state):
            return Eagle3Drafter.from_state(raw, state, target=target, dtype=dtype, where=path)
        config = config_from_dict(raw)
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
        d = self.config.to_dict()
        d["bias"] = self.fc_bias
        d["architectures"] = ["LlamaForCausalLM"]
        write_checkpoint(path, d, self.state_dict(), safe_serialization)

    def clone(self) -> "EagleDrafter":
        twin = EagleDrafter(self.config, bias=self.fc_bias,
                            input_norm_first_layer=hasattr(self.layers[0], "input_layernorm"),
                            own_embedding=hasattr(self, "embed_tokens"))
        param = self.fc.weight
        twin.to(device=param.device, dtype=param.dtype)
        twin.load_state_dict(self.state_dict())
        twin._bound = self._bound
        twin.draft_vocab = self.draft_vocab
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

    def bind(self, target: nn.Module, move: bool = True) -> None:
        """Use `target`'s input embeddings and lm_head; move to the target's device and dtype (unless
        ``move`` is False: training keeps its own)."""
        h = target_hidden_size(target)
        if h != self.hidden_size:
            raise ValueError(f"EagleDrafter: built for hidden size {self.hidden_size}, the target's is {h}")
        v = target_vocab_size(target)
        if hasattr(self, "embed_tokens") and self.embed_tokens.weight.shape[0] != v:
            raise ValueError(f"EagleDrafter: its embedding has {self.embed_tokens.weight.shape[0]} tokens, "
                             f"the target's vocabulary {v}")
        if int(self.config.vocab_size) != v:
            raise ValueError(f"EagleDrafter: config vocab_size {self.config.vocab_size}, the target's is {v}")
        if move:
            param = next(target.parameters())
            self.to(device=param.device, dtype=param.dtype)
        self._bound = (target.get_input_embeddings(), target.get_output_embeddings())

    @property
    def rotary(self) -> nn.Module:
        """The head's rotary-embedding module (kept out of the submodules, so its frequencies stay fp32)."""
        return self._rotary[0]

    def _require_bound(self) -> None:
        if not self._bound:
            raise RuntimeError("EagleDrafter: bind(target) first (it uses the target's embeddings and lm_head)")

    def lm_head(self) -> nn.Module:
        """The lm_head the head's features are read out with: the target's (after :meth:`bind`)."""
        self._require_bound()
        return self._bound[1]

    def embedding_weight(self) -> Tensor:
        """The token embedding the head reads: its own, else the target's (after :meth:`bind`)."""
        if hasattr(self, "embed_tokens"):
            return self.embed_tokens.weight
        self._require_bound()
        return self._bound[0].weight

    # -- running ---------------------------------------------------------------------------------
    @property
    def root_feature(self) -> Tensor:
        """[B, H] the head's predicted feature at the current root (what the depth-1 nodes read)."""
        return self._group().root_feature

    def features(self, tokens: Tensor, hidden: Tensor, write_pos: Tensor, rope_pos: Tensor, mask: Tensor,
                 kv: Optional[List[List[Tensor]]] = None) -> Tensor:
        """Predicted features [B, T, H] for input pairs (tokens [B, T], target/predicted features
        [B, T, H]); K/V written at write_pos [B, T] into `kv` (per layer [keys, values] [B, Hkv, S, D];
        default a fresh cache of S = mask.shape[-1] positions); mask [B, 1, T, S] bool."""
        group = EagleGroup([self])
        if kv is None:
            attn = self.layers[0].self_attn
            shape = (tokens.shape[0], attn.num_kv_heads, int(mask.shape[-1]), attn.head_dim)
            kv = [[hidden.new_zeros(shape, dtype=group.dtype), hidden.new_zeros(shape, dtype=group.dtype)]
                  for _ in self.layers]
        group.rope.ensure(int(rope_pos.max()) + 1, tokens.device)
        return group.features(tokens, hidden, rope_pos, cache_attend(kv, group.layers, mask, positions=write_pos))

    def group_key(self) -> Optional[Hashable]:
        if not self._bound or hasattr(self, "embed_tokens"):
            return None
        return ("eagle", id(self._bound[1])) + head_key(self)

    @classmethod
    def make_group(cls, drafters: Sequence["EagleDrafter"]) -> DraftGroup:
        return EagleGroup(drafters)


class EagleGroup(FeatureHeadGroup):
    """EAGLE heads of one shape, bound to one target, run as one batched forward."""

    def __init__(self, drafters: Sequence[EagleDrafter]):
        super().__init__(drafters)
        first = drafters[0]
        first._require_bound()
        self.fc = Linear([d.fc.weight for d in drafters], [d.fc.bias for d in drafters]).pack().choose_small_layout()
        self.layers = [LayerWeights([d.layers[i] for d in drafters]).pack() for i in range(len(first.layers))]
        self.embed_weight = first.embedding_weight()
        head = first.lm_head()
        self.head = head_rows(head.weight, head.bias, first.draft_vocab).pack().choose_small_layout(stacked=False)
        if first.draft_vocab is not None:
            self.token_map = first.draft_vocab.to(head.weight.device)
        self.dtype = first.fc.weight.dtype
        self.rope = RopeTable(first.rotary, self.dtype)

    def features(self, tokens: Tensor, hidden: Tensor, rope_pos: Tensor, attend) -> Tensor:
        """[G * B, T, H] predicted features of (token, feature) pairs, rows group-major."""
        rows, num = tokens.shape
        emb = as_dtype(F.embedding(tokens, self.embed_weight), self.dtype)
        x = self.fc(torch.cat([emb, as_dtype(hidden, self.dtype)], dim=-1).view(self.groups, -1, 2 * emb.shape[-1]))
        cos, sin = self.rope(rope_pos, (rows, num))
        for i, w in enumerate(self.layers):
            x = decoder_layer(w, i, x, cos, sin, attend, rows // self.groups, num)
        return x.view(rows, num, -1)

    def _logits(self, feature: Tensor) -> Tensor:
        return self.head(as_dtype(feature, self.head.weight.dtype))

    def _node_features(self, tokens: Tensor, feats: Tensor, rope_pos: Tensor, attend) -> Tensor:
        """Output features of draft nodes, which read their parent's output feature (EAGLE-1/2: through
        ``fc``, as committed entries read the target's)."""
        return self.features(tokens, feats, rope_pos, attend)
