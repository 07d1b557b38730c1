"""A model known by its shape alone: the metadata and tensor table a GGUF file of that shape and quantization
would have (the ones `hybridinfer synth` writes), with no file and no weights. It answers what a GGUFModel answers
about layout (meta, has, tensor: names, types, shapes, byte sizes), so model_args(), the GPU placement and the
FLOP counts work on it as on the file, e.g. `hybridinfer plan --shape 35b-a3b` before a 20 GB download."""

from __future__ import annotations

import numpy as np

from ..errors import HybridInferError
from ..format.gguf_model import GGUFModel, TensorInfo


class _Metadata:
    """Stands in for gguf.GGUFWriter in synth._add_hparams: keeps the key-value pairs it is given."""

    def __init__(self, arch: str):
        self.kv: dict = {"general.architecture": arch}

    def add_name(self, name: str) -> None:
        self.kv["general.name"] = name

    def add_uint32(self, key: str, v) -> None:
        self.kv[key] = int(v)

    def add_float32(self, key: str, v) -> None:
        self.kv[key] = float(np.float32(v))  # as the file stores it

    def add_key_value(self, key: str, v, vtype=None, sub_type=None) -> None:
        self.kv[key] = list(v) if isinstance(v, (list, tuple)) else v


class ShapeModel(GGUFModel):
    """The layout of a synthetic `arch` model of `shape` at `quant` (as synth.plan_model plans it). Reading any
    tensor's data raises an error naming the model: there is none."""

    def __init__(self, arch: str, shape, quant: str = "q4_k_m", tensor_types=()):
        from .synth import QUANTS, _add_hparams, plan_model

        plan = plan_model(arch, shape, quant, tensor_types=tensor_types)
        name = shape if isinstance(shape, str) else "custom"
        self.path = f"<shape {arch} {name} {quant}>"
        md = _Metadata(arch)
        _add_hparams(md, arch, plan["hp"], f"synthetic {arch} {name} {quant}", QUANTS[quant.lower()][1])
        self.metadata = md.kv
        self.tensors = {s.name: TensorInfo(s.name, int(qt), tuple(int(x) for x in s.ne), int(nb), 0, None)
                        for s, qt, nb in plan["tensors"]}
        self.file_size = plan["data_bytes"]
        self.version, self.alignment, self.data_offset = 3, 32, 0
        self._mm = None

    def dequant(self, name, ne=None):
        raise HybridInferError(f"{self.path}: a shape has no weights to read ({name!r})")
