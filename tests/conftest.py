"""Shared by every test directory: each test starts without plans (cula_core.plans), so a plan made under one test's
settings (a monkeypatched dispatch table, a forced backend) never serves another test's calls."""

import pytest


@pytest.fixture(autouse=True)
def _no_plans():
    from cula_core import plans

    plans.forget()
    yield
