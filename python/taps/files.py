"""File digests: the sha256 manifests of the shipped models and the identity of a model's weights."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict

__all__ = ["sha256_file", "weights_sha256", "file_hashes"]


def sha256_file(path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_WEIGHTS_DIGESTS: Dict[tuple, str] = {}


def weights_sha256(folder) -> str:
    """One sha256 for a Hugging Face model folder's weights: the file's own digest when it is a single
    ``model.safetensors``; for sharded (``*.safetensors``) or ``*.bin`` weights, the digest of the
    lines "name digest" of every file, sorted by name. Remembered per (folder, file names, sizes,
    mtimes), so that a run that needs it several times reads a large target once."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors or *.bin weights")
    stats = [(f.name, f.stat()) for f in files]
    key = (str(folder.resolve()),) + tuple((name, st.st_size, st.st_mtime_ns) for name, st in stats)
    if key not in _WEIGHTS_DIGESTS:
        if len(files) == 1 and files[0].name == "model.safetensors":
            digest = sha256_file(files[0])
        else:
            digest = hashlib.sha256("".join(f"{f.name} {sha256_file(f)}\n" for f in files).encode()).hexdigest()
        _WEIGHTS_DIGESTS[key] = digest
    return _WEIGHTS_DIGESTS[key]


def file_hashes(folder) -> Dict[str, str]:
    """sha256 of every file in ``folder`` except manifest.json (relative path -> hex digest)."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}
