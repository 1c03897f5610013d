# Two commands do all the set-up: `make run` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export PYTHONWARNINGS := ignore
export TOKENIZERS_PARALLELISM := false
export PREFECT_LOGGING_LEVEL ?= WARNING
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export RAY_DEDUP_LOGS := 1
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: run run-vlm run-envs run-distill test test-fast lint format install clean bytecode

$(STAMP): pyproject.toml
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get install -y -q bubblewrap >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q bubblewrap)); } || \
	  echo "note: bubblewrap (bwrap) is not installed; the code reward will refuse to run. Install it: apt-get install -y bubblewrap"
	@echo "make: creating $(VENV) and installing torch and the project into it (a few minutes, quietly)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# our own modules' bytecode, written ahead: pip compiles what it installs, but not an editable install's
# sources, and with PYTHONDONTWRITEBYTECODE set (as in many CI images) every process (each stage, each Ray
# worker) would compile them again, ~0.3 CPU-s apiece; only changed files are compiled again
bytecode: $(STAMP)
	@$(PY) -m compileall -q -j 0 components flows tasks rewards bench >/dev/null

# The default pipeline end to end: dvc repro runs prepare -> clean -> sft -> train -> evaluate (Prefect flows).
# dvc.yaml is named: `dvc repro` alone runs every pipeline of the project, vlm/dvc.yaml's too. --pull: a stage
# whose outputs are already in the DVC remote (another checkout pushed them) takes them instead of running;
# the outputs are pushed after, for the next checkout.
run: $(STAMP) bytecode
	@echo "make: dvc repro: each stage takes its outputs from the DVC remote when a run pushed them there, and runs"
	@echo "      otherwise; on the first run the remote is empty (DVC's 'Unable to pull data' warnings say so)"
	$(VENV)/bin/dvc repro --pull dvc.yaml
	$(VENV)/bin/dvc push -q dvc.yaml
	$(VENV)/bin/dvc metrics show metrics/eval.json

# The multimodal pipeline (docs/multimodal.md): a tiny VLM, SFT, then GRPO on counting shapes in images.
run-vlm: $(STAMP) bytecode
	$(VENV)/bin/dvc repro --pull vlm/dvc.yaml
	$(VENV)/bin/dvc push -q vlm/dvc.yaml
	$(VENV)/bin/dvc metrics show metrics/vlm_eval.json

# The environments pipeline (docs/environments.md): reasoning-gym's tasks, scored by their own score_answer.
run-envs: $(STAMP) bytecode
	$(VENV)/bin/dvc repro --pull environments/dvc.yaml
	$(VENV)/bin/dvc push -q environments/dvc.yaml
	$(VENV)/bin/dvc metrics show metrics/rg_eval.json metrics/game_eval.json

# On-policy distillation (docs/algorithms.md): the default pipeline's GRPO model teaches a smaller student,
# against the same student trained by GRPO alone (DVC runs the default pipeline's stages first when needed).
run-distill: $(STAMP) bytecode
	$(VENV)/bin/dvc repro --pull distill/dvc.yaml
	$(VENV)/bin/dvc push -q distill/dvc.yaml
	$(VENV)/bin/dvc metrics show metrics/eval.json metrics/distill_eval.json metrics/student_grpo_eval.json

test: $(STAMP) bytecode
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

test-fast: $(STAMP) bytecode
	$(PY) -m pytest -m "not slow"

# what the pipeline and the runs wrote; never a tracked file (dvc.lock and metrics/*.json are committed)
clean:
	rm -rf data/raw data/clean data/quarantine data/multimodal checkpoints mlflow.db mlruns .prefect-results
