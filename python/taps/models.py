"""Loading the shipped models: the target and the EAGLE-2 / HASS / EAGLE-3 drafters trained for it.

Layout of the models folder (:data:`MODELS_DIR`, the repository's ``models/``; ``$TAPS_MODELS_DIR``
overrides it)::

    models/target/                     Hugging Face LlamaForCausalLM folder + tokenizer files + manifest.json
    models/drafters/<family>-<data>/   config.json + model.safetensors (EagleDrafter / Eagle3Drafter
                                       .save_pretrained) + manifest.json

``family`` is one of :data:`FAMILIES` (``eagle2``, ``hass``, ``eagle3``), ``data`` one of :data:`DATA_NAMES`
(``math``, ``chat``, ``mixed``, ``mixed2`` and ``avg``, the weight average of the specialists).

Every manifest.json holds ``"files": {relative path: sha256 hex}`` for the files of its folder (the
layout :func:`taps.files.file_hashes` writes); :func:`verify_manifest` checks them, and the
loaders do so by default.

    target, tok = load_target()                      # fp32, eval mode, + ChatTokenizer
    math = load_drafter("eagle2", "math", target)    # bound to the target

:func:`resolve_dtype` is the one place that turns a ``--dtype`` value (``auto``, ``fp32``, ``bf16``) into
a torch dtype: ``auto`` is bf16 only where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX, as
``taps_ops.cpu_info()["native_bf16"]`` reports), fp32 otherwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Union

import torch

from .files import sha256_file

__all__ = ["MODELS_DIR", "FAMILIES", "DATA_NAMES", "DTYPES", "models_dir", "verify_manifest", "load_target",
           "available_drafters", "drafter_dir", "load_drafter", "draft_vocab", "resolve_dtype", "load_store",
           "load_table"]

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The models folder as of import time (``$TAPS_MODELS_DIR`` or the repository's ``models/``);
#: the loaders read the environment again on each call (:func:`models_dir`).
MODELS_DIR = Path(os.environ.get("TAPS_MODELS_DIR") or REPO_ROOT / "models")
FAMILIES = ("eagle2", "hass", "eagle3")
DATA_NAMES = ("math", "chat", "mixed", "mixed2", "avg")
MANIFEST = "manifest.json"

PathLike = Union[str, os.PathLike]
#: ``--dtype`` values: ``auto`` (see :func:`resolve_dtype`) and these names
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16"}


def resolve_dtype(name: str = "auto", device: Union[str, torch.device] = "cpu") -> torch.dtype:
    """The torch dtype of a ``--dtype`` value: ``fp32`` / ``float32``, ``bf16`` / ``bfloat16``, or ``auto``:
    bf16 on CUDA and on a CPU that multiplies bf16 in hardware (AVX512-BF16 or AMX at the kernels' level:
    ``taps_ops.native_half_matmul``), fp32 on other CPUs (there bf16 products are emulated). Raises
    ValueError on another name."""
    key = _DTYPE_ALIASES.get(name, name)
    if key in DTYPES:
        return DTYPES[key]
    if key != "auto":
        raise ValueError(f"unknown dtype {name!r}; choose from auto, {', '.join(DTYPES)}")
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    import taps_ops

    return torch.bfloat16 if taps_ops.native_half_matmul(torch.bfloat16) else torch.float32


def _load_weights(folder: Path, load):
    """``load()`` (a from_pretrained call on `folder`), with an unreadable weights file (truncated, not
    safetensors) raised as one ValueError naming the folder instead of the reader's own exception."""
    from safetensors import SafetensorError

    try:
        return load()
    except SafetensorError as e:
        files = ", ".join(sorted(p.name for p in folder.glob("*.safetensors"))) or "the weights"
        raise ValueError(f"{folder}: cannot read {files} ({e}): truncated or corrupted (the manifest check, "
                         "on unless skipped, compares every file with its sha256)") from None


def models_dir() -> Path:
    """The models folder: ``$TAPS_MODELS_DIR`` when set, else the repository's ``models/``."""
    return Path(os.environ.get("TAPS_MODELS_DIR") or REPO_ROOT / "models")


