"""taps: task-aware speculative decoding on top of the taps_ops kernels (orchestration lives here).

Public names (imported lazily, so ``import taps`` stays light for the CLI):

- drafters: :class:`Drafter`, :class:`ModelDrafter` (an independent small causal LM),
  :class:`EagleDrafter` (EAGLE-1/2 / HASS feature head), :class:`Eagle3Drafter` (EAGLE-3 head),
  :class:`PromptLookupDrafter` (n-gram matches in the context, no model; ``store=`` a :class:`TokenStore`, the
  continuations of a corpus too), :class:`NgramTableDrafter` (draws from an :class:`NgramTable` of the target's
  own distributions, no model), :func:`average_drafters`
- :func:`expand`: the EAGLE-2 tree expansion every drafter uses
- strategies: :data:`STRATEGIES`, :func:`strategy_names`, :func:`make_strategy`, :func:`register_strategy`
- :class:`SpeculativeDecoder` and its :class:`GenerateOutput`; :class:`RequestStats`, :class:`Profiler`
- :class:`Tuner`: chooses each step's draft from measured costs and running acceptance (``budget="auto"``)
- :mod:`taps.hf`: the target's tree-verification forward and KV cache
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DraftCandidates": "drafters", "Drafter": "drafters", "EagleDrafter": "drafters",
    "ModelDrafter": "drafters", "average_drafters": "drafters", "Eagle3Drafter": "drafters",
    "expand": "expansion", "PromptLookupDrafter": "drafters", "TokenStore": "drafters",
    "NgramTable": "drafters", "NgramTableDrafter": "drafters",
    "STRATEGIES": "strategies", "make_strategy": "strategies", "register_strategy": "strategies",
    "strategy_names": "strategies",
    "Profiler": "stats", "RequestStats": "stats", "summarize": "stats",
    "GenerateOutput": "decoder", "SpeculativeDecoder": "decoder", "Tuner": "tuner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'taps' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
