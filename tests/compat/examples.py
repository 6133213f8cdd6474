"""BytePS's own examples (``example/pytorch``, ``keras``, ``tensorflow`` at the pinned commit), unmodified, on
byteps: each runs the BytePS way, as role processes (a scheduler, a server and two workers, each
``bpslaunch`` with its ``DMLC_*`` variables) and as ``bpslaunch --local --workers 2``, with small flags
on stand-in data (tests/compat/standin: MNIST files in torchvision's and Keras's formats, a stand-in
torchvision). :data:`EXAMPLES` says, per example, how it runs and when it counts as done, or why it
does not run here (docs/compat.md has the same table).

Command line: ``python tests/compat/examples.py [EXAMPLE ...] [--launch roles|local]`` runs them and
prints each outcome.
"""
import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402

STANDIN = os.path.join(HERE, "standin")


def _load_standin_data():
    """tests/compat/standin/data.py, loaded by its path: the folder itself (a stand-in torchvision, a
    sitecustomize) belongs on the examples' path only, never on this process's."""
    spec = importlib.util.spec_from_file_location("compat_standin_data", os.path.join(STANDIN, "data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


standin_data = _load_standin_data()

BPSLAUNCH = os.path.join(os.path.dirname(sys.executable), "bpslaunch")


class Example:
    """``args``: its small flags; ``data``: "torchvision" / "keras" (the stand-in MNIST files it reads);
    ``done``: a regex that the workers' log shows once the example has trained and communicated (an
    example whose loop length no flag shortens is stopped there); ``fails``: a regex of the error that
    makes it fail outside byteps, with ``why``; ``skip``: why it does not run here."""

    def __init__(self, args=(), data=None, done=None, fails=None, why=None, skip=None):
        self.args, self.data, self.done, self.fails, self.why, self.skip = list(args), data, done, fails, why, skip


_BENCH = ["--no-cuda", "--batch-size", "2", "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
          "--num-iters", "2"]
_TORCH_PROFILE = ("calls torch.autograd.profiler.profile(enabled, True), a signature torch 2.13 refuses "
                  "(TypeError), before any byteps call fails")
_TF1 = ("a TensorFlow 1 program (tf.ConfigProto, tf.layers, tf.train optimizers, tf.Session), which TensorFlow 2 "
        "removed from its namespace")
_CONFIG_PROTO = ("builds a TensorFlow 1 tf.ConfigProto for Keras's backend first, which TensorFlow 2 removed "
                 "(tf.compat.v1.ConfigProto; in TF2 tf.config.set_visible_devices and set_memory_growth)")
_OPT_VARIABLES = ("calls opt.variables() to broadcast the optimizer's state: a Keras 3 optimizer's variables is a "
                  "list property (opt.variables)")
_IMAGENET = "needs an ImageNet folder (ImageFolder / flow_from_directory); no stand-in for it"
_MOBILENET = ["--no-cuda", "--model", "MobileNetV3Small", "--batch-size", "1"]

EXAMPLES = {
    "pytorch/train_mnist_byteps.py": Example(
        ["--epochs", "1", "--no-cuda", "--batch-size", "32", "--test-batch-size", "64", "--log-interval", "2"],
        data="torchvision", done=r"Test set: Average loss: [\d.]+, Accuracy"),
    "pytorch/benchmark_byteps.py": Example(_BENCH, done=r"Total img/sec on 2 CPU"),
    "pytorch/elastic_benchmark_byteps.py": Example(_BENCH, fails=r"TypeError: .*profile", why=_TORCH_PROFILE),
    "pytorch/benchmark_byteps_ddp.py": Example(_BENCH, fails=r"TypeError: .*profile", why=_TORCH_PROFILE),
    "pytorch/benchmark_cross_barrier_byteps.py": Example(_BENCH, fails=r"TypeError: .*profile", why=_TORCH_PROFILE),
    "pytorch/mnist-distributed.py": Example(skip="needs a GPU (moves the model to cuda:<gpu>, NCCL)"),
    "pytorch/train_imagenet_resnet50_byteps.py": Example(skip=_IMAGENET),
    "pytorch/train_imagenet_resnet_byteps_ddp.py": Example(skip=_IMAGENET),
    "keras/keras_mnist.py": Example(data="keras", fails=r"no attribute 'ConfigProto'", why=_CONFIG_PROTO),
    "keras/keras_mnist_advanced.py": Example(data="keras", fails=r"no attribute 'ConfigProto'", why=_CONFIG_PROTO),
    "keras/keras_synthetic_benchmark_tf2.py": Example(
        _MOBILENET, fails=r"'keras.mixed_precision' has no attribute 'experimental'",
        why="wraps its optimizer in tf.keras.mixed_precision.experimental.LossScaleOptimizer, which Keras 3 removed "
            "(keras.mixed_precision.LossScaleOptimizer)"),
    "keras/keras_imagenet_resnet50.py": Example(skip=_IMAGENET),
    "tensorflow/synthetic_benchmark_tf2.py": Example(
        _MOBILENET + ["--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2"],
        fails=r"'list' object is not callable", why=_OPT_VARIABLES),
    "tensorflow/tensorflow2_mnist.py": Example(data="keras", fails=r"'list' object is not callable",
                                               why=_OPT_VARIABLES),
    "tensorflow/tensorflow2_keras_mnist.py": Example(
        data="keras", fails=r"unexpected keyword argument 'experimental_run_tf_function'",
        why="passes experimental_run_tf_function=False to model.compile, an argument Keras 3 removed (not needed)"),
    "tensorflow/tensorflow_keras_mnist.py": Example(data="keras", fails=r"no attribute 'ConfigProto'",
                                                    why=_CONFIG_PROTO),
    "tensorflow/tensorflow2_mnist_bps_MirroredStrategy.py": Example(
        skip="needs a GPU (builds its MirroredStrategy on /gpu:0)"),
    "tensorflow/tensorflow_mnist.py": Example(data="keras", fails=r"no attribute '(layers|placeholder|train|estimator)'",
                                              why=_TF1),
    "tensorflow/synthetic_benchmark.py": Example(["--no-cuda"], fails=r"no attribute 'ConfigProto'", why=_TF1),
}

#: every file name the keras/tensorflow examples pass to mnist.load_data
_KERAS_FILES = ["mnist.npz", "mnist-0.npz", "mnist-1.npz", "MNIST-data-0", "MNIST-data-1"]


class Outcome:
    def __init__(self, codes, log, stopped):
        self.codes, self.log, self.stopped = codes, log, stopped  # stopped: `done` seen, the rest killed

    def verdict(self, example):
        """None if the example did what :data:`EXAMPLES` says, else what went wrong."""
        if example.fails:
            if re.search(example.fails, self.log):
                return None
            return f"expected to fail with /{example.fails}/ ({example.why}); exit codes {self.codes}"
        if not re.search(example.done, self.log):
            return f"never printed /{example.done}/; exit codes {self.codes}"
        if not self.stopped and any(c != 0 for c in self.codes):
            return f"exit codes {self.codes}"
        return None


def _prepare(example, workdir):
    if example.data == "torchvision":
        for rank in range(2):
            standin_data.write_torchvision_mnist(os.path.join(workdir, f"data-{rank}"))
    if example.data == "keras":
        standin_data.write_keras_mnist(os.path.join(workdir, "keras_home"), _KERAS_FILES)


def run_example(name, workdir, launch="roles", timeout=300, pinned=None):
    """Run example ``name`` (a key of :data:`EXAMPLES`) with 2 workers; returns its :class:`Outcome`.
    ``launch``: "roles" (scheduler, server and worker processes, each ``bpslaunch``) or "local"
    (``bpslaunch --local``). Every process's output goes to ``workdir/<role>.log``."""
    pinned = pinned or harness.compat_dir()[0]
    example = EXAMPLES[name]
    os.makedirs(workdir, exist_ok=True)
    _prepare(example, workdir)
    script = os.path.join(pinned, "byteps", "example", name)
    command = [sys.executable, script, *example.args]
    env = harness.base_env(pinned, {"PYTHONPATH": os.pathsep.join([STANDIN, harness.ROOT]),
                                    "KERAS_HOME": os.path.join(workdir, "keras_home"),
                                    "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1"})
    if launch == "local":
        roles = [("launcher", [BPSLAUNCH, "--local", "--workers", "2", "--servers", "1", "--", *command], {})]
    else:
        port = harness.free_port()
        common = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port), "DMLC_NODE_HOST": "127.0.0.1"}
        roles = [("scheduler", [BPSLAUNCH], dict(common, DMLC_ROLE="scheduler")),
                 ("server", [BPSLAUNCH], dict(common, DMLC_ROLE="server")),
                 *[(f"worker{i}", [BPSLAUNCH, *command], dict(common, DMLC_ROLE="worker", DMLC_WORKER_ID=str(i)))
                   for i in range(2)]]
    procs = []
    for role, argv, extra in roles:
        log = open(os.path.join(workdir, f"{role}.log"), "wb")
        procs.append((role, subprocess.Popen(argv, env=dict(env, **extra), stdout=log, stderr=subprocess.STDOUT,
                                             cwd=workdir, start_new_session=True,
                                             preexec_fn=harness.make_preexec())))  # gone with this process
    workers = [p for role, p in procs if role.startswith(("worker", "launcher"))]
    deadline, stopped = time.monotonic() + timeout, False
    while time.monotonic() < deadline and any(p.poll() is None for p in workers):
        if example.done and re.search(example.done, _logs(workdir, procs)):
            stopped = True
            break
        time.sleep(0.5)
    if not stopped:  # the workers exited: give the scheduler and server a moment to leave
        end = time.monotonic() + 15
        while time.monotonic() < end and any(p.poll() is None for _, p in procs):
            time.sleep(0.2)
    for _, p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)
    return Outcome([p.returncode for p in workers], _logs(workdir, procs), stopped)


def _logs(workdir, procs):
    return "\n".join(open(os.path.join(workdir, f"{role}.log"), errors="replace").read() for role, _ in procs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("examples", nargs="*", default=[n for n, e in EXAMPLES.items() if not e.skip])
    ap.add_argument("--launch", choices=["roles", "local"], default="roles")
    ap.add_argument("--out", default=os.path.abspath("compat-examples"))
    args = ap.parse_args()
    pinned, why = harness.compat_dir()
    if pinned is None:
        sys.exit(why)
    for name in args.examples:
        t0 = time.monotonic()
        outcome = run_example(name, os.path.join(args.out, args.launch, name.replace("/", "_")), args.launch)
        verdict = outcome.verdict(EXAMPLES[name])
        print(f"{name} ({args.launch}): {verdict or 'ok'} in {time.monotonic() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
