"""backhalf.db's boundary helpers: driver-error wrapping and the libpq URL."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy.exc import OperationalError

from backhalf.db import libpq_url, wrap_driver_errors
from backhalf.errors import AckStateError, StoreError


@pytest.mark.parametrize(
    "driver_error",
    [psycopg.errors.DeadlockDetected("deadlock"), OperationalError("SELECT 1", {}, Exception("x"))],
)
def test_driver_errors_become_the_named_error_with_context_and_cause(driver_error: Exception) -> None:
    with (
        pytest.raises(StoreError) as info,
        wrap_driver_errors(StoreError, "adapter orders: storing 2 messages"),
    ):
        raise driver_error
    assert (
        str(info.value)
        == f"adapter orders: storing 2 messages: {type(driver_error).__name__}: {driver_error}"
    )
    assert info.value.__cause__ is driver_error


def test_other_errors_pass_through_unwrapped() -> None:
    with pytest.raises(ValueError, match="a bug"), wrap_driver_errors(AckStateError, "claiming"):
        raise ValueError("a bug")


def test_libpq_url_drops_the_driver_and_keeps_the_password() -> None:
    url = "postgresql+psycopg://app:s3cr%40t@db.example:5433/switchboard?sslmode=require"
    assert libpq_url(url) == "postgresql://app:s3cr%40t@db.example:5433/switchboard?sslmode=require"
    assert libpq_url("postgresql://app@localhost/x") == "postgresql://app@localhost/x"
