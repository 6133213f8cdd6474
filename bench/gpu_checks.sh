#!/usr/bin/env bash
# Every check that needs a GPU, in one run on a CUDA machine (results: docs/benchmarks.md, "GPU").
#
#   bench/gpu_checks.sh [OUTDIR]        # default OUTDIR: bench/results/gpu
#   GPU_CHECKS="tests train" bench/gpu_checks.sh   # some of: tests stages users cpu train partition
#                                                  # (default: all but cpu, the CPU-tensor run for scale)
#
# Uses the python3 on PATH (or $PYTHON), which must hold torch with CUDA, numpy, Cython, pytest and
# pytest-timeout; pyzmq is installed from wheels in .whl/ when that python lacks it (a machine with no
# package index). Steps: build byteps in place and install it editable (no dependencies fetched), run
# the GPU tests (the ones needing more GPUs than the machine has skip, saying so), then the GPU
# benchmarks: on a machine of 2 or more GPUs, push_pull of CUDA tensors on the NCCL stages (one process
# per GPU, BYTEPS_LOCAL_STRATEGY=topology, beside the default strategy), and push_pull of CUDA tensors
# against gloo as users call them (bench_users.py --device cuda, and --device cpu beside it), and a
# training step against DDP (bench_users.py --train --device cuda), then that step again with 4 MB
# partitions and the default alternating (an A/B of autotune's choice). Logs and JSON go to OUTDIR, and
# OUTDIR/summary.md sets the ratios against their targets (bench/gpu_summary.py). About 6 minutes on one
# H200 with 16 cores, 7 with the A/B.
set -u
OUTDIR=${1:-bench/results/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
if ! "$PY" -c "import zmq" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/bps-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/bps-site${PYTHONPATH:+:$PYTHONPATH}
fi
{
    date -u
    nvidia-smi -L
    nproc
    echo "RDMA devices: $(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ' || true)"
    "$PY" -c "import sys, torch, numpy, Cython, zmq; print(sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'numpy', numpy.__version__, 'cython', Cython.__version__, 'pyzmq', zmq.__version__)"
} 2>&1 | tee "$OUTDIR/machine.txt"

step() { echo "== $* ($(date -u +%T))"; }
want() { [[ " ${GPU_CHECKS:-tests stages users train partition} " == *" $1 "* ]]; }

step build
# the extensions in parallel first; the editable install then finds them up to date
if ! { "$PY" setup.py -q build_ext --inplace -j "$(nproc)" &&
       "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .; } >"$OUTDIR/build.log" 2>&1; then
    tail -40 "$OUTDIR/build.log"
    exit 1
fi
"$PY" -c "import byteps.core._worker_core, byteps.server._server_core; from byteps.core import gpu; \
print('GPU:', gpu.unavailable_reason() or 'CUDA and NCCL work')" || exit 1

tests=0
if want tests; then
step tests
# --basetemp: the tests' files (timelines, the fake runtime) stay in OUTDIR for a failure's post-mortem
PYTHONPATH=tests${PYTHONPATH:+:$PYTHONPATH} "$PY" -m pytest -q -p no:cacheprovider --timeout 300 -rs \
    --basetemp "$OUTDIR/pytest" \
    tests/test_local_strategy.py::test_nccl_stages_on_gpus \
    tests/test_local_strategy.py::test_cuda_tensors_on_the_default_path \
    tests/test_gpu_native.py tests/test_nccl_stages.py \
    2>&1 | tee "$OUTDIR/tests.log" | tail -25
tests=${PIPESTATUS[0]}
fi


# bench_users.py as users run it, its output in OUTDIR/users-LABEL.{md,json,err}: users LABEL ARGS...
users() {
    local label=$1
    shift
    "$PY" bench/bench_users.py "$@" --json "$OUTDIR/users-$label.json" >"$OUTDIR/users-$label.md" \
        2>"$OUTDIR/users-$label.err"
    head -45 "$OUTDIR/users-$label.md"
    tail -5 "$OUTDIR/users-$label.err"
}
COLLECTIVES=(--layouts machines,local --procs 2 --sizes 4KB,1MB,16MB,64MB --patterns inplace,fresh,outofplace
             --names fixed --repeat 3)

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if want stages && [ "$GPUS" -ge 2 ]; then  # NCCL needs a GPU per process
    step "NCCL stages on $GPUS GPUs"
    users nccl-topology --device cuda --layouts local --procs "$GPUS" --sizes 1MB,16MB,64MB --patterns inplace \
        --names fixed --repeat 3 --env BYTEPS_LOCAL_STRATEGY=topology
    users nccl-owners --device cuda --layouts local --procs "$GPUS" --sizes 1MB,16MB,64MB --patterns inplace \
        --names fixed --repeat 3
elif want stages; then
    step "NCCL stages: skipped, $GPUS GPU (they need one per process)"
fi

if want users; then
    step bench_users
    users cuda --device cuda "${COLLECTIVES[@]}"
fi
if want cpu; then
    step bench_users cpu  # the same job with CPU tensors on this machine: what the staging costs
    users cpu --device cpu "${COLLECTIVES[@]}"
fi
if want train; then
    step bench_users train  # a training step: DistributedOptimizer against DDP over gloo, the model on the GPU
    users train-cuda --train --device cuda --layouts machines,local --procs 2 --repeat 5
fi
if want partition; then
    # the partition size autotune picks for the model (1 MB for the 73 MB MLP at the link the probe
    # reads) against BytePS's 4 MB, alternating between machines: an A/B, not the default
    step bench_users train, partition A/B
    TRAIN_AB=(--train --device cuda --layouts machines --procs 2 --repeat 5)
    users train-4mb-1 "${TRAIN_AB[@]}" --env BYTEPS_PARTITION_BYTES=4194304
    users train-default-2 "${TRAIN_AB[@]}"
    users train-4mb-2 "${TRAIN_AB[@]}" --env BYTEPS_PARTITION_BYTES=4194304
fi
step "done in ${SECONDS} s"
"$PY" bench/gpu_summary.py "$OUTDIR" >"$OUTDIR/summary.md"
cat "$OUTDIR/summary.md"
exit "$tests"
