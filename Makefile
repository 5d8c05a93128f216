# precast: set-up, the main job on the embedded default, and the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO := build/demo
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is a test-only reference (diffusers/transformers parity); the CPU build lies on local disk.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[compiler,onnxruntime,openvino,tensorrt-rtx,test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	mkdir -p $(DEMO)
	$(BIN)/precast demo-model --out $(DEMO)/tiny-sd15.safetensors
	$(BIN)/precast export $(DEMO)/tiny-sd15.safetensors --out $(DEMO)/onnx

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/export_unet.py

clean:
	rm -rf build $(VENV)
