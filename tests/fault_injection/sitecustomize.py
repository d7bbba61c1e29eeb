"""Loaded at the start of every Python process that has this folder on PYTHONPATH (tests/helpers_fault.py's
flip_env): the tensor named by TEST_FLIP_ON_ARRIVAL arrives with a flipped byte at this process's ranks."""

import os

if os.environ.get("TEST_FLIP_ON_ARRIVAL"):
    import pytest

    from tests.helpers_fault import FLIP_VARIABLE, patch_sink

    patch_sink(pytest.MonkeyPatch(), os.environ[FLIP_VARIABLE])
