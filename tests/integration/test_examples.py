"""Smoke tests of the example programs: each runs end to end with tiny settings.

Each example runs as a subprocess on the current `KERAS_BACKEND`, trains one
epoch of a tiny model on a few hundred examples (or loads a tiny checkpoint
folder and generates), and must exit with 0, write its outputs and end with
its summary line. Its stdout is a pipe, as in a CI log:
it must hold no progress-bar redraws, and stderr none of TensorFlow's C++ log
(which the examples keep quiet themselves). Whether the examples *learn* is
checked by running them with their defaults (see README); these tests check
that they run. The selected examples start together, one thread each (most of
their time is imports and compilation), and each test waits for its own.

Each example runs once per suite, in one backend's run (`RUNS_ON`): they are
programs over the layers, which the rest of the suite tests on every backend,
and five programs on three backends took a sixth of the suite's time. Run one
on another backend by hand with `KERAS_BACKEND=... python examples/...`.
"""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.backend import BACKEND
from tests.helpers.processes import ROOT

pytestmark = pytest.mark.processes  # the examples run as programs

PERCENT = r"\d{1,3}\.\d%"
# Keras' progress bar redraws with backspaces and ANSI escape sequences.
REDRAW = re.compile(r"\x08|\x1b\[")
# TensorFlow's C++ log: absl's `I0123 12:34:56.789012  42 file.cc:31] ` records,
# TensorFlow's own `2025-01-23 12:34:56.789012: I file.cc:31] `, absl's notice.
TF_LOG = re.compile(
    r"^[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\]"
    r"|^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] "
    r"|absl::InitializeLog|oneDNN|cuInit",
    re.MULTILINE,
)
TINY_TRANSLATOR = [
    *("--epochs", 1, "--train-size", 256, "--test-size", 20),
    *("--embedding-dim", 32, "--num-layers", 1, "--num-heads", 2),
    *("--intermediate-dim", 64),
]
# name: (script, flags, last line, files written to --output)
EXAMPLES = {
    "translate_numbers": (
        "translate_numbers.py",
        TINY_TRANSLATOR,
        rf"held-out exact match: {PERCENT} \(n=20\)",
        ("translate_numbers.keras", "cross_attention.png", "target_vocabulary.txt"),
    ),
    "translate_tsv": (  # also quantized: the int8 model is saved too
        "translate_numbers.py",
        [*TINY_TRANSLATOR, "--data", "{output}/pairs.tsv", "--quantize", "int8"],
        rf"held-out exact match: {PERCENT} \(n=8\)",  # 10% of the 80 pairs
        (
            "translate_numbers.keras",
            "translate_numbers_int8.keras",
            "cross_attention.png",
            "source_vocabulary.txt",
        ),
    ),
    "vit_digits": (
        "vit_digits.py",
        [
            *("--epochs", 1, "--train-size", 128, "--embedding-dim", 16),
            *("--num-layers", 1, "--intermediate-dim", 32),
        ],
        rf"test accuracy: {PERCENT}",
        ("vit_digits.keras",),
    ),
    "gpt_addition": (
        "gpt_addition.py",
        [
            *("--epochs", 1, "--train-size", 256, "--test-size", 20),
            *("--digits", 2, "--embedding-dim", 32, "--num-layers", 1),
            *("--intermediate-dim", 64),
        ],
        rf"accuracy on unseen sums: {PERCENT}",
        ("gpt_addition.keras", "self_attention.png"),
    ),
    "llama_docstrings": (
        "llama_docstrings.py",
        [
            *("--epochs", 1, "--train-chars", 8192, "--eval-chars", 2048),
            *("--length", 32, "--width", 16, "--num-layers", 2, "--num-heads", 2),
            *("--num-key-value-heads", 1, "--intermediate-dim", 32),
            *("--sliding-window", 8, "--prompts", 2, "--new-chars", 8),
        ],
        r"held-out perplexity: \d+\.\d\d \(2017 baseline: \d+\.\d\d\)",
        ("llama_docstrings.keras",),
    ),
    "convert_keras_hub": (  # reloads and decodes in a process on JAX
        "convert_keras_hub.py",
        ["--steps", 10, "--hidden-dim", 32, "--new-tokens", 4],
        r"reloaded on \w+: same logits \(to 1e-4\) and greedy tokens: yes",
        ("llama3_lora.keras",),
    ),
    "generate_from_checkpoint": (  # a tiny seeded Llama (write_checkpoint)
        "generate_from_checkpoint.py",
        [
            *("{output}/checkpoint", "--new-tokens", 6),
            *("--prompt", "Hello world", "--prompt", "The lazy dog"),
        ],
        r"generated \d+ new tokens for 2 prompt\(s\) in \d+\.\d s on \w+",
        ("generated.txt",),
    ),
}


