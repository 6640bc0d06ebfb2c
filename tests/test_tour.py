"""`taps tour` (the kernel tour) runs end to end (reduced size); its claims are checked here."""

import re

import pytest

from taps import cli

import engine_models as em

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tour_quick(capsys):
    with em.GreedyCalls() as calls:
        assert cli.main(["tour", "--quick"]) == 0
    out = capsys.readouterr().out
    for step in ("1. build_tree", "2. merge_trees", "3. verify_tree", "4. lossless check", "5. speed", "6. engine"):
        assert step in out
    # 4.: the total variation of the sampled first tokens from the target distribution is within the noise
    tv, noise = map(float, re.search(r"total variation ([0-9.]+) \(sampling noise alone ~([0-9.]+)\)", out).groups())
    assert tv < noise, f"total variation {tv} above the sampling noise {noise}"
    # 6.: speculative greedy output equals the target's own, for every strategy the tour runs, as it says,
    # and as the target's own Hugging Face generate says
    engine_lines = [line for line in out.splitlines() if "identical to the target's own greedy output" in line]
    assert len(engine_lines) == 5 and all(line.rstrip().endswith("True") for line in engine_lines)
    assert calls.check(min_calls=6) == {"autoregressive", "single", "route-confidence", "merged", "merged-budget",
                                        "adaptive"}
