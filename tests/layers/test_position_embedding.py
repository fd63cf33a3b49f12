"""`PositionEmbedding`: learned positions added from `start_index` on, per
row too, in a saved model; runs past the table raise."""

import os

import keras
import numpy as np
import pytest

from keras_attn.models import PositionEmbedding
from tests.helpers.backend import to_numpy
from tests.helpers.builders import random_floats


def built(length=6, width=4):
    layer = PositionEmbedding(length)
    layer.build((None, None, width))
    layer.embeddings.assign(random_floats(length, width, seed=1))
    return layer


def test_adds_the_rows_from_start_index_on_per_row_too():
    layer, x = built(), random_floats(2, 3, 4)
    table = to_numpy(layer.embeddings)
    np.testing.assert_allclose(to_numpy(layer(x)), x + table[None, :3], atol=1e-7)
    np.testing.assert_allclose(
        to_numpy(layer(x, start_index=2)), x + table[None, 2:5], atol=1e-7
    )
    per_row = to_numpy(layer(x, start_index=np.array([3, -1], "int32")))
    np.testing.assert_allclose(per_row[0], x[0] + table[3:6], atol=1e-7)
    # Positions below 0 (left padding in `generate`) take row 0.
    np.testing.assert_allclose(per_row[1], x[1] + table[[0, 0, 1]], atol=1e-7)


def test_a_run_past_the_table_raises():
    layer, x = built(), random_floats(2, 3, 4)
    with pytest.raises(ValueError, match="holds 6 positions.*position 6"):
        layer(x, start_index=4)
    with pytest.raises(ValueError, match="sequence_length"):
        PositionEmbedding(0)


def test_saves_and_reloads_in_a_model(tmp_path):
    inputs = keras.Input((None, 4))
    model = keras.Model(inputs, PositionEmbedding(8, name="positions")(inputs))
    x = random_floats(2, 5, 4)
    path = os.path.join(tmp_path, "positions.keras")
    model.save(path)
    reloaded = keras.models.load_model(path)
    np.testing.assert_array_equal(to_numpy(reloaded(x)), to_numpy(model(x)))
    assert reloaded.get_layer("positions").get_config()["sequence_length"] == 8
