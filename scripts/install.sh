#!/usr/bin/env bash
# Install gputrain-exporter into ./.venv, a virtual environment: this works with a stock
# Debian or Ubuntu python3 (PEP 668 forbids pip installs into it) and needs no
# --break-system-packages. Then run it: .venv/bin/gputrain-exporter
#   - Debian package python3-venv, only if this python3 cannot make a venv (apt-get, as root or
#     through sudo; it says so first)
#   - Python: this package and its dependencies (aiohttp, prometheus-client, nvidia-ml-py,
#     psutil, pyyaml, requests), into .venv only
# Usage: scripts/install.sh [what to pip install, default ".[top]": this package and rich for
#        `gputrain-exporter top`]   (PYTHON=python3.12 to choose)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    if ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
        sudo=""
        [ "$(id -u)" -eq 0 ] || sudo="sudo"
        echo "installing the Debian package python3-venv, which this python3 needs for a venv"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv >/dev/null
    fi
    # the system's packages stay visible: a machine that has torch already does not fetch it
    "$python" -m venv --system-site-packages .venv
    echo "created the virtual environment .venv (with $("$python" --version))"
fi
echo "installing gputrain-exporter and its dependencies into .venv"
if [ $# -eq 0 ]; then set -- ".[top]"; fi
.venv/bin/python -m pip install -q --disable-pip-version-check "$@"
echo "installed: .venv/bin/gputrain-exporter (or: .venv/bin/python -m exporter)"
