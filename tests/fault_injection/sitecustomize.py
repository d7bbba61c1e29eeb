"""Loaded at the start of every Python process that has this folder on PYTHONPATH (tests/helpers_fault.py's
flip_env): the tensor named by TEST_FLIP_ON_ARRIVAL arrives with a flipped byte at this process's ranks
(of rank key TEST_FLIP_RANK only, if set), in their first TEST_FLIP_TIMES syncs (every sync if unset).
skew_env: the FP8 ranks (of rank key TEST_SKEW_RANK only, if set) install the tensor named by
TEST_SKEW_INSTALLED quantized from a skewed copy."""

import os

if os.environ.get("TEST_FLIP_ON_ARRIVAL"):
    import pytest

    from tests.helpers_fault import FLIP_RANK_VARIABLE, FLIP_TIMES_VARIABLE, FLIP_VARIABLE, patch_sink

    times = os.environ.get(FLIP_TIMES_VARIABLE)
    patch_sink(pytest.MonkeyPatch(), os.environ[FLIP_VARIABLE], os.environ.get(FLIP_RANK_VARIABLE) or None,
               int(times) if times else None)

if os.environ.get("TEST_SKEW_INSTALLED"):
    import pytest

    from tests.helpers_fault import SKEW_RANK_VARIABLE, SKEW_VARIABLE, skew_installed

    skew_installed(pytest.MonkeyPatch(), os.environ[SKEW_VARIABLE], os.environ.get(SKEW_RANK_VARIABLE) or None)
