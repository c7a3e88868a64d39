#!/usr/bin/env bash
# The local stack: `infra/local/stack.sh up|down|status [options]` (see README.md here).
# Runs the checkout's virtualenv's `splitvit` when there is one, else the one on PATH.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
if [ -x "$root/.venv/bin/splitvit" ]; then
  exec "$root/.venv/bin/splitvit" stack "$@"
fi
exec splitvit stack "$@"
