"""Shared behaviour of the command-line entry points: one clear line for a user error, not a traceback."""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from moh_vision.errors import ConfigError, RunError


def user_error_in(err: BaseException) -> Optional[Exception]:
    """The ConfigError/RunError behind ``err`` (Hydra's instantiate wraps errors raised by constructors)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (ConfigError, RunError)):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def run_cli(fn: Callable[[Any], Any], cfg: Any) -> Any:
    try:
        return fn(cfg)
    except Exception as err:
        user_error = user_error_in(err)
        if user_error is None:
            raise
        print(f"error: {user_error}", file=sys.stderr)
        sys.exit(2 if isinstance(user_error, ConfigError) else 1)
