# The README's commands. `make demo` and `make test` set everything up from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# torch is installed first, pinned, so that pip never pulls the newest CUDA build (GBs) into the venv.
# Pick another with e.g. `make test TORCH_VERSION=2.6.0 TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"`.
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
# torchaudio is an anchor the tests compare against (rnnt_loss, forced_align). PyPI's wheel is a CUDA build: it is
# installed without its dependencies and loads on a CPU-only torch through stub CUDA libraries (tools/torchaudio_cpu).
TORCHAUDIO_VERSION ?= 2.11.0
# pyctcdecode (the decoder seqdist.decode.build_ctcdecoder stands in for, compared in tests/test_pyctcdecode.py) pins
# numpy below 2 and runs on numpy 2: it goes in without its dependencies, with the one its import needs.
PYCTCDECODE := pyctcdecode==0.5.0 pygtrie==2.5.0
BIN := $(VENV)/bin
# each step of `make test` says its wall and CPU time (bash's `time`)
export TIMEFORMAT := step: %0Rs wall, %0Us user, %0Ss sys
# torch.compile's caches per checkout: a graph cached by another checkout's older custom ops must not be reused here
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.torchinductor-cache
SITE := tools/site
PIP := $(BIN)/python -m pip -q --disable-pip-version-check

.PHONY: install install-bonito demo test sanitize gpu-check gpu-check-tests gpu-check-notebooks gpu-bench gpu-bench-quick docs docs-html docs-check chromium readme colab-cells clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile tools/torchaudio_cpu/build.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS)
	$(PIP) install -e ".[dev]"
	$(PIP) install --no-deps "torchaudio==$(TORCHAUDIO_VERSION)" "flashlight-text==0.0.7" $(PYCTCDECODE)
	tools/torchaudio_cpu/build.sh $(VENV)/cuda-stubs
	touch $@

# bonito, for tests/test_koi_bonito.py (its basecaller with seqdist.koi in ONT's koi's place). It asks for torch ~= 2.9
# and ONT's koi, so it goes into a folder of its own without its dependencies, with the ones its import needs; the
# test runs it in a subprocess with that folder on its path.
BONITO := $(VENV)/bonito
BONITO_PKGS := ont-bonito==1.1.0 toml==0.10.2 tqdm==4.70.1 requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 \
	pandas==3.1.1 mappy==2.31 pysam==0.24.1 parasail==1.3.4 edlib==1.3.9.post1
install-bonito: $(BONITO)/.installed

$(BONITO)/.installed: Makefile | $(VENV)/.installed
	$(PIP) install --no-deps --upgrade --target $(BONITO) $(BONITO_PKGS)
	touch $@

# The main job: the one-line switch of each family against the library it replaces, at training shapes (seqdist-demo).
# The full benchmark is seqdist-bench; seqdist-selfcheck checks the CUDA toolchain and its emulator.
demo: install
	$(BIN)/seqdist-demo

# chromium and the site's npm packages let tests/test_docs.py check a rendered site in a real browser (the full
# site's check, `make docs-check`, executes every notebook: ~8 minutes, so it is a target of its own).
test: install install-bonito chromium $(SITE)/node_modules/.installed
	@echo "== nbdev-export: seqdist/ must be exactly what the notebooks export"
	time tools/unchanged.sh seqdist -- $(BIN)/nbdev-export
	@echo "== nbdev-clean: notebooks must be committed clean"
	time tools/unchanged.sh nbs -- $(BIN)/nbdev-clean
	@echo "== nbdev-test: every notebook on CPU (cells flagged 'cuda' need a GPU and are skipped)"
	time OMP_WAIT_POLICY=PASSIVE tools/unchanged.sh cuda -- $(BIN)/nbdev-test --n-workers 2 --timing
	@echo "== README.md must be what nbs/index.ipynb renders to"
	time tools/unchanged.sh README.md -- $(BIN)/python tools/docs.py readme
	@echo "== docs: nbdev's doc processing of every notebook (the step of \`make docs\` that runs cells again)"
	time OMP_WAIT_POLICY=PASSIVE $(BIN)/python tools/docs.py proc
	@echo "== GPU compile check: every CUDA instantiation for sm_80 and sm_90"
	time $(BIN)/seqdist-compile-check
	@echo "== pytest, on two workers (pytest-xdist), each test file on one of them"
	time SEQDIST_REQUIRE_TORCHAUDIO=1 SEQDIST_REQUIRE_KENLM=1 SEQDIST_REQUIRE_PYCTCDECODE=1 SEQDIST_REQUIRE_BONITO=1 SEQDIST_BONITO=$(abspath $(BONITO)) OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -n 2 --dist loadfile tests

