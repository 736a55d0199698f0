"""Suite-wide helpers."""

import os

import pytest

REQUIRE_REAL = os.environ.get("KVSCOPE_REQUIRE_REAL") == "1"


@pytest.fixture
def require_real():
    """`require_real(available, "what is missing")`: skip when a real component is absent, or fail under
    KVSCOPE_REQUIRE_REAL=1 (CI), where every real component must be there."""

    def check(available: bool, missing: str) -> None:
        if available:
            return
        if REQUIRE_REAL:
            pytest.fail(f"{missing} (KVSCOPE_REQUIRE_REAL=1: real components are required)")
        pytest.skip(missing)

    return check
