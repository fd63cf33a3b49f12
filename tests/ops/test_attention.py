"""`keras_attn.ops.dot_product_attention`, the one attention dispatcher:
against its float64 formula (masks of every rank, soft caps, empty rows), its
dispatch table, float64 inputs, and the chunked explicit path."""

import contextlib

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn import ops as attn_ops
from keras_attn.ops import attention, plan
from tests.helpers.backend import (
    BACKEND,
    has_accelerator,
    programs_compiled,
    to_numpy,
    value_and_gradients,
)
from tests.helpers.builders import random_floats
from tests.helpers.doubles import recorded
from tests.helpers.references import dot_product_reference


def test_soft_capped_attention_matches_the_formula():
    q, k, v = (
        random_floats(2, 3, 4, 8, scale=4.0),
        random_floats(2, 5, 2, 8),
        random_floats(2, 5, 2, 8, seed=1),
    )
    mask = np.tril(np.ones((3, 5), bool), 2)
    output = attn_ops.dot_product_attention(q, k, v, mask=mask, logit_soft_cap=2.0)
    expected, _ = dot_product_reference(q, k, v, mask, soft_cap=2.0)
    np.testing.assert_allclose(to_numpy(output), expected, atol=2e-5)
    uncapped = to_numpy(attn_ops.dot_product_attention(q, k, v, mask=mask))
    assert not np.allclose(uncapped, expected, atol=1e-3)
    with pytest.raises(ValueError, match=r"logit_soft_cap=0"):
        attn_ops.dot_product_attention(q, k, v, logit_soft_cap=0)
    with pytest.raises(ValueError, match=r"cannot compute attention with soft-capped"):
        attn_ops.dot_product_attention(
            q, k, v, flash_attention=True, logit_soft_cap=2.0
        )


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's product with its addends")
@pytest.mark.parametrize(
    "heads_major, kv_heads, mask_shape, bias_shape",
    [
        (False, 4, (3, 5), None),  # the same for every row: in the product
        (True, 2, (2, 1, 1, 5), (1, 4, 3, 5)),  # per batch row, per head: after
        (False, 1, (2, 4, 3, 5), (2, 4, 3, 5)),  # whole: in the product
        (True, 2, None, (2, 1, 3, 5)),  # per batch row: after
    ],
)
def test_masked_logits_are_the_product_then_the_bias_and_the_mask(
    heads_major, kv_heads, mask_shape, bias_shape, monkeypatch
):
    """`explicit.masked_logits` on PyTorch (`torch_logits`: the addends in
    the product where they broadcast over its batch, else added after it)
    equals the einsum, then the bias, then the mask added, and so do its
    gradients: grouped heads (query head `h` reads key head `h // G`), heads-
    major keys, masks and biases of every broadcast (float64:
    `test_float64_attention_is_computed_in_float64`)."""
    from keras_attn.ops.kernels import explicit
    from keras_attn.ops.kernels.options import KernelOptions

    q = random_floats(2, 3, 4, 8)
    k = random_floats(*((2, kv_heads, 5) if heads_major else (2, 5, kv_heads)), 8)
    mask = None
    if mask_shape:
        mask = np.random.default_rng(3).random(mask_shape) > 0.3
        mask = keras.ops.convert_to_tensor(mask)
    options = KernelOptions(scale=1.0, heads_major=heads_major)
    products = count_products(monkeypatch)

    arrays = (q, k, random_floats(*bias_shape, seed=2)) if bias_shape else (q, k)

    def ours(q, k, bias=None):
        return explicit.masked_logits(q, k, bias, mask, options)

    def reference(q, k, bias=None):
        return explicit.masked(explicit.logits(q, k, bias, options), mask)

    ours = value_and_gradients(ours, *arrays)
    assert products == [(2, 3, 4, 8)]
    reference = value_and_gradients(reference, *arrays)
    for x, y in zip((ours[0], *ours[1]), (reference[0], *reference[1]), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-5)


