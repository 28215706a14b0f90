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
# pytest-xdist workers for the main suite (tests/conftest.py: the Ray tests stay together on one); 0 runs it in-process
TEST_WORKERS ?= 2
PROPERTY_TESTS := tests/unit/engine/test_scheduler_properties.py

.PHONY: venv serve test test-fast test-explore bench gpu-wheels gpu-nixl gpu-site test-gpu bench-gpu profile-gpu gpu-report clean docs docs-serve

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
# The `rayup` test (tests/cluster/test_ray_up.py: `ray up` over a local sshd, then `ray down`) runs beside the Ray
# tests, on the other worker: its cluster lives in a PID namespace of its own, so its `ray stop` sees nothing else.
test: venv
	$(VENV)/bin/ruff check .
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)
	$(MKDOCS) build --strict --quiet

test-fast: venv
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# Randomized and ten times longer: looks for new failing examples (not part of `make test`).
test-explore: venv
	HYPOTHESIS_PROFILE=explore $(PY) -m pytest -q $(PROPERTY_TESTS) $(PYTEST_ARGS)

bench: venv
	$(PIP) install -q -e ".[bench]" "$(TORCH_PIN)"
	$(PY) -m benchmarks.scheduler_step
	$(PY) -m benchmarks.engine_throughput

# A GPU machine (issue 12's: CUDA torch, transformers and triton installed, no Ray, no network) runs the GPU
# tests and the GPU benchmark with its own Python. `make gpu-wheels` (here, with the network) downloads what its
# Python lacks into $(GPU_WHEELS) (pure-Python, plus pydantic-core for CPython 3.12: a few MiB) to carry there.
GPU_PY ?= python3
GPU_PYVER ?= 3.12
GPU_WHEELS ?= gpu-wheels
GPU_SITE ?= .gpu-site
GPU_DEPS := pydantic pytest pytest-timeout pytest-asyncio hypothesis jsonschema
# structured outputs' grammar engine, without its dependencies (torch, transformers, triton are that Python's)
GPU_NODEPS := xgrammar==0.2.8 apache-tvm-ffi
# Installed into $(GPU_SITE) (--target: that Python's own installs are left alone, and no "externally managed"
# refusal), which goes first on PYTHONPATH: where it holds a newer copy of a shared dependency
# (typing_extensions, packaging), that copy is the one imported.
GPU_ENV := PYTHONPATH=$(GPU_SITE):$$PYTHONPATH

gpu-wheels: venv
	$(PIP) download -q --only-binary=:all: --python-version $(GPU_PYVER) --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 -d $(GPU_WHEELS) $(GPU_DEPS)
	$(PIP) download -q --only-binary=:all: --no-deps --python-version $(GPU_PYVER) --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d $(GPU_WHEELS) $(GPU_NODEPS)

# NIXL for that Python (P/D's NIXL transport, tests/gpu/test_pd_nixl_cuda.py, benchmarks/kv_transfer.py): its
# CUDA 13 wheel without the expert-parallel kernels it bundles (nixl_ep_cu13, unused here), packed to ~28 MiB so
# that it fits the working tree a lent machine receives; tools/gpu_session.sh unpacks it there.
GPU_NIXL := .nixl/nixl-cp$(subst .,,$(GPU_PYVER)).tgz
gpu-nixl: venv
	rm -rf .nixl/tmp && mkdir -p .nixl/tmp/wheel .nixl/tmp/site
	$(PIP) download -q --only-binary=:all: --no-deps --python-version $(GPU_PYVER) --platform manylinux_2_28_x86_64 \
		-d .nixl/tmp/wheel nixl-cu13==1.5.1
	cd .nixl/tmp/site && unzip -q ../wheel/nixl_cu13-*.whl -x 'nixl_ep_cu13/*' '*.data/*' '*.scripts/*' && \
		tar czf ../../$(notdir $(GPU_NIXL)) .
	rm -rf .nixl/tmp; ls -l $(GPU_NIXL)

