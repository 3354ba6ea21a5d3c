VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NPROC ?= 4
export OMP_NUM_THREADS := 1

.PHONY: demo test install clean

$(STAMP): setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m autoparallel demo --nproc $(NPROC)

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info log out