def count_products(monkeypatch):
    """The query shapes `torch_logits.masked_logits` was called with."""
    from keras_attn.ops.kernels import torch_logits

    def query_shape(query, *args):
        return tuple(query.shape)

    return recorded(monkeypatch, torch_logits, "masked_logits", query_shape)


@pytest.mark.parametrize("flash_attention", [None, False])
@pytest.mark.parametrize("kv_heads", [3, 1])
def test_dot_product_attention_matches_numpy_with_masks(flash_attention, kv_heads):
    q = random_floats(2, 5, 3, 4, seed=0)
    k, v = (random_floats(2, 5, kv_heads, 4, seed=s) for s in (1, 2))
    padding = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    mask = padding[:, None, None, :] & np.tril(np.ones((5, 5), bool))
    expected, _ = dot_product_reference(q, k, v, mask)
    for padding_mask in (padding[:, None, None, :], padding[:, None, :]):  # ranks 4, 3
        out = attn_ops.dot_product_attention(
            q, k, v, mask=padding_mask, is_causal=True, flash_attention=flash_attention
        )
        np.testing.assert_allclose(to_numpy(out), expected, atol=1e-5, rtol=1e-5)
    causal = np.tril(np.ones((5, 5), bool))  # rank 2
    out = attn_ops.dot_product_attention(
        q, k, v, mask=causal, flash_attention=flash_attention
    )
    np.testing.assert_allclose(
        to_numpy(out), dot_product_reference(q, k, v, causal)[0], atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("flash_attention", [None, False])
def test_rows_that_attend_to_nothing_give_zeros(flash_attention):
    q = random_floats(1, 3, 2, 4)
    mask = np.array([[True, False, True], [False, False, False], [True, True, True]])
    out = to_numpy(
        attn_ops.dot_product_attention(
            q, q, q, mask=mask, flash_attention=flash_attention
        )
    )
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[0, 1], 0.0)
    assert np.abs(out[0, 0]).sum() > 0


def test_scores_come_from_the_explicit_path():
    q = random_floats(1, 3, 2, 4)
    out, scores = attn_ops.dot_product_attention(q, q, q, return_scores=True)
    np.testing.assert_allclose(to_numpy(scores).sum(-1), 1.0, atol=1e-6)
    np.testing.assert_allclose(
        to_numpy(out), to_numpy(attn_ops.dot_product_attention(q, q, q)), atol=1e-6
    )


@pytest.mark.skipif(BACKEND != "jax", reason="JAX compiles each eager op")
@pytest.mark.parametrize("flash_attention", [None, False])
def test_an_eager_call_on_jax_compiles_one_program(caplog, flash_attention):
    """On JAX an eager call folds its masks and runs its kernel as one XLA
    program (`keras_attn/_jax_eager.py`), not one per op: at shapes not seen
    before it compiles that one (no product on its own), and then nothing;
    the numbers are the formula's."""
    q, k, v = (random_floats(2, 11, 4, 8, seed=n) for n in range(3))
    mask = keras.ops.convert_to_tensor(np.tril(np.ones((2, 1, 11, 11), bool), 2))
    outputs = []

    def call():
        outputs.append(
            attention.attend(
                q, k, v, mask, band=(5, 1), flash_attention=flash_attention
            )
        )

    compiled = programs_compiled(lambda: (call(), call()), caplog)
    assert compiled.count("jit(compiled)") == 1, compiled  # for both calls
    assert "jit(_einsum)" not in compiled, compiled
    rows, keys = np.ogrid[:11, :11]
    band = (np.abs(rows - keys) < 5) | (keys < 1)  # a window of 5, 1 sink
    expected, _ = dot_product_reference(q, k, v, to_numpy(mask) & band)
    np.testing.assert_allclose(to_numpy(outputs[0]), expected, atol=1e-5)


