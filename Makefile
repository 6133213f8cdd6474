# Two commands do all set-up on a fresh machine:
#   make train   installs everything, then runs a real 2-worker/2-server training job under bpslaunch
#   make test    installs everything plus test tools, then runs the whole test suite (CI runs this)
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned: an open range pulls a multi-GB CUDA build (docs/env.md, "Installing").
TORCH ?= torch==2.13.0
TENSORFLOW ?= tensorflow-cpu==2.21.0
UCX ?= libucx-cu12>=1.15

.PHONY: setup train test test-all test-ucx test-compat test-compat-long bench figures clean

setup: $(VENV)/.byteps-installed

$(VENV)/.byteps-installed: pyproject.toml setup.py core/*.pyx core/*.pxd core/*.pxi core/*/*.h summation/*.pyx summation/native/*.h
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" "$(TENSORFLOW)" "setuptools>=64" wheel "cython>=3.0,<3.4" "numpy>=1.26"
	# UCX's headers must be there when byteps builds (the UCX transport, docs/ucx.md): the ucx extra, first
	$(PY) -m pip install -q "$(UCX)"
	$(PY) -m pip install -q --no-build-isolation -e ".[test,ray,ucx]"
	touch $@

train: setup
	$(VENV)/bin/bpslaunch --local --workers 2 --servers 2 -- $(PY) examples/train_synthetic.py

test: setup mxnet-env
	$(PY) -m pytest -q

# Horovod's own test files and BytePS's examples, unmodified, on byteps (docs/compat.md): about 17-30 minutes
# on 2 loaded cores (torch 2 jobs ~6-10, TensorFlow ~13, examples ~6), so not in `make test`; CI runs both. The pinned files come from ../shared/compat or
# $BYTEPS_COMPAT_DIR (the tests skip, saying so, without them).
test-compat: setup
	$(PY) -m pytest -q -m compat tests/compat

# Horovod's test_tensorflow.py on 4 ranks (2 machines x 2 processes): 17-23 minutes on 2 cores
test-compat-long: setup
	$(PY) -m pytest -q -m compat_long tests/compat

# MXNet 1.9.1 imports only with numpy <= 1.23.5, so it gets its own venv, .venv-mxnet (docs/mxnet.md).
# Idempotent: returns at once when up to date; rebuilds byteps there when its sources changed.
.PHONY: mxnet-env
mxnet-env:
	python3 tests/mxnet_env.py

# Optional, as root: Debian's Slurm, so tests/test_slurm.py also runs jobs on a real (one-machine) Slurm
# instead of skipping that part (docs/slurm.md)
.PHONY: slurm-env
slurm-env:
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm

test-all: setup
	$(PY) -m pytest -q -m "slow or not slow"

# The push_pull, bad-input, fault and link tests again with every direct link over UCX's tcp transport
# (UCX must pass what the TCP links pass); about 5 minutes
.PHONY: test-ucx
test-ucx: setup
	BYTEPS_TRANSPORT=ucx UCX_TLS=tcp $(PY) -m pytest -q tests/test_push_pull.py tests/test_bad_input.py \
		tests/test_faults.py tests/test_links.py tests/test_ucx.py

# push_pull against gloo as users run it: one machine, and (as root) hosts in network namespaces
bench: setup
	$(PY) -m pip install -q matplotlib tqdm
	$(PY) bench/bench_sum.py --threads 1
	$(PY) bench/bench_push_pull.py --plot docs/img/push_pull_vs_gloo.png
	if [ "$$(id -u)" = 0 ]; then $(PY) bench/bench_users.py --layouts local,hosts --procs 2,3; \
	else echo "not root: the hosts layout (network namespaces) is left out"; $(PY) bench/bench_users.py --layouts local; fi

# every figure README's performance tables quote, 3 runs each, printed as those tables (as root: with the
# hosts layout and the emulated cluster; an hour or more: measure on an idle machine)
figures: setup
	$(PY) -m pip install -q tqdm
	$(PY) bench/figures.py

# 10,000 training steps; every process's memory, fds and throughput must stay flat (docs/benchmarks.md)
.PHONY: soak bench-cluster
soak: setup
	$(PY) bench/soak.py

# needs root (network namespaces, tc): the k/n placement against gloo and plain PS, then compression
bench-cluster: setup
	$(PY) -m pip install -q matplotlib tqdm
	$(PY) bench/emulated_cluster.py
	$(PY) bench/bench_compression.py

clean:
	rm -rf build dist *.egg-info core/*.so core/*.c