# The checkout is not pip-installed there: $(GPU_SITE)/affinity_serve/ holds links to its folders (the
# namespace the wheel installs them under). Only what that Python cannot import, one wheel each (the newest there) without dependency resolution: its own
# pytest and plugins stay in charge (a resolving --target install brings a second pytest that shadows them).
# Each dependency of these that may be missing is a name of its own in the list; pydantic comes with the
# versions of its companions it was built against.
gpu-site:
	mkdir -p $(GPU_SITE); \
	need() { PYTHONPATH=$(GPU_SITE) $(GPU_PY) -c "import $$1" 2>/dev/null && return 1; return 0; }; \
	pick=""; \
	if need pydantic; then pick="$$pick pydantic pydantic_core annotated_types typing_inspection typing_extensions"; fi; \
	if need xgrammar; then pick="$$pick xgrammar apache_tvm_ffi"; fi; \
	if need jsonschema; then pick="$$pick jsonschema jsonschema_specifications referencing rpds_py attrs"; fi; \
	for m in pytest iniconfig pluggy packaging pygments pytest_timeout pytest_asyncio hypothesis sortedcontainers; do \
		need $$m && pick="$$pick $$m"; done; \
	for m in $$pick; do w=$$(ls $(GPU_WHEELS)/$$m-*.whl 2>/dev/null | sort -V | tail -1); \
		[ -n "$$w" ] || { echo "gpu-site: $$m is missing and $(GPU_WHEELS)/ has no wheel of it: run 'make gpu-wheels' where pip has the network"; exit 1; }; \
		$(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --target $(GPU_SITE) --upgrade $$w || exit 1; done; \
	echo "gpu-site: installed [$$pick ] into $(GPU_SITE)"; \
	mkdir -p $(GPU_SITE)/affinity_serve; \
	for d in app engine autoscale observability; do ln -sfn $(CURDIR)/$$d $(GPU_SITE)/affinity_serve/$$d; done; \
	PYTHONPATH=$(GPU_SITE) $(GPU_PY) -c "import affinity_serve.engine" || exit 1; \
	echo "gpu-site: affinity_serve.* links to this checkout's folders"

test-gpu: gpu-site
	$(GPU_ENV) $(GPU_PY) -m pytest -q -rs -p no:cacheprovider tests/gpu

bench-gpu: gpu-site
	$(GPU_ENV) $(GPU_PY) -m benchmarks.engine_throughput_gpu --json gpu-bench.json

profile-gpu: gpu-site
	$(GPU_ENV) $(GPU_PY) -m benchmarks.gpu_decode_profile --kernels --sweep

# All three in one go, each one's output (and gpu-bench.json) kept in $(GPU_REPORT): one call on a lent machine,
# e.g. `make gpu-report GPU_REPORT=$$OUT`. A failing step does not stop the next; the exit code says if any failed.
GPU_REPORT ?= gpu-report
gpu-report: gpu-site
	mkdir -p $(GPU_REPORT); rc=0; \
	nvidia-smi > $(GPU_REPORT)/nvidia-smi.txt 2>&1; \
	for t in test-gpu bench-gpu profile-gpu; do \
		echo "== $$t"; PYTHONUNBUFFERED=1 $(MAKE) --no-print-directory $$t > $(GPU_REPORT)/$$t.log 2>&1 || rc=1; \
		tail -n 30 $(GPU_REPORT)/$$t.log; done; \
	cp gpu-bench.json $(GPU_REPORT)/ 2>/dev/null; \
	exit $$rc

# The docs site (mkdocs-material, mkdocs.yml). Its hook regenerates docs/configuration-reference.md from the
# config models first; --strict fails on a broken link or anchor.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs
docs: venv
	$(MKDOCS) build --strict

docs-serve: venv
	$(MKDOCS) serve -a 127.0.0.1:8001

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info site
