import time, numpy as np, keras, jax
from keras_attn import TransformerEncoder
from tests.helpers.backend import value_and_gradients
from tests.layers.test_segment_ids import *
enc = TransformerEncoder(16, num_heads=2, normalize_first=True, **ROPE); enc.build((2,8,8))
x = random_floats(2, 8, WIDTH); c = random_floats(2,8,8, seed=9)
f = lambda x: enc(x, segment_ids=SEGMENT_IDS, training=True)
t=time.time(); value_and_gradients(jax.jit(f), x, cotangent=c); print("jit fwd + vag", time.time()-t)
f2 = lambda x: enc(x, training=True)
def vg(x, c):
    return jax.value_and_grad(lambda x: (f2(x)*c).sum())(x)
t=time.time(); jax.jit(vg)(x, c); print("jit(vag)", time.time()-t)
f3 = lambda x: enc(x, segment_ids=SEGMENT_IDS[:, :7], training=True)
t=time.time(); value_and_gradients(f3, x[:, :7], cotangent=c[:, :7]); print("eager", time.time()-t)
