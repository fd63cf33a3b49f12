"""Whole models: training with `fit`, `.keras` files across processes and backends."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from tests.helpers.backend import BACKEND, installed_backends
from tests.helpers.builders import encoder_decoder_model, llama_model

VOCAB, LENGTH, WIDTH = 12, 6, 32
BACKENDS = installed_backends()

LOAD_AND_PREDICT = textwrap.dedent(
    """
    import sys
    import keras
    import numpy as np
    import keras_attn  # registers the layers

    # (model, inputs, output) triples: predictions of each model on its inputs.
    for model_path, data_path, out in zip(*[iter(sys.argv[1:])] * 3):
        model = keras.models.load_model(model_path)
        data = np.load(data_path)
        inputs = [data[f"input_{i}"] for i in range(len(data.files))]
        predictions = model(inputs if len(inputs) > 1 else inputs[0])
        np.save(out, keras.ops.convert_to_numpy(predictions))
    """
)


def copy_task(n, seed):
    """Copy digits 2..11 with teacher forcing: decoder input is BOS(1) + prefix."""
    rng = np.random.default_rng(seed)
    source = rng.integers(2, VOCAB, (n, LENGTH)).astype("int32")
    lengths = rng.integers(3, LENGTH + 1, n)
    source[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    decoder_in = np.concatenate([np.ones((n, 1), "int32"), source[:, :-1]], axis=1)
    decoder_in[source == 0] = 0
    return source, decoder_in, source


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model = encoder_decoder_model(
        VOCAB, WIDTH, intermediate_dim=64, num_encoders=2, seed=0
    )
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    source, decoder_in, labels = copy_task(1024, seed=0)
    history = model.fit(
        [source, decoder_in],
        labels,
        sample_weight=(labels != 0).astype("float32"),
        batch_size=64,
        epochs=12,
        verbose=0,
    )
    path = tmp_path_factory.mktemp("model") / f"copy_{BACKEND}.keras"
    model.save(path)
    return model, history, path


def test_fit_learns_the_copy_task(trained):
    model, history, _ = trained
    source, decoder_in, labels = copy_task(256, seed=1)
    logits = model.predict([source, decoder_in], verbose=0)
    real = labels != 0
    accuracy = np.mean(np.argmax(logits, -1)[real] == labels[real])
    assert history.history["loss"][-1] < 0.25 * history.history["loss"][0]
    assert accuracy > 0.9, accuracy


@pytest.mark.processes
def test_saved_model_loads_in_a_fresh_process_on_the_next_backend(trained, tmp_path):
    """The trained translator, and an untrained LLaMA-style model, saved here
    and loaded by a fresh process of the next installed backend (JAX ->
    TensorFlow -> PyTorch -> JAX): what a fresh process must register (our
    layers, on import) is backend-free. Over the suite's three runs every
    backend saves for another and loads another's files, and each pair of
    backends meets; this backend reloads its own in this process
    (`tests/layers/test_saving.py`). One process rather than one per other
    backend: each imports Keras, TensorFlow (Keras' saving checks its types)
    and the backend, 15 to 20 s alone, run beside the suite."""
    if len(BACKENDS) < 2:
        pytest.skip("no other backend installed")
    loader = BACKENDS[(BACKENDS.index(BACKEND) + 1) % len(BACKENDS)]
    model, _, path = trained
    source, decoder_in, _ = copy_task(16, seed=2)
    llama = llama_model(
        VOCAB, WIDTH, 64, normalize_qk=True, logit_soft_cap=20.0, seed=1
    )
    llama_path = tmp_path / "llama.keras"
    llama.save(llama_path)
    # Eager calls on both sides: TensorFlow's predict graphs, traced for other
    # batch sizes, may pick other (equally exact) kernels than a fresh trace.
    expected = {
        "translator": keras.ops.convert_to_numpy(model([source, decoder_in])),
        "llama": keras.ops.convert_to_numpy(llama(decoder_in)),
    }
    np.savez(tmp_path / "translator.npz", input_0=source, input_1=decoder_in)
    np.savez(tmp_path / "llama.npz", input_0=decoder_in)
    script = tmp_path / "load_and_predict.py"
    script.write_text(LOAD_AND_PREDICT)
    arguments = []
    for name, model_path in (("translator", path), ("llama", llama_path)):
        data, out = tmp_path / f"{name}.npz", tmp_path / f"{name}_{loader}.npy"
        arguments += [str(model_path), str(data), str(out)]
    # One thread: the process shares the machine's cores with the suite.
    env = {
        **os.environ,
        "KERAS_BACKEND": loader,
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, str(script), *arguments],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{loader}:\n{done.stdout[-3000:]}"
    tolerance = 1e-5  # another backend's kernels (or a GPU's)
    for name, values in expected.items():
        np.testing.assert_allclose(
            np.load(tmp_path / f"{name}_{loader}.npy"),
            values,
            atol=tolerance,
            rtol=tolerance,
            err_msg=f"{name} on {loader}",
        )


def test_loading_restores_weights_exactly(trained):
    model, _, path = trained
    loaded = keras.models.load_model(path)
    for original, restored in zip(model.weights, loaded.weights, strict=True):
        assert original.path == restored.path
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(original), keras.ops.convert_to_numpy(restored)
        )


def test_jit_compiled_predict_equals_eager(trained):
    model, _, path = trained
    source, decoder_in, _ = copy_task(8, seed=3)
    eager = keras.ops.convert_to_numpy(model([source, decoder_in]))
    compiled = keras.models.load_model(path)
    compiled.compile(jit_compile=BACKEND != "torch")
    np.testing.assert_allclose(
        compiled.predict([source, decoder_in], verbose=0), eager, atol=1e-5, rtol=1e-5
    )
