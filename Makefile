# precast: set-up, the main job on the embedded default, and the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO := build/demo
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# optimum-onnx / optimum-intel need transformers < 4.58, the test extra 5.x: they get a venv of their own, which
# tests/test_interop.py and test_foreign_onnx.py run in a subprocess (tests/interop_side.py). ~1 min, 1.5 GB.
INTEROP := .venv-interop
INTEROP_STAMP := $(INTEROP)/.installed
INTEROP_PINS := torch==2.13.0 transformers==4.57.6 optimum==2.1.0 optimum-onnx==0.1.0 optimum-intel==1.27.0 \
	diffusers==0.39.0 onnxruntime==1.32.0 openvino==2026.4.1 numpy==2.4.6
# optimum-intel 2.2 (its FLUX.2 klein / Z-Image / Qwen-Image pipelines) needs optimum 2.3 and transformers 5.5: a
# second side venv, for tests/test_openvino_genai_dit.py. ~1.5 min, 1.6 GB. Its torchvision requirement resolves to
# a CUDA build that breaks `import optimum.intel` beside the CPU torch; the diffusion pipelines never use it: removed.
INTEROP_OV := .venv-interop-ov
INTEROP_OV_STAMP := $(INTEROP_OV)/.installed
INTEROP_OV_PINS := torch==2.13.0 transformers==5.5.4 optimum==2.3.0 optimum-intel==2.2.0 diffusers==0.39.0 \
	openvino==2026.4.1 openvino-tokenizers==2026.4.1.0 nncf==3.4.0 huggingface_hub==1.21.0 numpy==2.4.6

.PHONY: setup test-setup interop-setup interop-ov-setup demo demo-rtx demo-flux test bench clean

# The product: the compiler, the CPU runtimes (ONNX Runtime, OpenVINO) and TensorRT-RTX (its AOT builds need no GPU).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[compiler,onnxruntime,openvino,tensorrt-rtx]'
	touch $(STAMP)

# The tests add their references: torch (CPU build, on local disk), diffusers, transformers, pytest; and the
# registry tests/test_registry.py pushes to and pulls from (Debian's docker-registry, CNCF distribution).
$(TEST_STAMP): $(STAMP)
	test -x /usr/bin/docker-registry || (apt-get update && apt-get install -y docker-registry)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[compiler,onnxruntime,openvino,tensorrt-rtx,quantize,test,remote]'
	touch $(TEST_STAMP)

# The side environment the optimum / optimum-intel interop tests run in (nothing of precast is installed there).
$(INTEROP_STAMP): Makefile
	test -x $(INTEROP)/bin/python || $(PY) -m venv $(INTEROP)
	$(INTEROP)/bin/pip install -q $(INTEROP_PINS)
	touch $(INTEROP_STAMP)

# The second side environment: optimum-intel 2.2 (see INTEROP_OV_PINS).
$(INTEROP_OV_STAMP): Makefile
	test -x $(INTEROP_OV)/bin/python || $(PY) -m venv $(INTEROP_OV)
	$(INTEROP_OV)/bin/pip install -q $(INTEROP_OV_PINS)
	$(INTEROP_OV)/bin/pip uninstall -q -y torchvision
	touch $(INTEROP_OV_STAMP)

setup: $(STAMP)

test-setup: $(TEST_STAMP)

interop-setup: $(INTEROP_STAMP)

interop-ov-setup: $(INTEROP_OV_STAMP)

# The main job on the embedded default: tiny SD 1.x checkpoint -> bundle for this machine -> image.
demo: setup
	mkdir -p $(DEMO)
	$(BIN)/precast plan tiny-sd15
	$(BIN)/precast build tiny-sd15 --out $(DEMO)/bundle
	$(BIN)/precast bundle verify $(DEMO)/bundle
	$(BIN)/precast doctor $(DEMO)/bundle
	$(BIN)/precast generate $(DEMO)/bundle --prompt "a photo of a cat" --steps 20 --size 64x64 --out $(DEMO)/cat.png
	@echo "NVIDIA RTX engines too (TensorRT-RTX, built ahead of time here, no GPU needed): make demo-rtx"

# The same plus NVIDIA RTX engines (TensorRT-RTX, built ahead of time with no GPU; they run only on an RTX GPU:
# elsewhere doctor and generate pass them over, saying why, and use ONNX Runtime / OpenVINO).
demo-rtx: setup
	mkdir -p $(DEMO)
	$(BIN)/precast build tiny-sd15-rtx --out $(DEMO)/rtx-bundle
	$(BIN)/precast doctor $(DEMO)/rtx-bundle

# The same for the tiny embedded Flux.1 [dev] (T5 + CLIP-L + transformer + 16-channel VAE; random weights).
demo-flux: setup
	mkdir -p $(DEMO)
	$(BIN)/precast build tiny-flux --out $(DEMO)/flux-bundle
	$(BIN)/precast doctor $(DEMO)/flux-bundle
	$(BIN)/precast generate $(DEMO)/flux-bundle --prompt "a photo of a cat" --size 64x64 --out $(DEMO)/flux-cat.png

test: test-setup interop-setup interop-ov-setup
	$(BIN)/python -m pytest -q --durations=25

# Benchmarks (minutes to an hour; full-size weights are generated into benchmarks/results/work).
bench: test-setup
	$(BIN)/python benchmarks/export_unet.py
	$(BIN)/python benchmarks/engines.py
	$(BIN)/python benchmarks/lora.py
	$(BIN)/python benchmarks/sdxl.py
	$(BIN)/python benchmarks/suite.py
	$(BIN)/python benchmarks/flux_export.py    # needs ~52 GB of free disk (deleted at the end)
	$(BIN)/python benchmarks/flux_step.py      # the ONNX peers of Flux need onnxscript on PYTHONPATH

clean:
	rm -rf build $(VENV) $(INTEROP)
