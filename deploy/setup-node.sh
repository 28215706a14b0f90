#!/usr/bin/env bash
# Installs affinity-serve on one node of the cluster that `ray up cluster.yaml` launches: cluster.yaml's
# setup_commands run it on every node, after Ray's file_mounts copied this repository to ~/affinity-serve,
# and again on every `ray up` (it is idempotent).
#
#  1. A Python >= 3.11 virtual environment (the cloud images ship Python 3.10 and no pip): when $VENV has
#     none, uv (installed if missing) creates it with a standalone CPython 3.11.
#  2. That environment first on PATH in the login shells Ray runs its commands in (`ray start`, the deploy).
#  3. This repository installed into it with its extras (Ray's pinned version comes with it).
#  4. On a node with an NVIDIA GPU, the driver must answer (nvidia-smi): a replica would fail later.
#
# Environment (defaults for a cloud node): AFFINITY_SERVE_VENV (~/venv), AFFINITY_SERVE_SRC (~/affinity-serve),
# AFFINITY_SERVE_EXTRAS (otlp; the gpu extra builds flash-attn, which needs a wheel for the node's torch and
# CUDA), AFFINITY_SERVE_PIP_ARGS (extra pip options, e.g. a mirror).
set -euo pipefail
VENV="${AFFINITY_SERVE_VENV:-$HOME/venv}"
SRC="${AFFINITY_SERVE_SRC:-$HOME/affinity-serve}"
EXTRAS="${AFFINITY_SERVE_EXTRAS-otlp}"

has_python311() { "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

if ! has_python311; then
  export PATH="$HOME/.local/bin:$PATH"
  command -v uv >/dev/null 2>&1 || curl -LsSf https://astral.sh/uv/install.sh | sh
  uv venv --seed --python 3.11 "$VENV"
  has_python311 || { echo "setup-node: $VENV/bin/python is not Python >= 3.11" >&2; exit 1; }
fi

# first line of ~/.bashrc: Ubuntu's .bashrc returns early for non-interactive shells
touch "$HOME/.bashrc"
if ! grep -qs "# affinity-serve venv" "$HOME/.bashrc"; then
  sed -i "1i export PATH=\"$VENV/bin:\$PATH\"  # affinity-serve venv" "$HOME/.bashrc"
  [ -s "$HOME/.bashrc" ] || echo "export PATH=\"$VENV/bin:\$PATH\"  # affinity-serve venv" > "$HOME/.bashrc"
fi

# shellcheck disable=SC2086  # AFFINITY_SERVE_PIP_ARGS holds several options
"$VENV/bin/python" -m pip install --quiet ${AFFINITY_SERVE_PIP_ARGS:-} -e "$SRC${EXTRAS:+[$EXTRAS]}"
"$VENV/bin/python" -c 'import affinity_serve.app.cli, ray
print("setup-node: affinity-serve with Ray", ray.__version__)'

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L
fi