def test_variable_inputs_take_the_ops():
    """`keras.Variable`s give what their values give (on JAX a variable is
    no eager program's argument: `_jax_eager.eager`)."""
    x = random_floats(2, 5, 4, 8)
    variable = keras.Variable(x)
    np.testing.assert_allclose(
        to_numpy(attn_ops.dot_product_attention(variable, variable, variable)),
        to_numpy(attn_ops.dot_product_attention(x, x, x)),
        atol=1e-6,
    )
    np.testing.assert_allclose(
        to_numpy(attn_ops.rotary_embedding(variable, np.arange(5))),
        to_numpy(attn_ops.rotary_embedding(x, np.arange(5))),
        atol=1e-6,
    )


def test_symbolic_inputs_build_a_functional_model(tmp_path):
    """`keras.Input`s give the outputs' `KerasTensor`s, and a functional
    model built from them computes and saves what the eager calls give: the
    op is a node of the model (`attention.DotProductAttention`), as the
    functions of `keras.ops` are (before it, the explicit path lost the
    output's width on every backend and the fused kernel got the
    `KerasTensor` on PyTorch)."""
    q, k, v = keras.Input((5, 4, 8)), keras.Input((7, 2, 8)), keras.Input((7, 2, 3))
    ids = keras.Input((5,), dtype="int32")
    output = attn_ops.dot_product_attention(q, k, v, is_causal=True)
    packed = attn_ops.dot_product_attention(
        attn_ops.rotary_embedding(q, attn_ops.segment_positions(ids)),
        q, q, query_segment_ids=ids, logit_soft_cap=5.0,
    )  # fmt: skip
    heads_major = [keras.ops.transpose(x, (0, 2, 1, 3)) for x in (k, v)]
    scores = attn_ops.dot_product_attention(
        q, *heads_major, heads_major=True, return_scores=True
    )
    assert [tuple(x.shape) for x in (output, packed, *scores)] == [
        (None, 5, 4, 3), (None, 5, 4, 8), (None, 5, 4, 3), (None, 4, 5, 7),
    ]  # fmt: skip
    rotated = attn_ops.rotary_embedding(q, np.arange(5))
    assert tuple(rotated.shape) == (None, 5, 4, 8)
    half = keras.Input((5, 4, 8), dtype="bfloat16")
    assert attn_ops.dot_product_attention(half, half, half).dtype == "bfloat16"
    model = keras.Model([q, k, v, ids], [output, packed, scores[1]])
    numbers = [random_floats(2, 5, 4, 8), random_floats(2, 7, 2, 8, seed=1)]
    numbers += [random_floats(2, 7, 2, 3, seed=2)]
    numbers.append(np.array([[1, 1, 2, 2, 2], [3, 3, 3, 3, 4]], "int32"))
    q, k, v, ids = numbers
    positions = attn_ops.segment_positions(ids)
    expected = [
        attn_ops.dot_product_attention(q, k, v, is_causal=True),
        attn_ops.dot_product_attention(
            attn_ops.rotary_embedding(q, positions),
            q,
            q,
            query_segment_ids=ids,
            logit_soft_cap=5.0,
        ),
        attn_ops.dot_product_attention(q, k, v, return_scores=True)[1],
    ]
    path = tmp_path / "ops.keras"
    model.save(path)
    for tested in (model, keras.saving.load_model(path)):
        for got, want in zip(tested.predict(numbers, verbose=0), expected, strict=True):
            np.testing.assert_allclose(got, to_numpy(want), atol=1e-5)


def test_symbolic_inputs_are_refused_what_an_eager_call_is():
    """At the call, once, as for tensors: what no kernel can honour (the
    plan's refusals), and `dropout`, which a functional model could neither
    track nor save."""
    q = keras.Input((5, 4, 8))
    with pytest.raises(ValueError, match=r"`flash_attention=True` needs"):
        attn_ops.dot_product_attention(
            q, q, q, flash_attention=True, return_scores=True
        )
    with pytest.raises(ValueError, match=r"symbolic inputs .* takes no `dropout`"):
        attn_ops.dot_product_attention(q, q, q, dropout=keras.layers.Dropout(0.1))