# The backend whose run of the suite runs each example (the demo on `make
# demo`'s JAX); each backend runs at least one. The TSV variant runs on
# PyTorch: 20 s there against 44 s on TensorFlow, whose compiled
# generation loops it builds (the same program either way).
RUNS_ON = {
    "translate_numbers": "jax",
    "translate_tsv": "torch",
    "vit_digits": "torch",
    "gpt_addition": "tensorflow",
    "llama_docstrings": "torch",
    "convert_keras_hub": "torch",
    "generate_from_checkpoint": "jax",
}


def write_tsv(path):
    """80 pairs in the Tatoeba / Anki layout, with a third column to ignore."""
    rows = [f"I have {n} cats.\tJ'ai {n} chats.\tCC-BY 2.0 (France)" for n in range(80)]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")


def write_checkpoint(folder):
    """A tiny seeded Llama as transformers writes it (config.json,
    generation_config.json, model.safetensors), with a tiny tokenizer."""
    import torch
    import transformers

    from tests.helpers.tiny_tokenizers import byte_level_bpe, write_tokenizer_folder

    tokenizer = byte_level_bpe()
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,  # the tokenizer's BOS, end and padding ids
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    write_tokenizer_folder(folder, tokenizer)


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """`name -> (process, output folder)` for every selected example, running."""
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_example"
        and RUNS_ON[item.callspec.params["name"]] == BACKEND
    ]
    env = {
        **os.environ,
        "KERAS_BACKEND": BACKEND,
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",  # The processes share the machine's cores.
        "MPLBACKEND": "Agg",
    }
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # The examples' own setting is tested.
    # As a user runs them, without the suite's compilation cache (Makefile):
    # on some CPUs XLA rejects each cached program with a logged error
    # (jax-ml/jax#38445), which the check of their stderr would take for theirs.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    processes = {}
    for name in dict.fromkeys(selected):
        script, flags, _, _ = EXAMPLES[name]
        output = tmp_path_factory.mktemp(name)
        if name == "translate_tsv":
            write_tsv(output / "pairs.tsv")
        if name == "generate_from_checkpoint":
            write_checkpoint(output / "checkpoint")
        flags = [str(flag).format(output=output) for flag in flags]
        command = [sys.executable, str(ROOT / "examples" / script), *flags]
        command += ["--output", str(output)]
        processes[name] = (
            subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
            output,
        )
    yield processes
    for process, _ in processes.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.parametrize("name", EXAMPLES)
def test_example(started, name):
    if RUNS_ON[name] != BACKEND:
        pytest.skip(f"runs once, in the {RUNS_ON[name]} run of the suite")
    process, output = started[name]
    _, _, last_line, files = EXAMPLES[name]
    try:
        # Under the suite's 15 minutes a test (pytest-timeout), so that this
        # failure, with the example's output, is the one reported.
        stdout, stderr = process.communicate(timeout=780)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        pytest.fail(f"{name} did not finish in 13 minutes:\n{stdout[-3000:]}")
    assert process.returncode == 0, (
        f"{name} exited with {process.returncode}:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    )
    lines = stdout.strip().splitlines()
    assert re.fullmatch(last_line, lines[-1]), lines[-5:]
    assert not REDRAW.search(stdout), "progress-bar redraws in piped output"
    assert not TF_LOG.search(stderr), stderr[-3000:]
    for file in files:
        assert (output / file).stat().st_size > 0, file
