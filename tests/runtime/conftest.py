"""Runtime unit tests run the overlay's deep checks (VTOKEN_CHECK_INTEGRITY=1)."""

import pytest

from vllm.vtoken import integrity


@pytest.fixture(autouse=True)
def deep_checks(monkeypatch):
    monkeypatch.setattr(integrity, "CHECK", True)
