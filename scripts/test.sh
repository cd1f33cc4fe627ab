#!/usr/bin/env bash
# Install everything the test suite needs, then run all of it.
#   - Debian packages: prometheus (server + promtool), prometheus-alertmanager (server + amtool),
#     prometheus-node-exporter (the benchmark's anchor), victoria-metrics (VictoriaMetrics and
#     vmalert: the global layer of the scale-out test), chromium (draws the status page headless),
#     faketime (a daemon on a node whose clock is off: tests/test_clocks.py)
#   - Python, into the virtual environment .venv (scripts/install.sh): this package with its
#     [test], [top] and [stacks] (py-spy) extras, and tests/frameworks.txt at its versions (torch, lightning, keras,
#     transformers, accelerate); the README's quick start names the same list
#   - nvidia-ml-py at each release of the binding matrix, one small venv each under .venv-nvml/
#     (scripts/nvml_matrix.sh), where the NVML tests run again, beside the suite
# Usage: scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v amtool >/dev/null 2>&1 || missing+=(prometheus-alertmanager)
command -v prometheus-node-exporter >/dev/null 2>&1 || missing+=(prometheus-node-exporter)
command -v vmalert >/dev/null 2>&1 || missing+=(victoria-metrics)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v faketime >/dev/null 2>&1 || missing+=(faketime)
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "installing Debian packages (apt-get${sudo:+ through sudo}): ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
fi

# Everything Python goes into ./.venv (scripts/install.sh makes it: a stock Debian python3
# refuses pip installs, PEP 668), never into the system's python.
# --no-compile: pip would write the bytecode of every module it installs (torch's and the
# frameworks' thousands; bench/RESULTS.md has what the installs took with and without it);
# Python writes it for the modules the suite imports, the first time it imports them
bash scripts/install.sh --no-compile -e '.[test,top,stacks]'
py=.venv/bin/python
# PyTorch and the frameworks the integration tests drive, at the versions pinned in one place,
# installed while ruff and mypy check the code (mypy reads the frameworks as Any, so it never
# reads what is being installed): the install waits on the disk, the checks on the CPU
echo "installing the test frameworks into .venv: $(grep -v '^#' tests/frameworks.txt | xargs)"
$py -m pip install -q --no-compile --disable-pip-version-check -r tests/frameworks.txt &
frameworks=$!

checks=0
$py -m ruff check . || checks=$?
# the type check of the whole package (pyproject's [tool.mypy]): CI fails on a type error as
# on a failing test
$py -m mypy || checks=$?
wait "$frameworks"
[ "$checks" -eq 0 ] || exit "$checks"

# pytest caches the test modules it rewrites (assertion messages) as bytecode, unless told
# not to write any: with PYTHONDONTWRITEBYTECODE set (some images set it) each of the suite's
# workers and each run of the matrix below rewrote every test module anew, 7 s of CPU each.
# One collection first writes them (gitignored __pycache__/) for all of them to read
unset PYTHONDONTWRITEBYTECODE
$py -m pytest --collect-only -q -p no:cacheprovider >/dev/null

# the NVML binding matrix runs beside the suite (it needs only .venv), its output kept apart;
# the release .venv holds is the suite's own, so the matrix runs the others
matrix_log=$(mktemp)
NVML_SKIP_INSTALLED=1 bash scripts/nvml_matrix.sh -q >"$matrix_log" 2>&1 &
matrix=$!

# many of the suite's tests wait (Prometheus, promtool, torch ranks, Chromium, daemons, the
# regime test's minutes of real time): parallel workers (pytest-xdist) overlap the waiting
# with the computing, a test file each at a time, so a module's servers start once. Five on
# the 2-core CI machine: with four its cores were 81 % busy over a run (bench/RESULTS.md);
# GPUTRAIN_TEST_WORKERS=0 runs it in one process
workers=${GPUTRAIN_TEST_WORKERS:-5}
xdist=()
# the files in conftest.SLOW_FIRST's order, the longest first: xdist's own order (the files
# with the most tests first) left the longest for the end, one worker finishing alone
[ "$workers" = 0 ] || xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder)
set +e
$py -m pytest "${xdist[@]}" --durations=25 "$@"
rc=$?
wait "$matrix"
matrix_rc=$?
set -e
echo "--- the NVML tests under each nvidia-ml-py release of the binding matrix"
cat "$matrix_log"
rm -f "$matrix_log"
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure" >&2
    exit 1
fi
[ "$rc" -eq 0 ] || exit "$rc"
[ "$matrix_rc" -eq 0 ] || exit "$matrix_rc"
