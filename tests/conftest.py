"""Shared test set-up: every test starts and ends with an empty registry."""

import pytest

import mpolicy


@pytest.fixture(autouse=True)
def _empty_registry():
  mpolicy.clear_policies()
  yield
  mpolicy.clear_policies()
