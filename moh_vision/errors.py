"""Errors a user should see as one line, not a traceback.

Entry points catch them (see :mod:`moh_vision.cli`): a :class:`ConfigError` exits with status 2, a :class:`RunError`
with status 1. A failed write (:func:`os_error_in`, :func:`storage_problem`) is named by its cause: no space left,
read-only, permission denied, a file where a directory should be."""
from __future__ import annotations

import errno
from typing import Callable, Optional


class ConfigError(ValueError):
    """A configuration or input the code cannot honour; the message says what is wrong and what is allowed."""


class RunError(RuntimeError):
    """A run had to stop (unwritable checkpoint, too many non-finite steps): the message says why and what was kept."""


def error_in_chain(err: Optional[BaseException], wanted: Callable[[BaseException], bool]) -> Optional[BaseException]:
    """The first ``wanted`` error of ``err``'s chain: itself, then the one it was raised from or while handling, ..."""
    seen = set()
    while err is not None and id(err) not in seen:
        if wanted(err):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def os_error_in(err: Optional[BaseException]) -> Optional[OSError]:
    """The operating system's error behind ``err`` (torch's checkpoint writer reports a full disk as a RuntimeError
    raised while handling the OSError)."""
    return error_in_chain(err, lambda e: isinstance(e, OSError) and e.errno is not None)


def storage_problem(err: OSError) -> str:
    """What went wrong with a path, in words: ``<path>: No space left on device`` (a file in the way of a directory:
    ``<path> is a file, not a directory``)."""
    path = err.filename
    if path is None:
        return err.strerror or errno.errorcode.get(err.errno, str(err.errno))
    if err.errno in (errno.EEXIST, errno.ENOTDIR):
        return f"{path} is a file, not a directory" if err.errno == errno.EEXIST else \
            f"{path}: a part of this path is a file, not a directory"
    return f"{path}: {err.strerror or errno.errorcode.get(err.errno, str(err.errno))}"


def os_error_line(err: BaseException) -> Optional[str]:
    """The one line for an error whose cause is the operating system's (a write that failed), else None."""
    cause = os_error_in(err)
    return None if cause is None else storage_problem(cause)
