"""The Keras releases keras_attn supports, and each Keras internal it leans on.

Ground floor, as `_checks`: it imports `keras` and nothing of ours. Every
other module uses public Keras; where one cannot, it takes the internal from
here, where it is checked exactly against the installed Keras (what a
function accepts, not only that it exists), and `tests/test_keras_compat.py`
fails when a Keras release moves it.

- `MINIMUM_KERAS`: the oldest Keras supported, refused at import below it
  (`check_keras_version`). keras-hub 0.32, which the keras-hub converters
  and the tests read, needs Keras 3.15; so do the internals below.
- `get_autocast_scope`: Keras' autocast scope, which no public API reads
  (`layers/_lean_call.py` asks whether `Layer.__call__` would change it).
- `in_stateless_scope`: whether a call runs in Keras' stateless scope (a JAX
  trainer's step), where `_checks` reads no value (`_checks.in_keras_step`).
- `INT8_ROUTE`: where Keras' int8 `Dense` and `EinsumDense` contract their
  int8 operands, for `layers/_int8.py` to pad on XLA GPUs:
  - `"int8_call"` (Keras 3.15): each layer's `_int8_call`, with
    `inputs_quantizer(inputs, axis=...)`, `quantization_axis` (set by
    `EinsumDense._set_quantization_info`) and `_adjust_scale_for_quant`;
  - `"geometry"` (Keras 3.16): every quantized call goes through
    `keras.src.quantizers.strategy_registry`, whose strategies contract
    through the layer's `_quantization_geometry().contract(inputs, kernel)`
    (`PROJECTION_GEOMETRIES`);
  - `None`: neither; `_int8` then refuses to run where it must pad.
"""

import inspect
import re

import keras

MINIMUM_KERAS = (3, 15)


def keras_version(version=None):
    """`(major, minor, patch)` of `version` (the installed Keras' by
    default); a development release (`3.16.0.dev2026...`) counts as its
    release."""
    version = keras.version() if version is None else version
    numbers = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(number or 0) for number in numbers.groups())


def check_keras_version(version=None):
    """Raises an ImportError naming the Keras needed below `MINIMUM_KERAS`."""
    version = keras.version() if version is None else version
    if keras_version(version) < MINIMUM_KERAS:
        needed = ".".join(map(str, MINIMUM_KERAS))
        raise ImportError(
            f"keras_attn needs Keras >= {needed}. Received: Keras {version}. "
            f'Upgrade it: `pip install -U "keras>={needed}"`.'
        )


check_keras_version()  # at import: before anything leans on a Keras it lacks

try:  # no public way to read the autocast scope (Keras 3.15, 3.16)
    from keras.src.backend.common.variables import get_autocast_scope
except ImportError:  # a Keras that moved it: every sublayer through `__call__`
    get_autocast_scope = None

try:  # no public way to ask for the stateless scope (Keras 3.15, 3.16)
    from keras.src.backend.common.stateless_scope import in_stateless_scope
except ImportError:  # a Keras that moved it: values read as before
    in_stateless_scope = None


def _accepts(function, name):
    """Whether `function` takes an argument called `name`."""
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def _projection_geometries():
    """Keras 3.16's projection geometries, `(Dense's, EinsumDense's)`, if the
    int8 strategy contracts through them; else `None`."""
    try:
        from keras.src.quantizers import geometry
    except ImportError:
        return None
    classes = (
        getattr(geometry, "ProjectionGeometry", None),
        getattr(geometry, "EinsumProjectionGeometry", None),
    )
    for cls, layer in zip(
        classes, (keras.layers.Dense, keras.layers.EinsumDense), strict=True
    ):
        if cls is None or type(_geometry_of(layer)) is not cls:
            return None  # the layer no longer contracts through `cls`
        if not (_accepts(cls.contract, "inputs") and _accepts(cls.contract, "kernel")):
            return None
    return classes


def _geometry_of(layer_class):
    """The geometry `layer_class._quantization_geometry` gives (Keras 3.16's
    reads no attribute of the layer), or `None` where there is none or it
    cannot be had so: read at import, where nothing may raise."""
    method = getattr(layer_class, "_quantization_geometry", None)
    try:
        return None if method is None else method(None)
    except Exception:  # another Keras's method, which reads the layer
        return None


def _int8_call_route():
    """Whether Keras 3.15's `_int8_call` route is there, exactly as
    `_int8.py` calls it."""
    from keras.quantizers import AbsMaxQuantizer

    return (
        hasattr(keras.layers.Dense, "_int8_call")
        and hasattr(keras.layers.EinsumDense, "_int8_call")
        and hasattr(keras.layers.EinsumDense, "_adjust_scale_for_quant")
        and hasattr(keras.layers.EinsumDense, "_set_quantization_info")
        and _accepts(AbsMaxQuantizer.__call__, "axis")
    )


PROJECTION_GEOMETRIES = _projection_geometries()
if PROJECTION_GEOMETRIES is not None:
    INT8_ROUTE = "geometry"
elif _int8_call_route():
    INT8_ROUTE = "int8_call"
else:
    INT8_ROUTE = None
