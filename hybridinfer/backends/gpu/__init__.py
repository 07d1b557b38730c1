"""GPU prefill backend (PyCUDA, sm_20-compatible kernels from native/cuda_sm20)."""
