"""Training helpers for mixed precision with optax."""

from mpolicy._src.training.scaling import *  # pylint: disable=wildcard-import
from mpolicy._src.training.scaling import _cast_like  # pylint: disable=unused-import
from mpolicy._src.training.scaling import _strong  # pylint: disable=unused-import
