import glob
import importlib.util
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

_HERE = os.path.dirname(os.path.abspath(__file__))


def _build_cache():
    # loaded by path: a PEP 517 build does not put the project folder on sys.path
    spec = importlib.util.spec_from_file_location("_hi_build_cache", os.path.join(_HERE, "native", "build_cache.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class CachedBuildExt(build_ext):
    """build_ext that reuses a native library built before from the same sources, flags and cffi version
    (native/build_cache.py), so installing an extra does not compile the C library again."""

    def build_extension(self, ext):
        bc = _build_cache() if os.path.exists(os.path.join(_HERE, "native", "build_cache.py")) else None
        out = self.get_ext_fullpath(ext.name)
        if bc is None or not bc.enabled() or self.force:
            return super().build_extension(ext)
        import cffi

        key = bc.source_key(ext.name, os.path.basename(out), bc.SOURCES.get(ext.name, [bc.HERE]),
                            extra=(cffi.__version__,))
        root = bc.cache_dir()
        if bc.fetch(key, out, root):
            print(f"hybridinfer: {ext.name}: unchanged sources, reusing the build cached in {root}")
            return None
        super().build_extension(ext)
        bc.store(key, out, root)
        return None


class BuildPyWithKernels(build_py):
    """Ship native/cuda_sm20 (compiled at run time for the card by PyCUDA) inside the package as
    hybridinfer/_cuda_sm20, so a non-editable install finds its kernel sources."""

    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "hybridinfer", "_cuda_sm20")
        os.makedirs(dst, exist_ok=True)
        for f in glob.glob(os.path.join(_HERE, "native", "cuda_sm20", "*.cu*")):
            shutil.copy(f, dst)


setup(
    cmdclass={"build_py": BuildPyWithKernels, "build_ext": CachedBuildExt},
    name="hybridinfer",
    version="0.1.0",
    description="Hybrid MoE (Qwen3.5/3.6) inference for pre-DP4A GPUs and big-RAM hosts",
    packages=find_packages(include=["hybridinfer", "hybridinfer.*"]),
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
        # -hf: models by name from the Hugging Face Hub (its cache, resumable downloads)
        "huggingface_hub>=0.30",
    ],
    extras_require={
        "gpu": ["pycuda"],
        # `hybridinfer bench ...` and bench/*.py: the PNG plots (without it a benchmark writes its table and JSON)
        "bench": ["matplotlib>=3.7"],
        # `hybridinfer serve`: the HTTP server, its metrics and structured output
        "serve": ["fastapi>=0.110", "uvicorn>=0.29", "sse-starlette>=2.1", "pydantic>=2.5",
                  "prometheus-client>=0.20", "llguidance>=0.7"],
        # `hybridinfer batch`: the request models and structured output it shares with the server
        "batch": ["pydantic>=2.5", "llguidance>=0.7"],
        # `hybridinfer batch --ray`: shards as Ray actors (about 240 MB, so not in batch)
        "ray": ["pydantic>=2.5", "llguidance>=0.7", "ray>=2.9"],
        # nvidia-cuda-nvcc-cu11: CUDA 11.8's ptxas for tests/test_ptxas.py (skipped without it)
        "test": ["pytest", "ruff",
                 "nvidia-cuda-nvcc-cu11==11.8.89; platform_system == 'Linux' and platform_machine == 'x86_64'"],
        "oracles": ["transformers", "llama-cpp-python", "torch"],
    },
    entry_points={"console_scripts": ["hybridinfer=hybridinfer.cli:main"]},
    # the native SIMD library hybridinfer._simd (cffi API mode; sources and flags in native/simd/build.py) and the
    # GPU backend's bus pacing hybridinfer.backends.gpu._pace (native/pace/build.py)
    cffi_modules=["native/simd/build.py:ffibuilder", "native/pace/build.py:ffibuilder"],
    zip_safe=False,
)
