"""Every ```python block of README.md and docs/*.md runs as written (each in a fresh namespace, against
the shipped models), so the examples cannot rot. A block that cannot run here (it needs a GPU or a
download) says so with ``<!-- not run: <reason> -->`` on the line before its fence; such blocks are
listed, not run."""

import re

import pytest

from taps.data import REPO_ROOT

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [REPO_ROOT / "README.md"] + sorted((REPO_ROOT / "docs").glob("*.md"))
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")


def python_blocks(path):
    """(first line number, code, reason not to run or None) of each ```python block in `path`."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = NOT_RUN.search(before)
            blocks.append((start + 1, "\n".join(lines[start:end]) + "\n", marker.group(1) if marker else None))
            i = end
        i += 1
    return blocks


BLOCKS = [(path, line, code, reason) for path in DOCS for line, code, reason in python_blocks(path)]


def test_the_readme_has_examples_to_run():
    readme = [b for b in BLOCKS if b[0].name == "README.md" and b[3] is None]
    assert len(readme) >= 3, "the README's Python examples were not found"
    assert sum(b[3] is not None for b in BLOCKS) <= 2, "keep the blocks that are not run few"


@pytest.mark.parametrize("path, line, code, reason", BLOCKS,
                         ids=[f"{b[0].relative_to(REPO_ROOT)}:{b[1]}" for b in BLOCKS])
def test_example_runs_as_written(path, line, code, reason):
    if reason is not None:
        pytest.skip(f"marked not run: {reason}")
    exec(compile(code, f"{path.relative_to(REPO_ROOT)}:{line}", "exec"), {"__name__": "__docs__"})
