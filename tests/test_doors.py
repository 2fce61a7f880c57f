"""The doors per audience (`mpolicy.training`, `mpolicy.debug`,
`mpolicy.checkpoint`) hold the same objects as the flat names of `mpolicy`,
and the first-day names `mpolicy`'s docstring lists all exist."""

import importlib
import re

import pytest

import mpolicy

DOORS = ("mpolicy.training", "mpolicy.debug", "mpolicy.checkpoint")


@pytest.mark.parametrize("door", DOORS)
def test_each_name_of_a_door_is_the_flat_name(door):
  module = importlib.import_module(door)
  assert module.__all__, door
  for name in module.__all__:
    assert name in mpolicy.__all__, f"{door}.{name} is not a name of mpolicy"
    assert getattr(module, name) is getattr(mpolicy, name), f"{door}.{name}"


def test_the_doors_do_not_overlap():
  seen = {}
  for door in DOORS:
    for name in importlib.import_module(door).__all__:
      assert name not in seen, f"{name} in both {seen.get(name)} and {door}"
      seen[name] = door


def test_the_first_day_names_exist():
  first_day = mpolicy.__doc__.split("First day:")[1].split("\n\n")[0]
  names = re.findall(r"`([A-Za-z_]+)`", first_day)
  assert len(names) >= 6, first_day
  missing = [n for n in names if n not in mpolicy.__all__]
  assert not missing, missing
