"""keras_attn makes every torch tensor on a device it names: the device of
the tensors it was given. A tensor made without one lands on the CPU, while
Keras keeps its weights and inputs on `cuda:0` where a GPU exists; the torch
suite on an H100 (2026-11-28) failed wherever a tensor was made that way
("Expected all tensors to be on the same device"). A CPU cannot show the
fault, so the rule is read from the source."""

import ast
import pathlib

import keras_attn

# torch's factories, which place a tensor on the default device (the CPU)
# unless told otherwise.
FACTORIES = {
    "arange", "as_tensor", "empty", "eye", "from_numpy", "full", "linspace",
    "ones", "rand", "randint", "randn", "tensor", "zeros",
}  # fmt: skip
PACKAGE = pathlib.Path(keras_attn.__file__).parent


def factory_calls_without_a_device(source):
    """`(line, name)` of each `torch.<factory>(...)` in `source` with no
    `device=`; `from_numpy` always (it cannot take one)."""
    for node in ast.walk(ast.parse(source)):
        function = getattr(node, "func", None)
        if not (
            isinstance(node, ast.Call)
            and isinstance(function, ast.Attribute)
            and isinstance(function.value, ast.Name)
            and function.value.id == "torch"
            and function.attr in FACTORIES
        ):
            continue
        if not any(keyword.arg == "device" for keyword in node.keywords):
            yield node.lineno, function.attr


def test_every_torch_tensor_keras_attn_makes_names_its_device():
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: torch.{name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, name in factory_calls_without_a_device(path.read_text())
    ]
    assert found == []


def test_the_scan_sees_a_factory_without_a_device():
    source = "x = torch.zeros(3)\ny = torch.arange(4, device=d)\n"
    assert list(factory_calls_without_a_device(source)) == [(1, "zeros")]
