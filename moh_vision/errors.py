"""One error type for everything a user can get wrong in a config or on the command line.

Entry points catch :class:`ConfigError` and print its one-line message instead of a traceback.
"""


class ConfigError(ValueError):
    """A configuration or input the code cannot honour; the message says what is wrong and what is allowed."""
