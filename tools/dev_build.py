"""Incremental development build of the taps_ops library (no pip install needed).

    python tools/dev_build.py [--build-dir DIR] [--cuda]

Compiles the same sources as setup.py (taps_sources) with ninja into DIR (default build/dev, or
$TAPS_BUILD_DIR) and prints the shared library's path. Point the package at it with
    export TAPS_OPS_LIBRARY=<printed path>  PYTHONPATH=python
so that `import taps_ops` loads this build. Only changed files are recompiled.
--cuda also compiles the .cu files (needs nvcc; the result can only run on a GPU machine).
"""

import argparse
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default=os.environ.get("TAPS_BUILD_DIR", os.path.join(ROOT, "build", "dev")))
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.cuda and "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")

    # Reuse setup.py's source list and include logic without running setup().
    spec = importlib.util.spec_from_file_location("taps_setup_helpers", os.path.join(ROOT, "setup.py"))
    src = open(os.path.join(ROOT, "setup.py")).read().split("\nsetup(")[0]
    helpers: dict = {"__file__": os.path.join(ROOT, "setup.py"), "__name__": spec.name}
    exec(compile(src, "setup.py", "exec"), helpers)

    from torch.utils.cpp_extension import load

    sources = [os.path.join(ROOT, s) for s in helpers["taps_sources"](args.cuda)]
    includes = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]
    if args.cuda:
        includes += helpers["nvidia_wheel_includes"]()
    os.makedirs(args.build_dir, exist_ok=True)
    path = load(
        name="taps_ops_dev" + ("_cuda" if args.cuda else ""),
        sources=sources,
        extra_include_paths=includes,
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", "-lineinfo"],
        build_directory=args.build_dir,
        with_cuda=args.cuda,
        is_python_module=False,
        verbose=args.verbose,
    )
    lib = path if isinstance(path, str) else os.path.join(args.build_dir, f"taps_ops_dev{'_cuda' if args.cuda else ''}.so")
    print(lib)


if __name__ == "__main__":
    sys.exit(main())
