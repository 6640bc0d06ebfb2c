"""Build of the `taps_ops` torch extension and the `taps` package.

The source list is the directory layout itself (see `taps_sources` below): every `csrc/*.cpp`,
`csrc/composite/*.cpp` (ops made of other ops) and `csrc/cpu/*.cpp` is compiled, plus every
`csrc/cuda/*.cu` when the CUDA build is on.
Leaving the `.cu` files out *is* the CPU-only build: each backend registers its own kernels.

Environment knobs:
  TAPS_CPU_ONLY=1           build without CUDA kernels even when nvcc and a CUDA torch are present
  CUDA_HOME                 CUDA toolkit (default: /usr/local/cuda when it holds bin/nvcc)
  TORCH_CUDA_ARCH_LIST      default "8.0;9.0a" (Ampere, Hopper)
  MAX_JOBS                  parallel compile jobs (ninja)
  TAPS_DEBUG=1              -O0 -g host code, -lineinfo device code
"""

import glob
import os
import sys

# torch's CUDA_HOME auto-detection can settle on a prefix without a usable toolkit; prefer the
# conventional location when the user did not choose one. Must run before cpp_extension import.
if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")

import torch  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def taps_sources(with_cuda: bool) -> list[str]:
    """The one description of the extension's sources: the csrc/ layout."""
    patterns = ["csrc/*.cpp", "csrc/composite/*.cpp", "csrc/cpu/*.cpp"] + (["csrc/cuda/*.cu", "csrc/cuda/*.cpp"] if with_cuda else [])
    return sorted(p for pat in patterns for p in glob.glob(pat, root_dir=ROOT))


def want_cuda() -> tuple[bool, str]:
    if os.environ.get("TAPS_CPU_ONLY", "0") not in ("", "0"):
        return False, "TAPS_CPU_ONLY is set"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} has no CUDA"
    if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return False, "nvcc not found (set CUDA_HOME)"
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda}), nvcc in {CUDA_HOME}, " \
                 f"arch list {os.environ['TORCH_CUDA_ARCH_LIST']}"


def nvidia_wheel_includes() -> list[str]:
    """Headers that torch's CUDA headers include (cusparse.h, ...) ship in the pip `nvidia` packages."""
    try:
        import nvidia  # noqa: F401
    except ImportError:
        return []
    found = []
    for base in nvidia.__path__:
        found += sorted(glob.glob(os.path.join(base, "cu*", "include")))
        found += sorted(glob.glob(os.path.join(base, "*", "include")))
    return list(dict.fromkeys(p for p in found if os.path.isdir(p)))


def extension():
    with_cuda, why = want_cuda()
    debug = os.environ.get("TAPS_DEBUG", "0") not in ("", "0")
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    # at::parallel_for is inlined: without -fopenmp it runs serially.
    cxx += ["-fopenmp"] if sys.platform.startswith("linux") else []
    include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]
    sources = taps_sources(with_cuda)
    print(f"[taps] building taps_ops {'WITH CUDA kernels' if with_cuda else 'CPU-only'}: {why}", flush=True)
    print(f"[taps] sources: {' '.join(sources)}", flush=True)
    if with_cuda:
        nvcc = ["-O3", "--expt-relaxed-constexpr", "-Xptxas=-v" if debug else "-lineinfo"]
        return CUDAExtension(
            "taps_ops._C", sources,
            include_dirs=include_dirs + nvidia_wheel_includes(),
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=["-fopenmp"] if "-fopenmp" in cxx else [],
        )
    return CppExtension(
        "taps_ops._C", sources, include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx},
        extra_link_args=["-fopenmp"] if "-fopenmp" in cxx else [],
    )


setup(
    packages=find_packages(where="python"),
    package_dir={"": "python"},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
