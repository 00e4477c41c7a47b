# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY := .venv/bin/python
PIP := .venv/bin/pip

.PHONY: demo test test-full bench venv

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q torch==2.14.1 torchvision==0.29.1
	$(PIP) install -q -e '.[test]'
	touch $@

venv: .venv/.installed

demo: venv
	$(PY) -m ember demo

test: venv
	$(PY) -m pytest -q -n 2 -m "not slow" tests
	$(PY) -m tests.other_targets -n 2

test-full: venv
	$(PY) -m pytest -q -n 2 tests

bench: venv
	$(PY) bench/frontend.py
	$(PY) bench/cpu.py
