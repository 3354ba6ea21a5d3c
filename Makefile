VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NPROC ?= 4
export OMP_NUM_THREADS := 1
# compiled modules are cached (__pycache__): a shell with PYTHONDONTWRITEBYTECODE set made every pytest worker
# rewrite and compile all test modules, and every launched rank compile what it imports, on every run; `test`
# compiles the sources once (1.7 s) before its workers and ranks start, so a fresh clone's first run does not pay
# it in every process
export PYTHONDONTWRITEBYTECODE :=

.PHONY: demo test test-fast install clean

$(STAMP): setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,test,models]'
	touch $(STAMP)

install: $(STAMP)

# the main job: a byte-level GPT trained on 4 CPU ranks (DP2 x TP2) with paddle.distributed.launch,
# compared at the end with the single-process loss of the same run
demo: $(STAMP)
	mkdir -p out
	$(PY) -m autoparallel demo --nproc $(NPROC) --script examples/train_gpt.py -- --dp 2 --tp 2 --steps 20 --seed 0 --log-json out/demo_dp2tp2.json
	$(PY) examples/train_gpt.py --steps 20 --seed 0 --log-json out/demo_single.json
	$(PY) tools/compare_logs.py out/demo_single.json out/demo_dp2tp2.json

# three pytest-xdist workers on two cores: the real-rank launches run on one worker (conftest: one xdist unit) and
# leave part of a core idle while ranks wait on each other, which the third worker fills (docs/test_suite.md)
TEST_WORKERS ?= 3
test: $(STAMP)
	$(PY) -m compileall -q -j 0 autoparallel spmd_rules reshard examples tools tests > /dev/null
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --max-worker-restart 0 tests

# the inner loop: every test that starts no process (markers pure and sim)
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not dist" tests

clean:
	rm -rf $(VENV) build *.egg-info log out
