"""The one error type of the models package (models.config re-exports it)."""


class ModelError(ValueError):
    """A model config, checkpoint or argument that cannot work; the message is one line."""
