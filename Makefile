# Two commands for a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BACKENDS := jax tensorflow torch
PYTEST_ARGS ?=

.PHONY: demo test test-compat lint format clean

# Every installed module is byte-compiled once, on both cores (pip alone takes
# one: 98 s -> 75 s): machines that set PYTHONDONTWRITEBYTECODE (ours does)
# would otherwise compile TensorFlow, JAX and torch anew in every process.
# torch's py312_intrinsics.py is Python 3.12 syntax, which pip skips too.
$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt \
		-e ".[tensorflow,jax,torch,huggingface,dev,examples,export]"
	$(BIN)/python -m compileall -q -j 0 -x py312_intrinsics $(VENV)/lib
	touch $@

demo: $(BIN)/.installed
	KERAS_BACKEND=$${KERAS_BACKEND:-jax} $(BIN)/python examples/translate_numbers.py

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(BIN)/.installed
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# One pytest run per backend: KERAS_BACKEND is read once, at import. Each run
# has WORKERS processes (pytest-xdist), a test file to each (its module
# fixtures start their subprocesses once), in the order tests/conftest.py
# gives them (`--no-loadscope-reorder`: the files that start subprocesses
# first; pytest-xdist's own order, by count of tests, ran the JAX
# multi-process file last), one thread per process: the suite's tensors are
# tiny, and two cores are better spent on two tests than on one test's
# thread pools. XLA compiles without LLVM's optimizations, its expensive
# passes or its MLIR fusion emitters: the suite's programs are tiny and
# compiling them is most of the JAX run's time, and TensorFlow's XLA reads
# the same flags (two layer-contract files: 63 s -> 46 s at level 0; forty
# small programs, 283 ms -> 156 ms per shape with the other two;
# test_multi_head_attention.py on JAX, 155 s -> 122 s with the flags alone).
# Inductor compiles in the test's own process, not in its pool of compile
# workers: that pool is known to hang on CI machines after a cold start
# (pytorch/pytorch#162199; AReaL's CI, areal-project/AReaL#701), and a CI
# run of ours ended at its time limit with the PyTorch run at 98%.
# JAX keeps every program it compiles in JAX_CACHE (its persistent
# compilation cache, from the first program: tiny ones are most of ours),
# shared by both workers, the processes the tests start and later runs.
# The key is the program, XLA's flags and jaxlib's version, so a cached
# program is never another's. tests/layers, tests/generation and tests/ops on
# JAX, two runs side by side from an empty cache: sum of test times 1,887 s
# without, 1,820 s with (-4%); tests/layers alone, 279 s without, 172 s on
# the second run (the cache filled). On some CPUs (AVX-512 ones, in
# jax-ml/jax#38445) XLA rejects every cached program, with a logged error, and
# compiles it again. `make clean` empties the default folder.
JAX_CACHE ?= $(CURDIR)/.cache/jax
WORKERS ?= 2
XDIST = -n $(WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart=0
THREADS := OMP_NUM_THREADS=1 TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=1 \
	TORCHINDUCTOR_COMPILE_THREADS=1 \
	XLA_FLAGS="--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0 \
	--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false" \
	JAX_COMPILATION_CACHE_DIR="$(JAX_CACHE)" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0

# Each run prints its slowest tests and how long it took: what to cut when
# the suite nears its budget (20 minutes on a fresh clone).
test: lint
	@failed=""; begin=$$(date +%s); for backend in $(BACKENDS); do \
		echo "=== KERAS_BACKEND=$$backend ($$(( $$(date +%s) - begin )) s into the tests)"; \
		start=$$(date +%s); \
		KERAS_BACKEND=$$backend $(THREADS) $(BIN)/python -m pytest -q -p no:cacheprovider \
			$(XDIST) --durations=15 \
			--doctest-modules keras_attn tests $(PYTEST_ARGS) || failed="$$failed $$backend"; \
		echo "=== KERAS_BACKEND=$$backend took $$(( $$(date +%s) - start )) s"; \
	done; \
	if [ -n "$$failed" ]; then echo "FAILED on:$$failed"; exit 1; fi; \
	echo "all backends passed: $(BACKENDS)"

# Every Keras in the declared range (pyproject.toml: the floor, the newest
# release), on JAX and PyTorch: a venv per Keras under .venv/compat that
# holds only that Keras and reads every other package from .venv, then the
# tests of every Keras-facing feature (layers, ops, quantization, saving,
# decoding). `make test-compat KERAS_NIGHTLY=1` adds keras-nightly, with
# keras-hub-nightly (keras-hub 0.32 does not import on Keras 3.16).
COMPAT_KERAS ?= 3.15.0 3.15.1
COMPAT_BACKENDS ?= jax torch
COMPAT_TESTS ?= tests/test_keras_compat.py tests/layers tests/ops \
	tests/generation/test_decoding.py tests/generation/test_strategies.py
KERAS_NIGHTLY ?=
COMPAT := $(VENV)/compat
compat_pip = $(BIN)/python -m pip --python $(COMPAT)/$(1)/bin/python install \
	--quiet --no-deps --ignore-installed --no-compile

$(COMPAT)/%/.installed: $(BIN)/.installed
	rm -rf $(COMPAT)/$*
	$(BIN)/python -m venv --without-pip $(COMPAT)/$*
	$(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
		> $$($(COMPAT)/$*/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/main.pth
	if [ "$*" = nightly ]; then $(call compat_pip,$*) --pre keras-nightly keras-hub-nightly; \
	else $(call compat_pip,$*) "keras==$*"; fi
	touch $@

test-compat: $(foreach v,$(COMPAT_KERAS) $(if $(KERAS_NIGHTLY),nightly),$(COMPAT)/$(v)/.installed)
	@failed=""; for keras in $(COMPAT_KERAS) $(if $(KERAS_NIGHTLY),nightly); do \
		for backend in $(COMPAT_BACKENDS); do \
			echo "=== Keras $$keras, KERAS_BACKEND=$$backend"; \
			KERAS_BACKEND=$$backend $(THREADS) $(COMPAT)/$$keras/bin/python -m pytest -q \
				-p no:cacheprovider $(XDIST) \
				$(COMPAT_TESTS) \
				$(PYTEST_ARGS) || failed="$$failed $$keras/$$backend"; \
		done; \
	done; \
	if [ -n "$$failed" ]; then echo "FAILED on:$$failed"; exit 1; fi; \
	echo "every Keras passed: $(COMPAT_KERAS) $(if $(KERAS_NIGHTLY),nightly)"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis .cache
