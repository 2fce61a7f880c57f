"""scikit-learn's handwritten digits: 1797 8x8 images shipped with it, no download."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Digits(NamedTuple):
  """An 80/20 split (stratified, fixed seed), images in [0, 1]."""
  x_train: np.ndarray  # [1437, 8, 8, 1] float32
  y_train: np.ndarray  # [1437] int32
  x_test: np.ndarray   # [360, 8, 8, 1]
  y_test: np.ndarray


def load_digits() -> Digits:
  """Loads the digits bundled with scikit-learn and splits them."""
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  from sklearn import model_selection  # pylint: disable=g-import-not-at-top
  data = datasets.load_digits()
  x = (data.images / 16.0).astype(np.float32)[..., None]
  y = data.target.astype(np.int32)
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
      x, y, test_size=0.2, random_state=0, stratify=y)
  return Digits(x_train, y_train, x_test, y_test)


def batches(num_examples: int, batch_size: int, steps: int,
            seed: int) -> np.ndarray:
  """[steps, batch_size] indices: shuffled epochs, deterministic in `seed`."""
  rng = np.random.RandomState(seed)
  epochs = -(-steps * batch_size // num_examples)
  order = np.concatenate([rng.permutation(num_examples) for _ in range(epochs)])
  return order[:steps * batch_size].reshape(steps, batch_size)
