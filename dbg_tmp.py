import numpy as np, keras
from keras_attn import MultiHeadAttention
from tests.layers.test_segment_ids import *
layer = MultiHeadAttention(num_heads=2, num_key_value_heads=1, **ROPE)
x = random_floats(2, 8, WIDTH, seed=1)
layer(x[:1,:3])
p = to_numpy(layer(x, segment_ids=SEGMENT_IDS))
q, _ = value_and_gradients(lambda x: layer(x, segment_ids=SEGMENT_IDS), x)
a, _ = value_and_gradients(lambda x: layer(x), documents(x)[0])
print(np.abs(p-q).max(), documents(p)[0][0,0], a[0,0], to_numpy(layer(documents(x)[0]))[0,0])
import jax
pj = to_numpy(jax.jit(lambda x: layer(x, segment_ids=SEGMENT_IDS))(x))
aj = to_numpy(jax.jit(lambda x: layer(x))(documents(x)[0]))
print(np.abs(pj-p).max(), np.abs(aj-a).max())
pj = to_numpy(jax.jit(lambda x: layer(x, segment_ids=SEGMENT_IDS, use_causal_mask=False))(x))
print(np.abs(pj-p).max())
