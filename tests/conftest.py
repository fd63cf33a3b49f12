import keras
import pytest


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same random state and a fresh dtype policy."""
    keras.utils.set_random_seed(1234)
    yield
    keras.config.set_dtype_policy("float32")
