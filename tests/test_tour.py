"""`taps tour` (the kernel tour) runs end to end (reduced size)."""

import pytest

from taps import cli

pytest.importorskip("transformers")


def test_tour_quick(capsys):
    assert cli.main(["tour", "--quick"]) == 0
    out = capsys.readouterr().out
    for step in ("1. build_tree", "2. merge_trees", "3. verify_tree", "4. lossless check", "5. speed", "6. engine"):
        assert step in out
    # speculative greedy output equals the target's own, for every strategy the demo runs
    engine_lines = [line for line in out.splitlines() if "identical to the target's own greedy output" in line]
    assert len(engine_lines) == 5 and all(line.rstrip().endswith("True") for line in engine_lines)