# Every row of the bad-input tables under the sanitizers: the emulated CUDA kernels with AddressSanitizer, the numba
# CPU kernels with their bounds checks (tools/sanitize.py; `make test` runs a sample of it, tests/test_asan.py).
sanitize: install
	time OMP_WAIT_POLICY=PASSIVE $(BIN)/python tools/sanitize.py -n 2

# On a machine with a GPU and torch, CuPy, numba and pytest already installed, and no network: no venv, no pip.
# The GPU tests (marker `gpu`), every notebook with its `cuda` cells, and the quick GPU benchmark.
# It goes on past a failure, and ends with the GPU tests' summary per family (tests, kernels, worst error).
# Its two halves apart, for GPU slots too short for both (the tests take about a minute on 8 workers, PYTEST_ADDOPTS='-n 8'):
# gpu-check-tests, gpu-check-notebooks.
gpu-check:
	@rm -f gpu-check-summary.txt; status=0; \
	SEQDIST_GPU_SUMMARY=gpu-check-summary.txt PYTHONPATH=. $(PYTHON) -m pytest -m gpu -rs tests || status=1; \
	PYTHONPATH=. $(PYTHON) tools/run_notebook.py --flags cuda nbs/*.ipynb || status=1; \
	PYTHONPATH=. $(PYTHON) -c "import sys; from seqdist.bench import bench_cli; sys.argv[1:] = ['--device', 'cuda', '--quick']; bench_cli()" || status=1; \
	echo "== GPU tests by family"; cat gpu-check-summary.txt 2>/dev/null || echo "(no GPU test ran)"; \
	[ $$status = 0 ] && echo "gpu-check: all passed" || { echo "gpu-check: FAILED (see above)"; exit 1; }

gpu-check-tests:
	SEQDIST_GPU_SUMMARY=gpu-check-summary.txt PYTHONPATH=. $(PYTHON) -m pytest -m gpu -rs tests; status=$$?; \
	echo "== GPU tests by family"; cat gpu-check-summary.txt 2>/dev/null; exit $$status

gpu-check-notebooks:
	PYTHONPATH=. $(PYTHON) tools/run_notebook.py --flags cuda nbs/*.ipynb

# The GPU issue's benchmark in one short run (at most about 6 minutes; same machine assumptions): every row with its
# anchors, the variants behind their switches, the kernel profiles of the losing rows (into $$OUT when set), and
# nbs/bench/cuda.json written as it goes. Carry .anchors (tools/gpu_anchors.sh) and Liger's wheel for those anchors.
gpu-bench-quick:
	$(PYTHON) tools/gpu_bench.py nbs/bench/cuda.json --seconds 300 $(if $(OUT),--profiles $(OUT)/profiles.txt) $(if $(ONLY),--only $(ONLY))

# The full GPU benchmark (same machine assumptions). Its seqdist 0.0.3 anchor comes from .anchors/: run
# tools/gpu_anchors.sh where pip works and take .anchors along.
gpu-bench:
	PYTHONPATH=. $(PYTHON) -c "import sys; from seqdist.bench import bench_cli; sys.argv[1:] = ['--device', 'cuda', '--json', 'bench-cuda.json']; bench_cli()"

# The docs site. Without Quarto, tools/docs.py renders the notebooks into _docs/ with the maths in KaTeX, which
# comes from npm (tools/site/package.json, pinned by its package-lock.json) and is served with the site.
$(SITE)/node_modules/.installed: $(SITE)/package.json $(SITE)/package-lock.json
	cd $(SITE) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

docs: install $(SITE)/node_modules/.installed
	@if command -v quarto >/dev/null; then rm -rf nbs/katex && cp -r $(SITE)/node_modules/katex/dist nbs/katex && $(BIN)/nbdev-docs; \
	else echo "Quarto not found: rendering the notebooks with nbconvert into _docs/"; $(BIN)/python tools/docs.py html; fi

# The fallback site, whether Quarto is installed or not (what docs-check checks).
docs-html: install $(SITE)/node_modules/.installed
	$(BIN)/python tools/docs.py html

# Debian's chromium, installed when missing (as root: a fresh CI machine has none).
chromium:
	@command -v chromium >/dev/null || { echo "installing Debian's chromium"; apt-get update -qq && \
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# Every page in headless Chromium: loads with no console error and no network request, local links and images
# resolve, formulas rendered; screenshots in _docs/screenshots/.
docs-check: docs-html chromium
	$(BIN)/python tools/docs.py check

readme: install
	$(BIN)/python tools/docs.py readme

# The Colab badge and install cell at the top of every notebook, from pyproject.toml (run after adding a notebook).
colab-cells:
	$(PYTHON) tools/colab_cells.py nbs/*.ipynb

clean:
	rm -rf _proc _docs build dist *.egg-info
