#!/usr/bin/env bash
# Install everything the test suite needs, then run all of it.
#   - Debian packages: prometheus (server + promtool), prometheus-alertmanager (server + amtool),
#     prometheus-node-exporter (the benchmark's anchor)
#   - Python: this package with its [test] extra, and PyTorch, Lightning, Keras, transformers
#     at the versions in tests/frameworks.txt
# Usage: scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v amtool >/dev/null 2>&1 || missing+=(prometheus-alertmanager)
command -v prometheus-node-exporter >/dev/null 2>&1 || missing+=(prometheus-node-exporter)
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "installing Debian packages: ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
fi

python3 -m pip install -q --disable-pip-version-check -e '.[test]'
# PyTorch and the frameworks the integration tests drive, at the versions pinned in one place
python3 -m pip install -q --disable-pip-version-check -r tests/frameworks.txt

python3 -m ruff check .

set +e
python3 -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure" >&2
    exit 1
fi
exit "$rc"
