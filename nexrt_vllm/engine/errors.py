"""Typed errors of the engine. Every one says what was wrong in its message."""


class EngineError(Exception):
    """Base class of every error the engine raises on bad input."""


class ConfigError(EngineError, ValueError):
    """config.json names an unsupported architecture, lacks a field, or holds a bad value."""


class WeightsError(EngineError, ValueError):
    """The checkpoint's tensors do not match the config (missing, unexpected, misshaped, bad index)."""


class StateError(EngineError, ValueError):
    """An imported state does not match the engine's native layout, or the context is full."""


class InputError(EngineError, ValueError):
    """A request's token ids are empty, out of the vocabulary, or longer than the context."""


class SamplingParamsError(EngineError, ValueError):
    """A sampling parameter is out of range or of the wrong type."""


class NotBuiltError(EngineError):
    """A combination of features the engine does not implement yet (named in the message)."""
