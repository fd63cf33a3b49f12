"""Every family `from_hugging_face` loads, by `model_type`."""

from keras_attn.models.hugging_face._families import DENSE_FAMILIES
from keras_attn.models.hugging_face._sparse_families import SPARSE_FAMILIES

FAMILIES = {**DENSE_FAMILIES, **SPARSE_FAMILIES}


def read_family(config, dtype):
    """`(spec, links)` of the config's family."""
    return FAMILIES[config.family](config, dtype)
