"""The --card-profile the gpu-marked tests run under (set by conftest.py from pytest's option; None: the card
itself). Tests that load an engine or a GPUModel pass PROFILE on, as a library user would."""

PROFILE: str | None = None
