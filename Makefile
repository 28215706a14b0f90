# Two commands do everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch: local/CI installs must never pull a multi-GB CUDA wheel.
TORCH_PIN := torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
REPLICAS ?= 2
PYTEST_ARGS ?=
PROPERTY_TESTS := tests/unit/engine/test_scheduler_properties.py

.PHONY: venv serve test test-fast test-explore bench gpu-wheels gpu-site test-gpu bench-gpu clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install "$(TORCH_PIN)"
	$(PIP) install -e ".[test]" "$(TORCH_PIN)"
	touch $@

serve: venv
	$(VENV)/bin/affinity-serve serve --replicas $(REPLICAS) --host $(HOST) --port $(PORT)

# Deterministic: the "ci" hypothesis profile replays fixed examples (tests/conftest.py).
# The `rayup` test (tests/cluster/test_ray_up.py: `ray up` over a local sshd, then `ray down`) runs in its own
# pytest invocation after the main suite, so no `ray stop` can ever meet the main suite's Ray.
test: venv
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -m "not rayup" $(PYTEST_ARGS)
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -m rayup tests/cluster $(PYTEST_ARGS)

test-fast: venv
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# Randomized and ten times longer: looks for new failing examples (not part of `make test`).
test-explore: venv
	HYPOTHESIS_PROFILE=explore $(PY) -m pytest -q $(PROPERTY_TESTS) $(PYTEST_ARGS)

bench: venv
	$(PIP) install -q -e ".[bench]" "$(TORCH_PIN)"
	$(PY) benchmarks/scheduler_step.py
	$(PY) benchmarks/engine_throughput.py

# A GPU machine (issue 12's: CUDA torch, transformers and triton installed, no Ray, no network) runs the GPU
# tests and the GPU benchmark with its own Python. `make gpu-wheels` (here, with the network) downloads what its
# Python lacks into $(GPU_WHEELS) (pure-Python, plus pydantic-core for CPython 3.12: a few MiB) to carry there.
GPU_PY ?= python3
GPU_PYVER ?= 3.12
GPU_WHEELS ?= gpu-wheels
GPU_SITE ?= .gpu-site
GPU_DEPS := pydantic pytest pytest-timeout pytest-asyncio hypothesis
# Installed into $(GPU_SITE) (--target: that Python's own installs are left alone, and no "externally managed"
# refusal), which goes first on PYTHONPATH: where it holds a newer copy of a shared dependency
# (typing_extensions, packaging), that copy is the one imported.
GPU_ENV := PYTHONPATH=$(GPU_SITE):$$PYTHONPATH

gpu-wheels: venv
	$(PIP) download -q --only-binary=:all: --python-version $(GPU_PYVER) --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 -d $(GPU_WHEELS) $(GPU_DEPS)

gpu-site:
	if [ -d $(GPU_WHEELS) ]; then $(GPU_PY) -m pip install -q --no-index --find-links $(GPU_WHEELS) \
		--target $(GPU_SITE) $(GPU_DEPS); fi

test-gpu: gpu-site
	$(GPU_ENV) $(GPU_PY) -m pytest -q -rs -p no:cacheprovider tests/gpu

bench-gpu: gpu-site
	$(GPU_ENV) $(GPU_PY) benchmarks/engine_throughput_gpu.py --json gpu-bench.json

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
