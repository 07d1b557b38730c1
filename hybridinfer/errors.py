"""Typed errors. Each names the bad value so a user can act on it."""


class HybridInferError(Exception):
    """Base class of every error this package raises on bad input."""


class GGUFError(HybridInferError):
    """The file is not a readable GGUF."""


class NotGGUFError(GGUFError):
    """The file does not start with the GGUF magic."""


class TruncatedGGUFError(GGUFError):
    """The file ends before the data its header promises."""


class MissingMetadataError(GGUFError):
    """A metadata key the architecture needs is absent."""


class UnsupportedArchitectureError(HybridInferError):
    """`general.architecture` names an architecture this engine does not run."""


class UnsupportedTensorTypeError(HybridInferError):
    """A tensor is stored in a ggml type this engine cannot read."""


class MissingTensorError(HybridInferError):
    """A tensor the architecture needs is absent."""


class TensorShapeError(HybridInferError):
    """A tensor's shape disagrees with the shape the metadata implies."""


class ContextLengthError(HybridInferError):
    """A prompt (plus requested tokens) does not fit in the context."""


class BackendNotAvailableError(HybridInferError):
    """The requested backend is not built or cannot run on this machine."""


class CardFailedError(HybridInferError):
    """One card of a multi-card GPU prefill failed or went away mid-run; `device` is its index, `card` its name."""

    def __init__(self, msg: str, device: int | None = None, card: str | None = None):
        super().__init__(msg)
        self.device, self.card = device, card


class TemplateError(HybridInferError):
    """The chat template failed to render (including `raise_exception` calls in it)."""


class TokenizerError(HybridInferError):
    """The GGUF's vocabulary cannot be used (unknown tokenizer model or pre-tokenizer, bad token id)."""


class ShapeError(HybridInferError):
    """A synthetic-model shape, architecture or quantization name is unknown, or a custom shape is invalid."""


class KernelArgumentError(HybridInferError):
    """A GPU kernel was called with a buffer of the wrong dtype, shape or layout, or a launch too large."""


class SnapshotError(HybridInferError):
    """A prefix-cache snapshot cannot be used: it belongs to another layer layout or state shape, it is no longer
    cached, or its file is corrupt (the cache itself treats a corrupt file as a miss)."""


class ParameterError(HybridInferError, ValueError):
    """A value passed by the user (a sampling parameter, n_ctx, max_tokens, a thread count, a budget, a path, a
    cache directory) is out of range or of the wrong kind; the message names the parameter and the value."""


class CapacityError(HybridInferError):
    """A request cannot fit the engine's limits (sequence count, state or K/V byte budget) and is refused."""


class NotRegularFileError(ParameterError):
    """A path named for reading (a model, a chat template) is not a regular file: a FIFO, which could block its
    reader forever, a device (/dev/zero never ends), a socket or a directory. `kind` says which ("a FIFO")."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind


class HubError(HybridInferError):
    """A model named on the Hugging Face Hub (`-hf REPO[:QUANT|:FILE]`) cannot be had: the repository, the file or
    the quant does not exist (the message lists what does), or the Hub cannot be reached (or HF_HUB_OFFLINE is set)
    and the cache does not hold it."""


class NonFiniteWeightsError(GGUFError):
    """A tensor of the model holds NaN or infinity (in its float values or a quantized block's scales): the file is
    damaged, and a model run on it would answer with nothing."""
class ExpertReadError(GGUFError):
    """A routed expert's bytes could not be read from the model file mid-run (an engine under a RAM budget reads
    the experts it does not keep): the file was truncated, rewritten, replaced or moved, a read failed, or it did
    not finish within the read timeout. The message names the file and the byte range."""


class RamBudgetError(ParameterError):
    """A RAM budget (`--ram-budget`) cannot hold what must stay resident: the weights other than the routed
    experts plus room for one token's experts in every layer. `needed` is the least budget in bytes that would."""

    def __init__(self, message: str, needed: int = 0):
        super().__init__(message)
        self.needed = int(needed)


class EngineClosed(CapacityError):
    """The Engine was closed (`Engine.close`): a request queued or running then, or made after, is refused."""


class MTPUnavailableError(UnsupportedArchitectureError):
    """Drafting with a multi-token-prediction block was asked of a model that has none (its file was written
    without the block), or of a backend that cannot run it yet."""
