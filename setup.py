import glob
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    """Ship native/cuda_sm20 (compiled at run time for the card by PyCUDA) inside the package as
    hybridinfer/_cuda_sm20, so a non-editable install finds its kernel sources."""

    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "hybridinfer", "_cuda_sm20")
        os.makedirs(dst, exist_ok=True)
        for f in glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "cuda_sm20", "*.cu*")):
            shutil.copy(f, dst)


setup(
    cmdclass={"build_py": BuildPyWithKernels},
    name="hybridinfer",
    version="0.1.0",
    description="Hybrid MoE (Qwen3.5/3.6) inference for pre-DP4A GPUs and big-RAM hosts",
    packages=find_packages(include=["hybridinfer", "hybridinfer.*"]),
    # the chat page `hybridinfer serve` answers at / (plain HTML, CSS and JavaScript: nothing to build)
    package_data={"hybridinfer.serving.serve": ["static/*.html", "static/*.css", "static/*.js"]},
    python_requires=">=3.11",
    install_requires=[
        "numpy>=1.26",
        "numba>=0.60",
        "cffi>=1.16",
        "gguf>=0.17",
        "py-cpuinfo>=9",
        "tokenizers>=0.20",
        "jinja2>=3.1",
        "tqdm>=4.60",
    ],
    extras_require={
        "gpu": ["pycuda"],
        # `hybridinfer bench ...` and bench/*.py: the PNG plots (without it a benchmark writes its table and JSON)
        "bench": ["matplotlib>=3.7"],
        # `hybridinfer serve`: the HTTP server, its metrics and structured output
        "serve": ["fastapi>=0.110", "uvicorn>=0.29", "sse-starlette>=2.1", "pydantic>=2.5",
                  "prometheus-client>=0.20", "llguidance>=0.7"],
        # `hybridinfer batch`: the request models and structured output it shares with the server; ray for --ray
        "batch": ["pydantic>=2.5", "llguidance>=0.7", "ray>=2.9"],
        # nvidia-cuda-nvcc-cu11: CUDA 11.8's ptxas for tests/test_ptxas.py (skipped without it)
        # jsonschema: forced tool calls' arguments validated; selenium: the chat page driven in Debian's chromium
        "test": ["pytest", "ruff", "jsonschema", "selenium",
                 "nvidia-cuda-nvcc-cu11==11.8.89; platform_system == 'Linux' and platform_machine == 'x86_64'"],
        "oracles": ["transformers", "llama-cpp-python", "torch"],
    },
    entry_points={"console_scripts": ["hybridinfer=hybridinfer.cli:main"]},
    # the native SIMD library hybridinfer._simd (cffi API mode; sources and flags in native/simd/build.py) and the
    # GPU backend's bus pacing hybridinfer.backends.gpu._pace (native/pace/build.py)
    cffi_modules=["native/simd/build.py:ffibuilder", "native/pace/build.py:ffibuilder"],
    zip_safe=False,
)
