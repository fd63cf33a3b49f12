"""The models most generation tests decode: one of each per test module."""

import pytest

from tests.helpers.builders import GENERATION_VOCAB as VOCAB
from tests.helpers.builders import GENERATION_WIDTH as WIDTH
from tests.helpers.builders import decoder_only_model, encoder_decoder_model


@pytest.fixture(scope="module")
def gpt():
    return decoder_only_model(VOCAB, WIDTH, num_key_value_heads=2)


@pytest.fixture(scope="module")
def translator():
    return encoder_decoder_model(
        VOCAB, WIDTH, decoders=({"num_key_value_heads": 2}, {})
    )
