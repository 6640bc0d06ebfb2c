"""``taps info``: what this installation runs on, for a first check and for bug reports.

    taps info [--json] [--verify]

Versions (taps, Python, torch and its CUDA, transformers), the taps_ops library (where it was loaded from,
whether it holds the CUDA kernels), the CPU (its model, the instruction-set level of each op's kernel,
ATen's level, native bf16), the GPUs torch sees, the device and dtype that ``--device auto`` and ``--dtype
auto`` pick, the shipped models (``--verify``: their files against the manifests' sha256), and the optional
packages (``taps serve``'s, the plots'). Nothing here loads a model or runs a kernel.
"""

from __future__ import annotations

import importlib.util
import json
import platform
from typing import Dict, List

#: optional packages: module -> (pip name, what needs it)
OPTIONAL = {"fastapi": ("fastapi", "taps serve"), "uvicorn": ("uvicorn", "taps serve"),
            "prometheus_client": ("prometheus-client", "taps serve"), "openai": ("openai", "the serve tests"),
            "matplotlib": ("matplotlib", "plots (taps eval, taps train)")}


def add_info_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--verify", action="store_true", help="check the shipped models' files against their sha256")


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # not installed as a distribution (a source checkout on PYTHONPATH)
        return "not installed" if importlib.util.find_spec(module) is None else "unknown"


def collect(verify: bool = False) -> Dict[str, object]:
    """The report as a dict (see the module docstring)."""
    import torch

    import taps
    import taps_ops

    from . import models
    from .arguments import resolve_device

    cpu = taps_ops.cpu_info()
    gpus: List[dict] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": prop.name, "capability": f"{prop.major}.{prop.minor}",
                         "memory_gib": round(prop.total_memory / 2**30, 1), "sms": prop.multi_processor_count})
    device = resolve_device("auto")
    dtype = models.resolve_dtype("auto", device)
    root = models.models_dir()
    shipped = {"folder": str(root), "target": (root / "target" / "config.json").is_file(),
               "drafters": models.available_drafters(),
               "stores": sorted(f.name for f in (root / "stores").glob("*") if (f / "store.npz").is_file())}
    if verify:
        checked = {}
        for folder in ([root / "tokenizer", root / "target"] + sorted((root / "drafters").glob("*"))
                       + sorted((root / "stores").glob("*"))):
            if (folder / "manifest.json").is_file():
                try:
                    models.verify_manifest(folder)
                    checked[folder.name] = "ok"
                except (OSError, ValueError) as e:
                    checked[folder.name] = f"FAILED: {e}"
        shipped["sha256"] = checked
    return {
        "versions": {"taps": taps.__version__, "python": platform.python_version(), "torch": torch.__version__,
                     "torch_cuda": torch.version.cuda, "transformers": _version("transformers"),
                     "platform": platform.platform()},
        "library": {"path": getattr(taps_ops._library, "__file__", None), "cuda_kernels": taps_ops.has_cuda_kernels()},
        "cpu": {"model": cpu["cpu"], "taps_isa": cpu["isa"], "host_isa": cpu["host_isa"],
                "aten_capability": cpu["aten_capability"], "native_bf16": cpu["native_bf16"], "ops": cpu["ops"],
                "threads": torch.get_num_threads()},
        "gpus": gpus,
        "auto": {"device": str(device), "dtype": str(dtype).replace("torch.", "")},
        "models": shipped,
        "optional": {m: importlib.util.find_spec(m) is not None for m in OPTIONAL},
    }


def format_report(r: Dict[str, object]) -> str:
    """The report as text, one fact a line."""
    v, lib, cpu, auto, m = r["versions"], r["library"], r["cpu"], r["auto"], r["models"]
    lines = [f"taps {v['taps']}, Python {v['python']}, torch {v['torch']} (CUDA {v['torch_cuda'] or 'none'}), "
             f"transformers {v['transformers']}; {v['platform']}",
             f"taps_ops library: {lib['path']}; CUDA kernels: {'yes' if lib['cuda_kernels'] else 'no'}",
             f"CPU: {cpu['model']}; taps kernels at {cpu['taps_isa']} (host {cpu['host_isa']}), ATen "
             f"{cpu['aten_capability']}, native bf16: {'yes' if cpu['native_bf16'] else 'no'}; "
             f"{cpu['threads']} torch thread(s)",
             "  per op: " + ", ".join(f"{op} {isa}" for op, isa in cpu["ops"].items())]
    if r["gpus"]:
        for g in r["gpus"]:
            lines.append(f"GPU {g['index']}: {g['name']} (compute capability {g['capability']}, {g['memory_gib']} GiB, "
                         f"{g['sms']} SMs)")
        if not lib["cuda_kernels"]:
            lines.append("  the library has no CUDA kernels: rebuild with nvcc (README, 'Install'), or taps runs on the CPU")
    else:
        lines.append("GPU: none visible to torch")
    lines.append(f"--device auto -> {auto['device']}, --dtype auto -> {auto['dtype']}")
    drafters = "; ".join(f"{fam}: {', '.join(names)}" for fam, names in m["drafters"].items()) or "none"
    lines.append(f"shipped models in {m['folder']}: target {'yes' if m['target'] else 'MISSING'}; drafters {drafters}; "
                 f"token stores {', '.join(m.get('stores', [])) or 'none'}")
    if "sha256" in m:
        bad = {k: s for k, s in m["sha256"].items() if s != "ok"}
        lines.append(f"  sha256: {len(m['sha256']) - len(bad)} of {len(m['sha256'])} folders match their manifests"
                     + "".join(f"\n  {k}: {s}" for k, s in bad.items()))
    missing = [f"{OPTIONAL[k][0]} ({OPTIONAL[k][1]})" for k, ok in r["optional"].items() if not ok]
    lines.append("optional packages: " + ("all present" if not missing else "missing " + ", ".join(missing)))
    return "\n".join(lines)


def info(args) -> int:
    report = collect(verify=args.verify)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    bad = [k for k, s in report["models"].get("sha256", {}).items() if s != "ok"]
    return 1 if bad else 0
