"""Root conftest: names available to the docstring examples (`--doctest-modules`)."""

import keras
import numpy as np
import pytest

import keras_attn


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace.update({"np": np, "keras": keras, "keras_attn": keras_attn})
    keras.utils.set_random_seed(0)