@pytest.mark.parametrize(
    "kwargs, value_dim, fused",
    [
        ({}, 4, BACKEND != "tensorflow"),
        ({"flash_attention": False}, 4, False),
        ({"return_scores": True}, 4, False),
        ({"dropout": lambda weights: weights}, 4, False),
        ({}, 3, False),  # values of another width
        ({"heads_major": True}, 4, BACKEND != "tensorflow"),
    ],
)
def test_the_dispatch_table(fused_calls, kwargs, value_dim, fused):
    q = random_floats(2, 1, 4, 4)
    k = (
        random_floats(2, 2, 5, 4)
        if kwargs.get("heads_major")
        else random_floats(2, 5, 2, 4)
    )
    v = random_floats(*k.shape[:-1], value_dim)
    keras_attn.ops.dot_product_attention(q, k, v, **kwargs)
    assert bool(fused_calls) == fused


@pytest.mark.parametrize(
    "kwargs, value_width, refused",
    [
        ({"return_scores": True}, 4, "returning the attention weights"),
        ({"dropout": lambda weights: weights}, 4, "dropout"),
        ({}, 3, "values of another width"),
    ],
)
def test_flash_attention_true_refuses_what_the_flash_kernel_cannot_do(
    kwargs, value_width, refused
):
    q = random_floats(2, 3, 2, 4)
    v = random_floats(2, 3, 2, value_width)
    with pytest.raises(
        ValueError, match=rf"`flash_attention=True` needs the fused.*{refused}"
    ):
        attn_ops.dot_product_attention(q, q, v, flash_attention=True, **kwargs)


@contextlib.contextmanager
def float64_enabled():
    """JAX computes in float32 unless 64-bit types are enabled."""
    if BACKEND != "jax":
        yield
        return
    import jax

    with jax.enable_x64(True):
        yield


