"""hybridinfer: hybrid MoE inference for old GPUs and big-RAM hosts."""

__version__ = "0.1.0"


def __getattr__(name):
    # lazy, so `import hybridinfer.format.quant` stays light
    if name == "Engine":
        from .engine.api import Engine

        return Engine
    raise AttributeError(name)
