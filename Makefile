# Two commands do everything on a fresh machine (README "Quickstart"):
#   make demo   -> set up .venv if needed, then run the main job
#   make test   -> set up .venv if needed, then run the test suite
# The venv is rebuilt only when requirements/cpu.lock or the package metadata change.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.polyrl-installed
PYTEST_ARGS ?=

.PHONY: demo test install lint clean-venv

install: $(STAMP)

$(STAMP): requirements/cpu.lock setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=25"
	# --no-deps: the lock is the whole environment; nothing may pull a CUDA torch.
	$(PY) -m pip install --quiet --no-deps -r requirements/cpu.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	# The lock must have given the CPU torch and a working vLLM/JAX/Ray stack.
	$(PY) -c "import torch, vllm, jax, ray, gin, flax, optax, orbax.checkpoint, transformers; assert torch.version.cuda is None, 'a CUDA torch was installed'; print('stack ok: torch', torch.__version__, 'vllm', vllm.__version__, 'jax', jax.__version__)"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/polyrl train --gin_file gin/experiments/tiny_grpo_val.gin --overwrite

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m pytest -q tests/core/test_layering.py tests/core/test_lint.py

clean-venv:
	rm -rf $(VENV)
