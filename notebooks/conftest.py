"""nbval runs of the notebooks: one sample checkpoint for the whole run.

Each notebook runs in its own kernel and, given no checkpoint, calls
``ckptkit.examples.sample_checkpoint()``; pointing ``$CKPTKIT_SAMPLES`` at one temporary
directory for the session (inherited by every kernel, removed at the end) makes the first
notebook write the sample and the others reuse it, leaving nothing behind.
"""

from __future__ import annotations

import contextlib

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from ckptkit.examples import sample_workspace

    stack = contextlib.ExitStack()
    stack.enter_context(sample_workspace())
    config.add_cleanup(stack.close)
