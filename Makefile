# Two entry points for a fresh machine (see README):
#   make run   - set up (idempotent) and run the main job on the embedded CPU default
#   make test  - set up (idempotent) and run the default test suite
#   make sglang-env - build (idempotent) the real SGLang server's own venv; prints its python
#   make test-sglang - the tests against real SGLang servers (scripts/ci_sglang.sh)
SHELL := /bin/bash
RUN_DIR ?= runs/tiny_cpu$(if $(filter sglang,$(ENGINE)),_sglang)
PYTEST_ARGS ?=

.PHONY: setup run test test-all test-slurm gpu-check sglang-env test-sglang

setup:
	@bash scripts/setup.sh >/dev/null

# ENGINE=sglang: the same job on real SGLang servers (rollout.num_engines, started by the trainer from
# SGLang's own venv, built by `make sglang-env` on first use); ENGINE=embedded (default): the embedded engine.
ENGINE ?= embedded
TRAIN_SETS ?=

run:
	@venv=$$(bash scripts/setup.sh | tail -n1) && \
	  sets="--set rollout.engine=$(ENGINE)" && \
	  if [ "$(ENGINE)" = sglang ]; then sets="$$sets --set rollout.sglang_python=$$(bash scripts/setup.sh --sglang | tail -n1)"; fi && \
	  "$$venv/bin/python" -m sao_megatron.cli train --config configs/experiments/tiny_cpu.yaml --run-dir $(RUN_DIR) --resume auto $$sets $(TRAIN_SETS) && \
	  "$$venv/bin/python" -m sao_megatron.cli report $(RUN_DIR)

test:
	@venv=$$(bash scripts/setup.sh | tail -n1) && \
	  "$$venv/bin/python" -m pytest -m "not slow and not slurm and not gpu and not sglang" $(PYTEST_ARGS)

# Everything CI can run here: slow tests and the local Slurm cluster too.
test-all:
	@venv=$$(bash scripts/setup.sh | tail -n1) && \
	  "$$venv/bin/python" -m pytest -m "not gpu and not sglang" $(PYTEST_ARGS)

sglang-env:
	@bash scripts/setup.sh --sglang

test-sglang:
	@bash scripts/ci_sglang.sh $(PYTEST_ARGS)

# GPU acceptance check on one GPU of a node without network (docs/gpu-node.md). Uses the
# node's CUDA python, not the CPU venv: WHEELS=DIR from scripts/gpu_wheels.sh, GPU_CHECK_ARGS=--cpu etc.
gpu-check:
	@bash scripts/gpu_check.sh $(if $(WHEELS),--wheels $(WHEELS)) $(GPU_CHECK_ARGS)
