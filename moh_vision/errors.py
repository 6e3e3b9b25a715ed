"""Errors a user should see as one line, not a traceback.

Entry points catch them (see :mod:`moh_vision.cli`): a :class:`ConfigError` exits with status 2,
a :class:`RunError` with status 1.
"""


class ConfigError(ValueError):
    """A configuration or input the code cannot honour; the message says what is wrong and what is allowed."""


class RunError(RuntimeError):
    """A run had to stop (checkpoint could not be written, too many non-finite steps, ...); the message says
    why and what was kept."""
