"""The engine's user-facing error: a request or a configuration it refuses, with a message meant for
the user. A torch-free leaf, so every layer (the builders, the speculative worker's loader, the engine
process) raises the same type without importing the engine that catches it."""


class EngineInputError(ValueError):
    """A request the engine refuses; the message is meant for the user. `param` names the request
    field at fault where one is (a dotted path into `SamplingParams`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
