#!/usr/bin/env bash
# The binding matrix: the NVML tests (pytest -m nvml: the real nvidia-ml-py binding over the fake
# driver of tests/fake_nvml.py) under each nvidia-ml-py release below, each in its own small
# virtual environment .venv-nvml/<version> whose own site-packages hold only that nvidia-ml-py
# (from PyPI, with pip) and which otherwise sees .venv's packages. scripts/test.sh runs it after
# the suite; it needs .venv made first (scripts/install.sh).
# Usage: scripts/nvml_matrix.sh [extra pytest args] [test files]
#   NVML_BINDINGS="a b": the releases to run (default below);
#   NVML_SKIP_INSTALLED=1: leave out the release .venv holds, under which the suite itself has
#   run the same tests (scripts/test.sh sets it)
# Without test files it runs the files that mark tests `nvml` (`mark.nvml` in their text):
# collecting the whole suite only to deselect a thousand tests cost 17 s of CPU a release.
set -euo pipefail
cd "$(dirname "$0")/.."
# the oldest the pyproject allows, the 12.575 line (the first with the clock-event fields),
# the newest
read -r -a bindings <<< "${NVML_BINDINGS:-12.535.108 12.575.51 13.615.71}"
py=.venv/bin/python
if [ "${NVML_SKIP_INSTALLED:-0}" = 1 ]; then
    installed=$($py -c "import importlib.metadata as m; print(m.version('nvidia-ml-py'))")
    kept=()
    for version in "${bindings[@]}"; do
        if [ "$version" = "$installed" ]; then
            echo "nvidia-ml-py $version: .venv's own, under which the suite ran the NVML tests"
        else
            kept+=("$version")
        fi
    done
    bindings=("${kept[@]}")
fi
args=("$@")
named_file=0
for arg in "$@"; do
    case "$arg" in -*) ;; *) named_file=1 ;; esac
done
if [ "$named_file" = 0 ]; then
    mapfile -t files < <(grep -l -E 'mark\.nvml' tests/*.py tests/*/*.py 2>/dev/null | sort)
    args+=("${files[@]}")
fi
base=$($py -c 'import sys; print(sys._base_executable)')
base_site=$($py -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for version in "${bindings[@]}"; do
    env=.venv-nvml/$version
    if ! "$env/bin/python" -c "import importlib.metadata as m, sys
sys.exit(m.version('nvidia-ml-py') != '$version')" 2>/dev/null; then
        rm -rf "$env"
        "$base" -m venv --without-pip --system-site-packages "$env"
        site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        $py -m pip install -q --disable-pip-version-check --no-deps --target "$site" \
            "nvidia-ml-py==$version"
        # after its own site-packages: .venv's (pytest, prometheus-client, ...), .pth files too
        echo "import site; site.addsitedir('$base_site')" > "$site/_gputrain_venv.pth"
    fi
    "$env/bin/python" -c "import importlib.metadata as m, pynvml, sys
assert m.version('nvidia-ml-py') == '$version' and '/.venv-nvml/' in pynvml.__file__, pynvml.__file__"
    echo "NVML tests under nvidia-ml-py $version"
    set +e
    "$env/bin/python" -m pytest -m nvml -p no:cacheprovider "${args[@]}"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then
        echo "nvidia-ml-py $version: pytest collected no NVML tests: that is a failure" >&2
        exit 1
    elif [ "$rc" -ne 0 ]; then
        echo "nvidia-ml-py $version: the NVML tests failed" >&2
        exit "$rc"
    fi
done
