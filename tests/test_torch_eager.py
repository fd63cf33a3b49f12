"""Keras' projection and norm ops as the torch calls they make
(keras_attn/_torch_eager.py), against `keras.ops` itself."""

import keras
import numpy as np
import pytest

from tests.helpers.backend import BACKEND, to_numpy, torch_tensor
from tests.helpers.builders import random_floats

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's own calls")

EQUATIONS = [  # (equation, input shape, kernel shape, as one matmul)
    ("abc,cde->abde", (2, 5, 8), (8, 2, 4), True),  # queries, keys, values
    ("abcd,cde->abe", (2, 5, 2, 4), (2, 4, 8), True),  # the output projection
    ("...b,bc->...c", (3, 2, 5, 6), (6, 7), True),
    ("abc,bcd->abd", (2, 5, 8), (5, 8, 3), False),  # b kept and contracted
    ("abc,dc->abd", (2, 5, 8), (3, 8), False),  # the kernel's last axis
    ("ab,bb->ab", (2, 3), (3, 3), False),  # a diagonal (EinsumDense builds it)
    ("abb,bbc->ac", (2, 3, 3), (3, 3, 4), False),  # a repeated contracted letter
    ("abc,cde->abde", (0, 5, 8), (8, 2, 4), True),  # an empty batch
]