def test_float64_attention_is_computed_in_float64(fused_calls):
    """Keras' fused op returns float32 for float64 on JAX and PyTorch: the
    dispatcher takes the explicit path, which keeps float64 logits."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=s) for s in [(2, 3, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8)])
    mask = rng.random((2, 1, 3, 5)) > 0.3
    with float64_enabled():
        output = attn_ops.dot_product_attention(q, k, v, mask=mask)
        assert keras.backend.standardize_dtype(output.dtype) == "float64"
        output = keras.ops.convert_to_numpy(output)
        with pytest.raises(ValueError, match="float64 inputs"):
            attn_ops.dot_product_attention(q, k, v, flash_attention=True)
    np.testing.assert_allclose(
        output, dot_product_reference(q, k, v, mask)[0], atol=1e-12
    )
    assert not fused_calls


CHUNK_CASES = {  # name: (query length, key length, is_causal, mask, bias, options)
    "causal self-attention, padding, grouped heads": (11, 11, True, "keys", None, {}),
    "a mask per row, a bias per row": (11, 11, False, "rows", "rows", {}),
    "cross-attention, an ALiBi-like bias": (7, 9, False, None, "heads", {}),
    "causal, rows left empty, soft cap": (
        10,
        10,
        True,
        "empty",
        None,
        {"logit_soft_cap": 2.0},
    ),
    "heads-major caches, causal, one key/value head": (
        9,
        9,
        True,
        None,
        None,
        {"heads_major": True},
    ),
}


def chunk_case(name):
    length, key_length, causal, mask, bias, options = CHUNK_CASES[name]
    rng = np.random.default_rng(1)
    kv_heads = 1 if options.get("heads_major") else 2
    q = random_floats(2, length, 4, 8, seed=1)
    k, v = (random_floats(2, key_length, kv_heads, 8, seed=s) for s in (2, 3))
    masks = {
        None: None,
        "keys": rng.random((2, 1, 1, key_length)) > 0.3,
        "rows": rng.random((2, 1, length, key_length)) > 0.4,
        "empty": np.arange(length)[None, None, :, None] % 3 > 0,  # (1, 1, T, 1)
    }
    biases = {
        None: None,
        "rows": random_floats(1, 4, length, key_length, seed=4),
        "heads": random_floats(1, 4, 1, key_length, seed=5),
    }
    return q, k, v, masks[mask], biases[bias], causal, options


@pytest.mark.parametrize("name", list(CHUNK_CASES))
def test_chunked_attention_equals_the_materialized_path(small_chunks, name):
    """Values and gradients (query, keys, values, bias), padded last chunk
    included (lengths 7-11 in chunks of 4)."""
    q, k, v, mask, bias, causal, options = chunk_case(name)
    major = options.get("heads_major")
    kk, vv = (np.transpose(x, (0, 2, 1, 3)) if major else x for x in (k, v))
    inputs = [q, kk, vv] + ([] if bias is None else [bias])

    def attend(q, k, v, *bias):
        return attn_ops.dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            bias=bias[0] if bias else None,
            is_causal=causal,
            flash_attention=False,
            **options,
        )

    chunked = value_and_gradients(attend, *inputs)
    assert small_chunks.calls, "the chunked path did not run"
    small_chunks()
    materialized = value_and_gradients(attend, *inputs)
    for ours, theirs in zip(
        keras.tree.flatten(chunked), keras.tree.flatten(materialized), strict=True
    ):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    full_mask = mask
    if causal:
        lower = np.tril(np.ones((q.shape[1], k.shape[1]), bool))
        full_mask = lower if mask is None else mask & lower
    expected, _ = dot_product_reference(
        q, k, v, full_mask, bias, options.get("logit_soft_cap")
    )
    np.testing.assert_allclose(chunked[0], expected, atol=1e-5, rtol=1e-5)
    if name.startswith("causal, rows left empty"):
        np.testing.assert_array_equal(chunked[0][:, ::3], 0.0)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, {"tensorflow": "chunked", "jax": "chunked", "torch": "fused"}),
        ({"flash_attention": False}, "chunked"),
        ({"return_scores": True}, "materialized"),
        ({"dropout": lambda weights: weights}, "materialized"),
    ],
)
def test_long_inputs_go_in_chunks_where_no_fused_kernel_runs(
    small_chunks, fused_calls, kwargs, expected
):
    """On a CPU: XLA's CPU attention (JAX) materializes the logits, PyTorch's
    CPU kernel does not, and TensorFlow has none."""
    if isinstance(expected, dict):
        expected = expected[BACKEND]
        if BACKEND == "jax" and has_accelerator():
            expected = "fused"
    q = random_floats(1, 9, 2, 4)
    attn_ops.dot_product_attention(q, q, q, **kwargs)
    used = (
        "fused" if fused_calls else "chunked" if small_chunks.calls else "materialized"
    )
    assert used == expected


@pytest.mark.skipif(BACKEND != "jax", reason="XLA reports a compiled step's memory")
def test_chunked_gradient_memory_grows_linearly_in_the_length(monkeypatch):
    """The compiled gradient's scratch memory: doubling the length doubles it
    in chunks, and quadruples it materialized."""
    import jax

    monkeypatch.setattr(plan, "CHUNK_LOGITS", 2**16)

    def scratch_bytes(length, chunked_from):
        monkeypatch.setattr(plan, "CHUNKED_FROM", chunked_from)
        q = np.ones((1, length, 4, 16), "float32")

        def loss(q, k, v):
            return keras.ops.sum(
                attn_ops.dot_product_attention(q, k, v, flash_attention=False)
            )

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile()
        return step.memory_analysis().temp_size_in_bytes

    chunked = scratch_bytes(2048, 1) / scratch_bytes(1024, 1)
    materialized = scratch_bytes(2048, float("inf")) / scratch_bytes(1024, float("inf"))
    assert chunked < 2.5 and materialized > 3.5, (chunked, materialized)
