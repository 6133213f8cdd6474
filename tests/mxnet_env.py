"""Build (or check) `.venv-mxnet`, the separate virtual environment for `byteps.mxnet`.

MXNet 1.9.1 (the last release) imports only with numpy <= 1.23.5 (it uses ``np.bool``, removed
in numpy 1.24), while the main `.venv` has numpy 2.x for torch. So MXNet gets its own venv with
the supported combination pinned below, and byteps is installed into it non-editably, its Cython
extension compiled against that venv's numpy 1.23.5 (docs/mxnet.md).

    python3 tests/mxnet_env.py            # create or refresh .venv-mxnet (what `make mxnet-env` runs)
    python3 tests/mxnet_env.py --check    # exit 0 if up to date, 1 if missing or stale (prints why)

The install is built from a private copy of the sources in a temporary directory, so it never
touches the main tree's `build/` or the editable install's `core/*.so`. A stamp file inside the
venv records the pinned packages and a hash of the byteps sources: with nothing changed the
command returns at once; when only byteps sources changed, only byteps is rebuilt (~20 s).
Only the standard library is used, so any python3 >= 3.9 can run it.
"""
import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".venv-mxnet")
PYTHON = os.path.join(VENV, "bin", "python")
STAMP = os.path.join(VENV, ".byteps-mxnet-stamp.json")

#: The supported combination (docs/mxnet.md). numpy must stay <= 1.23.5 for mxnet 1.9.1.
MXNET = "mxnet==1.9.1"
NUMPY = "numpy==1.23.5"
PACKAGES = [NUMPY, MXNET, "pyzmq>=26.4", "psutil>=5.9", "cython>=3.0,<3.4", "setuptools>=64", "wheel",
            "pytest>=8"]

#: What goes into the byteps install (folders are copied whole, minus build products).
SOURCE_DIRS = ["byteps_py", "core", "summation", "scheduler", "topology", "plugins"]
SOURCE_FILES = ["setup.py", "pyproject.toml", "MANIFEST.in", "README.md"]
#: Sources whose change makes .venv-mxnet stale (the other plugins cannot be imported there).
HASHED = ["byteps_py", "core", "summation", "scheduler", "topology", os.path.join("plugins", "mxnet"),
          "setup.py", "pyproject.toml", "MANIFEST.in"]
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.c", "build", "*.egg-info")
_SKIP_SUFFIXES = (".pyc", ".so", ".c")


def source_hash():
    """sha256 over the paths and contents of the byteps sources that .venv-mxnet uses."""
    h = hashlib.sha256()
    files = [os.path.join(ROOT, f) for f in HASHED if os.path.isfile(os.path.join(ROOT, f))]
    for d in HASHED:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, d)):
            dirnames[:] = sorted(n for n in dirnames if n not in ("__pycache__", "build") and
                                 not n.endswith(".egg-info"))
            files += [os.path.join(dirpath, n) for n in sorted(filenames) if not n.endswith(_SKIP_SUFFIXES)]
    for path in files:
        if os.path.isfile(path):
            h.update(os.path.relpath(path, ROOT).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
            h.update(b"\0")
    return h.hexdigest()


def read_stamp():
    try:
        with open(STAMP) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def stale_reason():
    """None when .venv-mxnet is complete and built from the current sources, else why not."""
    if not os.access(PYTHON, os.X_OK):
        return f"{os.path.relpath(PYTHON, ROOT)} does not exist (run `make mxnet-env`)"
    stamp = read_stamp()
    if stamp is None:
        return "the venv has no stamp: it was never completed (run `make mxnet-env`)"
    if stamp.get("packages") != PACKAGES:
        return "the pinned packages changed (run `make mxnet-env`)"
    if stamp.get("source_hash") != source_hash():
        return "byteps sources changed since .venv-mxnet was built (run `make mxnet-env`)"
    return None


@contextlib.contextmanager
def locked():
    """Serialize builds of this checkout's .venv-mxnet (make and a test may both want one)."""
    key = hashlib.sha256(VENV.encode()).hexdigest()[:16]
    with open(os.path.join(tempfile.gettempdir(), f"byteps-mxnet-env-{key}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure(force=False):
    """Create or refresh .venv-mxnet unless it is up to date; returns whether it built anything."""
    with locked():
        if not force and stale_reason() is None:
            return False
        build(force=force)
        return True


def _run(argv, **kw):
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True, **kw)


def _pip(*args):
    _run([PYTHON, "-m", "pip", "--disable-pip-version-check", "-q", *args])


def build(force=False):
    t0 = time.monotonic()
    stamp = None if force else read_stamp()
    if not os.access(PYTHON, os.X_OK):
        _run([sys.executable, "-m", "venv", VENV])
        stamp = None
    if stamp is None or stamp.get("packages") != PACKAGES:
        _pip("install", "--upgrade", "pip")
        _pip("install", *PACKAGES)
        stamp = None
    digest = source_hash()
    if stamp is None or stamp.get("source_hash") != digest:
        # A private copy: pip builds local directories in place, and the main tree's build/ and
        # core/*.so belong to the editable install in .venv (compiled against numpy 2.x).
        with tempfile.TemporaryDirectory(prefix="byteps-mxnet-build-") as tmp:
            src = os.path.join(tmp, "src")
            os.makedirs(src)
            for d in SOURCE_DIRS:
                shutil.copytree(os.path.join(ROOT, d), os.path.join(src, d), ignore=_IGNORE, symlinks=True)
            for f in SOURCE_FILES:
                shutil.copy2(os.path.join(ROOT, f), src)
            # --no-build-isolation: compile against this venv's numpy 1.23.5, not the numpy>=1.26
            # that pyproject.toml's isolated build would fetch. --no-deps: the pins above already
            # satisfy byteps's dependencies, and pip must not move numpy.
            _pip("install", "--no-build-isolation", "--no-deps", "--force-reinstall", src)
    check = ("import numpy, mxnet, byteps, byteps.core._reduce, byteps.mxnet; "
             "print('numpy', numpy.__version__, 'mxnet', mxnet.__version__, 'byteps', byteps.__file__)")
    out = subprocess.run([PYTHON, "-c", check], cwd=tempfile.gettempdir(), check=True, capture_output=True,
                         text=True).stdout.strip()
    print(out)
    versions = out.split()
    if versions[1] != NUMPY.split("==")[1] or versions[3] != MXNET.split("==")[1]:
        raise RuntimeError(f"unexpected versions in .venv-mxnet: {out}")
    with open(STAMP, "w") as f:
        json.dump({"packages": PACKAGES, "source_hash": digest, "versions": out}, f, indent=1)
    print(f".venv-mxnet is ready ({time.monotonic() - t0:.1f} s)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only report whether .venv-mxnet is up to date")
    ap.add_argument("--force", action="store_true", help="reinstall the packages and byteps")
    args = ap.parse_args()
    if args.check:
        reason = stale_reason()
        print(reason or ".venv-mxnet is up to date")
        sys.exit(1 if reason else 0)
    if not ensure(force=args.force):
        print(".venv-mxnet is up to date")


if __name__ == "__main__":
    main()
