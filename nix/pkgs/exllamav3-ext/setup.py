"""Build exllamav3's CUDA extension, exllamav3_ext, from the sources inside the exllamav3 wheel.

exllamav3 on PyPI is a py3-none-any wheel: its ext.py compiles the extension with torch's JIT builder at the first
import, which would need nvcc and a writable cache in production. nix/pkgs/exllamav3-ext.nix runs this script
instead, once, at build time. Sources and nvcc flags come from the wheel's own exllamav3/util/cuda_flags.py (loaded
by path, as upstream's setup.py does), so the result is what the JIT build would produce, for the GPUs named in
TORCH_CUDA_ARCH_LIST. ext.py imports an installed exllamav3_ext in preference to building one.
"""

import importlib.util
import os

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = os.path.join("exllamav3", "exllamav3_ext")


def load_cuda_flags():
    path = os.path.join(HERE, "exllamav3", "util", "cuda_flags.py")
    spec = importlib.util.spec_from_file_location("exllamav3_cuda_flags", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
    # Without it torch picks the architectures of the GPUs it sees, and a build machine has none.
    raise SystemExit("TORCH_CUDA_ARCH_LIST is not set; nix/pkgs/exllamav3-ext.nix sets it from cudaCapabilities")

cuda_flags = load_cuda_flags()
sources = [os.path.relpath(p, HERE) for p in cuda_flags.extension_sources(os.path.join(HERE, SOURCES))]

setup(
    name="exllamav3_ext",
    version=os.environ["EXLLAMAV3_VERSION"],
    ext_modules=[
        CUDAExtension(
            name="exllamav3_ext",
            sources=sources,
            include_dirs=[os.path.join(HERE, SOURCES)],
            # ext.py's flags for a Linux CUDA build: -Ofast for the host code, cuda_cflags() for nvcc
            extra_compile_args={"cxx": ["-Ofast"], "nvcc": cuda_flags.cuda_cflags(cuda_home=CUDA_HOME)},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
