"""Plain-PyTorch reference implementations of every taps_ops operator.

Written for clarity, not speed: loops over requests and nodes, full softmax rows. The tests and the
benchmarks compare the kernels against these functions. They follow DESIGN.md exactly, including
tie-breaking and the way each node's uniform coin is used.
"""

from __future__ import annotations

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------------
# verify_tree, build_tree, merge_trees
# ---------------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------------
# tree_attention, compact_kv
# ---------------------------------------------------------------------------------------------------