@pytest.mark.parametrize("equation, x_shape, kernel_shape, matmul", EQUATIONS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_projection_gives_keras_einsum_bit_for_bit(
    equation, x_shape, kernel_shape, matmul, dtype
):
    from keras_attn import _torch_eager as torch_eager

    assert (torch_eager._matmul_form(equation) is not None) == matmul
    x = keras.ops.cast(random_floats(*x_shape, seed=1), dtype)
    kernel = keras.ops.cast(random_floats(*kernel_shape, seed=2), dtype)
    product = keras.ops.einsum(equation, x, kernel)
    bias = keras.ops.cast(random_floats(product.shape[-1], seed=3), dtype)
    expected = keras.ops.add(product, bias)
    result = torch_eager.projection(x, kernel, bias, equation)
    np.testing.assert_array_equal(to_numpy(result), to_numpy(expected))


def test_what_keras_would_cast_is_left_to_it():
    """Mixed dtypes, float64 (Keras 3.15 computes it in float32), integers
    and a float16 matmul (Keras computes it in float32 on a CPU): `None`."""
    from keras_attn import _torch_eager as torch_eager

    x, kernel = random_floats(2, 3), random_floats(3, 4)

    def of(dtype, tensor):
        return keras.ops.cast(tensor, dtype)

    assert torch_eager.projection(of("float32", x), of("bfloat16", kernel)) is None
    for dtype in ("float64", "int32", "float16"):
        assert torch_eager.projection(of(dtype, x), of(dtype, kernel)) is None
    half = torch_eager.projection(
        of("float16", x), of("float16", kernel), None, "ab,bc->ac"
    )
    assert half is not None  # Keras' einsum casts nothing: torch's einsum
    assert torch_eager.layer_norm(of("float64", x), None, None, 1e-3) is None
    assert torch_eager.rms_norm(of("float64", x), None, 1e-3) is None


@pytest.mark.parametrize(
    "equation, x_shape, kernel_shape",
    [
        ("abcd,cde->abe", (2, 3, 4, 8), (8, 4, 5)),  # contracted sizes differ
        ("abc,cd->abd", (2, 3, 4, 8), (8, 5)),  # an input of another rank
    ],
)
def test_shapes_torch_einsum_refuses_still_raise(equation, x_shape, kernel_shape):
    """A matmul of flattened axes would compute something for these; Keras'
    einsum raises, and so does the projection."""

    from keras_attn import _torch_eager as torch_eager

    x, kernel = random_floats(*x_shape), random_floats(*kernel_shape)
    with pytest.raises(RuntimeError):
        keras.ops.einsum(equation, x, kernel)
    with pytest.raises(RuntimeError):
        torch_eager.projection(torch_tensor(x), torch_tensor(kernel), None, equation)


def _permuted(*axes):
    return lambda x: x.permute(*axes)


STRIDED = [  # (equation or None for a matmul, input shape, its view, kernel)
    (None, (3, 5, 6), None, (6, 7)),  # Dense
    (None, (3, 6, 5), _permuted(0, 2, 1), (6, 7)),  # Dense, a transposed input
    (None, (4, 6), None, (6, 7)),  # Dense of a matrix
    # Contiguous, but a size-1 axis's stride is not the next one's times its
    # size: torch's matmul folds it only for a kernel that requires grad.
    (None, (1, 5, 16), lambda x: x[:, -1:], (16, 7)),
    (None, (3, 16, 1), _permuted(0, 2, 1), (16, 7)),
    ("abc,cde->abde", (2, 8, 5), _permuted(0, 2, 1), (8, 2, 4)),
    ("abcd,cde->abe", (2, 2, 5, 4), _permuted(0, 2, 1, 3), (2, 4, 8)),  # SDPA's
]


@pytest.mark.parametrize("equation, x_shape, view, kernel_shape", STRIDED)
@pytest.mark.parametrize("trainable", [True, False])
def test_products_of_strided_inputs_give_keras_numbers_and_gradients(
    equation, x_shape, view, kernel_shape, trainable
):
    """The product runs as a `torch.mm` of views; a strided input, and a
    kernel with or without gradients (where `torch.matmul` may take a batched
    product), give Keras' op's outputs and gradients bit for bit."""

    from keras_attn import _torch_eager as torch_eager

    def run(product):
        x = torch_tensor(random_floats(*x_shape, seed=1), requires_grad=True)
        kernel = torch_tensor(
            random_floats(*kernel_shape, seed=2), requires_grad=trainable
        )
        y = product(x if view is None else view(x), kernel)
        y.backward(torch_tensor(random_floats(*y.shape, seed=3)))
        grads = (x.grad, kernel.grad if trainable else x.grad)
        return [to_numpy(t.detach()) for t in (y, *grads)]

    def keras_op(x, kernel):
        if equation is None:
            return keras.ops.matmul(x, kernel)
        return keras.ops.einsum(equation, x, kernel)

    ours = run(lambda x, kernel: torch_eager.projection(x, kernel, None, equation))
    for result, expected in zip(ours, run(keras_op), strict=True):
        np.testing.assert_array_equal(result, expected)


def test_constants_are_keras_tensors_made_without_walking_the_list(monkeypatch):
    """`constant` gives what Keras' `convert_to_tensor` of the list gives;
    the sinusoids, rotations and ALiBi make their constants with it, never through
    Keras' conversion of a list (about 300 us each on a CPU)."""

    import keras_attn
    from keras_attn import _torch_eager as torch_eager

    like = torch_tensor([0.0])
    floats = [10000.0 ** -(c / 7) for c in range(7)]
    for values, dtype in ((floats, "float32"), ([True, False, True], "bool")):
        ours = torch_eager.constant(values, dtype, like)
        expected = keras.ops.convert_to_tensor(values, dtype=dtype)
        assert ours.dtype == expected.dtype and ours.device == expected.device
        np.testing.assert_array_equal(to_numpy(ours), to_numpy(expected))

    convert = keras.ops.convert_to_tensor

    def refuse_lists(x, *args, **kwargs):
        assert not isinstance(x, list), "a list converted by Keras"
        return convert(x, *args, **kwargs)

    monkeypatch.setattr(keras.ops, "convert_to_tensor", refuse_lists)
    keras_attn.ops.sinusoidal_position_encoding(4, 6, start_index=np.array([0, 2]))
    x = np.ones((1, 3, 2, 4), "float32")
    keras_attn.ops.rotary_embedding(x, np.arange(3))
    keras_attn.ops.alibi_bias(num_heads=2, query_length=3, key_length=3)
    with pytest.raises(AssertionError, match="a list converted"):
        keras.ops.convert_to_tensor([1.0])
