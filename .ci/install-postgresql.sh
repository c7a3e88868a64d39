#!/usr/bin/env bash
# Debian's PostgreSQL server for tests/test_mlflow_server.py, which starts a private
# cluster of its own (initdb/pg_ctl in a temp folder, on a free loopback port) and
# removes it afterwards. Idempotent; installs only as root with apt-get; otherwise it
# says why and exits 0 (those tests then skip, or fail under SPLITVIT_REQUIRE_POSTGRES=1).
set -euo pipefail

if compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  echo "postgresql: already installed ($(ls -d /usr/lib/postgresql/*/bin/initdb | tail -1))"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "postgresql: not installed and not root; skipping the install"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "postgresql: not installed and no apt-get here; skipping the install"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql >/dev/null; then
  echo "postgresql: installed ($(ls -d /usr/lib/postgresql/*/bin/initdb | tail -1))"
else
  echo "postgresql: apt-get install failed; skipping"
fi
