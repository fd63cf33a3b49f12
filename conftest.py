"""Root conftest: names available to the docstring examples (`--doctest-modules`)."""

import os

# The suite checks numbers at float32 precision (1e-5 against numpy, torch.nn
# and the other backends). JAX on a GPU multiplies float32 matrices at reduced
# (TF32-like) precision by default, so the suite asks for full float32 before
# JAX is imported (here, the first conftest); subprocesses (examples,
# multi-process runs) inherit it. PyTorch multiplies float32 at full precision
# unless told otherwise, and TensorFlow's GPU build is not tested.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_attn  # noqa: E402


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace.update({"np": np, "keras": keras, "keras_attn": keras_attn})
    keras.utils.set_random_seed(0)
