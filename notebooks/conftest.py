"""nbval runs of the notebooks: one sample checkpoint for the whole run.

``make test`` runs every notebook here once, on the sample (tests/test_notebooks.py runs them
on other kinds of checkpoint, and asserts what they show about the sample directly).
Each notebook runs in its own kernel and, given no checkpoint, calls
``ckptkit.examples.sample_checkpoint()``; pointing ``$CKPTKIT_SAMPLES`` at one temporary
directory for the session (inherited by every kernel, removed at the end) makes the first
notebook write the sample and the others reuse it, leaving nothing behind. The items are
marked ``notebooks`` by tests/conftest.py (``CATEGORIES``).
"""

from __future__ import annotations

import contextlib

import pytest

__all__: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    from ckptkit.examples import sample_workspace

    stack = contextlib.ExitStack()
    stack.enter_context(sample_workspace())
    config.add_cleanup(stack.close)
