"""Shared test set-up: every test starts and ends with an empty registry,
and a module's 8-device facts are computed once (`eight_devices`)."""

import pytest

import mpolicy
from _helpers import facts_on_eight_devices


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
  """A test marked ``ci`` is slow too: the default run leaves it out, and
  CI's newest job runs it after the default run (``-m ci``)."""
  for item in items:
    if item.get_closest_marker("ci") is not None:
      item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _empty_registry():
  mpolicy.clear_policies()
  yield
  mpolicy.clear_policies()


@pytest.fixture(scope="module")
def eight_devices(request) -> dict:
  """The facts the test module's ``EIGHT_DEVICES`` script prints, computed
  once per module in a Python with 8 simulated CPU devices (this process
  keeps its one device). The script prints one line ``FACTS=<json>``; it
  may import the tests' `_helpers`."""
  script = getattr(request.module, "EIGHT_DEVICES", None)
  if script is None:
    raise RuntimeError(f"{request.module.__name__} uses the eight_devices "
                       "fixture but defines no EIGHT_DEVICES script")
  return facts_on_eight_devices(script)
