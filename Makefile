# The developer's commands (CONTRIBUTING.md). `make test` is what CI runs (.ci/run).
PY := .venv/bin/python

.PHONY: generate check fast typecheck lint test

generate:  ## rewrite every file made from the catalogue
	$(PY) scripts/generate.py

check:  ## fail on a stale generated file
	$(PY) scripts/generate.py --check

fast:  ## the unit tests: nothing that starts a process, a server or a socket
	$(PY) -m pytest -q -m "not integration"

typecheck:
	$(PY) -m mypy

lint:
	$(PY) -m ruff check .

test:  ## everything CI runs: installs what the tests need, then the whole suite
	bash scripts/test.sh -q
