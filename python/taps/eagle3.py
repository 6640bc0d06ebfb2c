"""The EAGLE-3 drafter's public names, importable as ``taps.eagle3``; they are defined in
:mod:`taps.drafters.eagle3`."""

from .drafters.eagle3 import Eagle3Drafter, Eagle3Weights, feature_layers, is_eagle3_state, vocab_mapping

__all__ = ["Eagle3Drafter", "Eagle3Weights", "feature_layers", "is_eagle3_state", "vocab_mapping"]
