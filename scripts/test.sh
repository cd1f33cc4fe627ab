#!/usr/bin/env bash
# Install everything the test suite needs, then run all of it.
#   - Debian packages: prometheus (server + promtool), prometheus-alertmanager (server + amtool),
#     prometheus-node-exporter (the benchmark's anchor)
#   - Python: this package with its [test] extra, and PyTorch for the training-client tests
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
# torch 2.13.0: on this project's machines a CPU build lies on local disk.
python3 -c 'import torch' 2>/dev/null || \
    python3 -m pip install -q --disable-pip-version-check 'torch==2.13.0'
# The framework integrations' tests, against the torch just installed (never another one).
torch_version=$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')
python3 -c 'import lightning, keras, transformers, accelerate' 2>/dev/null || \
    python3 -m pip install -q --disable-pip-version-check lightning keras transformers \
        accelerate "torch==${torch_version}"

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
