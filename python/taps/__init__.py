"""taps: task-aware speculative decoding on top of the taps_ops kernels (orchestration lives here)."""

__version__ = "0.1.0"
