"""The applications behind ``train.py``, ``eval.py`` and ``tools/``: each builds what it needs from the engine, the
models and the tasks, and none is imported by them."""
