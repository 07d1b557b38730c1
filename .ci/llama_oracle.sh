#!/usr/bin/env bash
# Build and install the llama.cpp test oracle (llama-cpp-python from its source distribution) so it runs on any
# x86-64 host and computes in the float order the exactness tests expect there:
# - GGML_NATIVE=OFF with explicit ISA flags taken from /proc/cpuinfo, matching the CPU backend's best ISA level
#   (avx512vnni -> AVX-512 + VNNI, avx2 -> AVX2/FMA/F16C, else SSE4.2), and never AMX: ggml's AMX path crashes on
#   quantized models on Sapphire Rapids and is not the order the CPU backend mirrors;
# - the wheel is kept in a cache folder keyed by version and flags, and pip's own cache is bypassed, so a wheel
#   built with other flags (pip keys its cache by the source only) is never reused.
set -euo pipefail
py=${PYTHON:-python3}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]]; }
level=sse42
args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_AVX512_BF16=OFF"
args+=" -DGGML_AVX512_VBMI=OFF -DGGML_AVX_VNNI=OFF -DGGML_CCACHE=OFF -DGGML_OPENMP=ON"
if has avx2 && has fma && has f16c; then
    level=avx2
    if has avx512f && has avx512bw && has avx512vl && has avx512_vnni; then level=avx512vnni; fi
fi
case $level in
    avx512vnni) args+=" -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
                args+=" -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON" ;;
    avx2)       args+=" -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
                args+=" -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF" ;;
    *)          args+=" -DGGML_SSE42=ON -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF"
                args+=" -DGGML_AVX512=OFF" ;;
esac
key=$(printf '%s %s' "$version" "$args" | sha256sum | cut -c1-16)
cache=${HYBRIDINFER_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hybridinfer/wheels}/llama-cpp-python-$version-$level-$key
marker=$($py -c 'import importlib.metadata as m, pathlib as p
try: print((p.Path(m.distribution("llama-cpp-python")._path) / "HYBRIDINFER_FLAGS").read_text().strip())
except Exception: print("")' 2>/dev/null || true)
if [ "$marker" = "$key" ]; then
    echo "llama.cpp oracle: llama-cpp-python $version ($level, key $key) already installed"
    exit 0
fi
if ! ls "$cache"/*.whl >/dev/null 2>&1; then
    echo "llama.cpp oracle: building llama-cpp-python $version for $level without AMX (a few minutes)"
    rm -rf "$cache.tmp" && mkdir -p "$cache.tmp"
    CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) $py -m pip wheel -q --no-cache-dir --no-deps \
        --no-binary llama-cpp-python "llama-cpp-python==$version" -w "$cache.tmp"
    rm -rf "$cache" && mv "$cache.tmp" "$cache"
fi
$py -m pip install -q --force-reinstall --no-deps "$cache"/*.whl
$py -m pip install -q "$(ls "$cache"/*.whl)"  # its dependencies, if missing
dist=$($py -c 'import importlib.metadata as m; print(m.distribution("llama-cpp-python")._path)')
echo "$key" > "$dist/HYBRIDINFER_FLAGS"
$py - <<PY
import llama_cpp
info = llama_cpp.llama_print_system_info().decode()
print("llama.cpp oracle:", info)
assert "AMX_INT8 = 1" not in info, "the llama.cpp oracle was built with AMX"
PY
