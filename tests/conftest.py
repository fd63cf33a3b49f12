import keras
import pytest


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same random state and a fresh dtype policy."""
    keras.utils.set_random_seed(1234)
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture
def fused_calls(monkeypatch):
    """Records the key shapes `keras.ops.dot_product_attention` receives."""
    calls = []
    original = keras.ops.dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        calls.append(tuple(key.shape))
        return original(query, key, value, *args, **kwargs)

    monkeypatch.setattr(keras.ops, "dot_product_attention", spy)
    return calls
