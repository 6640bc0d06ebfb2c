"""Drafters: models that propose a tree of candidate tokens for the target to verify.

Every drafter implements one small interface and runs through batched drafter groups
(:mod:`taps.drafters.base`: the call sequence, the cache convention, group-major rows, the request-row
operations of a continuous-batching loop). One module per drafter kind:

- :mod:`taps.drafters.small_lm`: :class:`ModelDrafter`, an independent small Hugging Face causal LM
  sharing the target's tokenizer;
- :mod:`taps.drafters.eagle`: :class:`EagleDrafter`, the EAGLE-1/2 and HASS feature head over the
  target's final hidden states;
- :mod:`taps.drafters.eagle3`: :class:`Eagle3Drafter`, the EAGLE-3 head over target features at three
  depths and its own draft vocabulary;
- :mod:`taps.drafters.ngram`: :class:`PromptLookupDrafter`, proposals copied from earlier in the context
  (no model), and with a :class:`~taps.drafters.store.TokenStore` (:mod:`taps.drafters.store`) from a corpus;
- :mod:`taps.drafters.table`: :class:`NgramTableDrafter`, chains drawn from an :class:`NgramTable` of the
  target's own next-token distributions per context (no model).

Beside them: :mod:`taps.drafters.heads` (what the two feature heads share), :mod:`taps.drafters.average`
(:func:`average_drafters`, the weight-space mean), :mod:`taps.drafters.checkpoint` (the heads' files) and
:mod:`taps.drafters.load` (:func:`load_drafter`: any drafter folder, by its layout).
"""

from ..expansion import DraftCandidates
from .average import average_drafters
from .base import DraftGroup, Drafter, make_groups, target_hidden_size, target_vocab_size
from .eagle import EagleDrafter
from .eagle3 import Eagle3Drafter
from .heads import head_key
from .load import load_drafter
from .ngram import PromptLookupDrafter
from .small_lm import ModelDrafter
from .store import TokenStore
from .table import NgramTable, NgramTableDrafter

__all__ = ["DraftCandidates", "Drafter", "DraftGroup", "ModelDrafter", "EagleDrafter", "Eagle3Drafter",
           "PromptLookupDrafter", "TokenStore", "NgramTable", "NgramTableDrafter", "average_drafters", "head_key", "load_drafter", "make_groups",
           "target_vocab_size", "target_hidden_size"]