def _manifest_files(manifest: dict, where: Path) -> Dict[str, str]:
    """The {relative path: sha256} map of a manifest (``files``; ``sha256`` accepted as an alias;
    values may also be ``{"sha256": ...}`` objects)."""
    files = manifest.get("files", manifest.get("sha256"))
    if not isinstance(files, dict) or not files:
        raise ValueError(f"{where}: no 'files' map of sha256 digests")
    out = {}
    for name, digest in files.items():
        if isinstance(digest, dict):
            digest = digest.get("sha256")
        if not isinstance(digest, str):
            raise ValueError(f"{where}: entry {name!r} has no sha256 digest")
        out[str(name)] = digest.lower()
    return out


def verify_manifest(folder: PathLike) -> None:
    """Recompute the sha256 of every file listed in ``folder/manifest.json``.

    Raises ValueError naming the file when a listed file is missing or its digest differs, and when the
    manifest itself is missing or malformed. Files not listed (and manifest.json itself) are ignored.
    """
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise ValueError(f"{path}: manifest missing (load with verify=False to skip the check)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: expected a JSON object")
    root = folder.resolve()
    for name, digest in _manifest_files(manifest, path).items():
        file = (folder / name).resolve()
        if root not in file.parents:
            raise ValueError(f"{path}: entry {name!r} points outside {folder}")
        if not file.is_file():
            raise ValueError(f"{folder}: file {name} listed in {MANIFEST} is missing")
        got = sha256_file(file)
        if got != digest:
            raise ValueError(f"{folder}: file {name} does not match {MANIFEST} (sha256 {got[:12]}..., "
                             f"expected {digest[:12]}...); the file is corrupted or was replaced")


def load_target(path: Optional[PathLike] = None, dtype: torch.dtype = torch.float32, verify: bool = True):
    """Load the target causal LM and its chat tokenizer.

    Args:
        path: the target folder (default ``models_dir() / "target"``).
        dtype: the weights' dtype in memory (the shipped weights are bf16; fp32 by default).
        verify: check the files against manifest.json first (:func:`verify_manifest`).
    Returns:
        (model in eval mode, :class:`taps.chat.ChatTokenizer`).
    """
    from transformers import AutoModelForCausalLM

    from .chat import ChatTokenizer

    folder = Path(path) if path is not None else models_dir() / "target"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no target model in {folder} (expected a Hugging Face folder with config.json; "
                                "train one with `taps train target` or set TAPS_MODELS_DIR)")
    if verify:
        verify_manifest(folder)
    model = _load_weights(folder, lambda: AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype))
    return model.eval(), ChatTokenizer.from_pretrained(folder)


def weights_digest(folder: PathLike) -> Optional[str]:
    """The sha256 of a model folder's ``model.safetensors`` as its manifest.json lists it (None if unlisted)."""
    path = Path(folder) / MANIFEST
    return _manifest_files(json.loads(path.read_text()), path).get("model.safetensors")


def load_store(name: str = "greedy", path: Optional[PathLike] = None, target: Optional[PathLike] = None,
               verify: bool = True):
    """Load token store ``<stores folder>/<name>`` (a :class:`taps.drafters.store.TokenStore`, for
    ``PromptLookupDrafter(store=...)``; built by ``taps train store``).

    Args:
        name: the store's folder name (default ``"greedy"``: the shipped target's greedy answers).
        path: the stores folder (default ``models_dir() / "stores"``).
        target: the target folder the store must have been built from (default ``models_dir() / "target"``;
            its manifest's weights digest is compared with the store's).
        verify: check the files against the store's manifest.json first, and the target's digest.
    """
    from .drafters.store import TokenStore

    return TokenStore.load(_built_file("token store", "stores", "store.npz", "taps train store", name, path, target,
                                       verify))


def load_table(name: str = "sampled", path: Optional[PathLike] = None, target: Optional[PathLike] = None,
               verify: bool = True):
    """Load n-gram table ``<tables folder>/<name>`` (a :class:`taps.drafters.table.NgramTable`, for
    ``NgramTableDrafter``; built by ``taps train table``).

    Args:
        name: the table's folder name (default ``"sampled"``: the shipped target's T = 1 answers).
        path: the tables folder (default ``models_dir() / "tables"``).
        target, verify: as :func:`load_store`'s.
    """
    from .drafters.table import NgramTable

    return NgramTable.load(_built_file("n-gram table", "tables", "table.npz", "taps train table", name, path, target,
                                       verify))


