"""The error a config that cannot run raises, in a module of its own: train.config (the schema)
and the checks it calls (train.config.resume) both raise it, and neither may import the other's
importer (no import circle)."""


class ConfigError(ValueError):
    """A config that cannot run; the single-line message names the key and the fix."""