def _built_file(what: str, kind: str, filename: str, command: str, name: str, path: Optional[PathLike],
                target: Optional[PathLike], verify: bool) -> Path:
    """The data file of ``<kind folder>/<name>`` (default folder ``models_dir() / kind``), checked against its
    manifest and the target it was built from when `verify`."""
    folder = (Path(path) if path is not None else models_dir() / kind) / name
    file = folder / filename
    if not file.is_file():
        raise FileNotFoundError(f"no {what} in {folder} (expected {filename}; build one with `{command}`)")
    if verify:
        verify_manifest(folder)
        built_for = json.loads((folder / MANIFEST).read_text()).get("target_weights_sha256")
        tfolder = Path(target) if target is not None else models_dir() / "target"
        if built_for and (tfolder / MANIFEST).is_file():
            have = weights_digest(tfolder)
            if have and have != built_for:
                raise ValueError(f"{folder}: the {what} was built from another target (weights sha256 "
                                 f"{built_for[:12]}..., {tfolder} has {have[:12]}...); rebuild it with `{command}`")
    return file


def drafter_dir(family: str, data: str, path: Optional[PathLike] = None) -> Path:
    """``<drafters folder>/<family>-<data>`` (drafters folder default ``models_dir() / "drafters"``)."""
    root = Path(path) if path is not None else models_dir() / "drafters"
    return root / f"{family}-{data}"


def available_drafters(path: Optional[PathLike] = None) -> Dict[str, List[str]]:
    """Drafters present in the drafters folder (default ``models_dir() / "drafters"``): family -> sorted
    data names, for every ``<family>-<data>`` sub-folder holding a config.json. Families and data names
    outside :data:`FAMILIES` / :data:`DATA_NAMES` are listed too."""
    root = Path(path) if path is not None else models_dir() / "drafters"
    found: Dict[str, List[str]] = {}
    if not root.is_dir():
        return found
    for sub in sorted(root.iterdir()):
        if not sub.is_dir() or "-" not in sub.name or not (sub / "config.json").is_file():
            continue
        family, data = sub.name.split("-", 1)
        found.setdefault(family, []).append(data)
    return {f: sorted(d) for f, d in sorted(found.items())}


def draft_vocab(size: int, path: Optional[PathLike] = None) -> torch.Tensor:
    """The `size` most frequent target ids in the drafters' training data (``token_counts.json`` of the
    target folder, default ``models_dir() / "target"``), for ``Drafter.set_draft_vocab``."""
    from .vocab import draft_vocab as _draft_vocab

    return _draft_vocab(Path(path) if path is not None else models_dir() / "target", size)


def load_drafter(family: str, data: str, target: torch.nn.Module, path: Optional[PathLike] = None,
                 verify: bool = True, draft_vocab: Optional[int] = None):
    """Load drafter ``<family>-<data>`` as an :class:`taps.drafters.EagleDrafter` (an
    :class:`taps.drafters.eagle3.Eagle3Drafter` for EAGLE-3 checkpoints) bound to `target` (in the target's dtype
    and on its device).

    Args:
        family, data: e.g. ``"eagle2"``, ``"math"``.
        target: the target model (from :func:`load_target`).
        path: the drafters folder (default ``models_dir() / "drafters"``).
        verify: check the files against the drafter's manifest.json first.
        draft_vocab: propose only the this many most frequent target tokens (:func:`draft_vocab`;
            for an EAGLE-3 head, those of them in its own draft vocabulary); None or 0: the whole
            vocabulary.
    Raises:
        FileNotFoundError listing the drafters that are available when this one is not.
    """
    from .drafters import EagleDrafter

    folder = drafter_dir(family, data, path)
    if not (folder / "config.json").is_file():
        have = available_drafters(folder.parent)
        listing = ", ".join(f"{f}-{d}" for f, ds in have.items() for d in ds) or "none"
        raise FileNotFoundError(f"no drafter {family}-{data} in {folder.parent} (available: {listing})")
    if verify:
        verify_manifest(folder)
    dtype = next(target.parameters()).dtype
    drafter = _load_weights(folder, lambda: EagleDrafter.from_pretrained(str(folder), target=target, dtype=dtype))
    if draft_vocab:
        drafter.set_draft_vocab(globals()["draft_vocab"](draft_vocab))
    return drafter
