"""The non-editable install: build a wheel, install it alone, import every subpackage, run a job.

Editable installs hide packaging mistakes (nested packages missing from the wheel, sources
missing from the sdist, since `package_dir` maps top-level folders onto one package), so CI tests a wheel.
"""
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBPACKAGES = ["byteps", "byteps.core", "byteps.core._reduce", "byteps.core._pipeline", "byteps.server",
               "byteps.scheduler", "byteps.tensorflow",
               "byteps.topology", "byteps.torch", "byteps.launcher"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    ROOT], check=True, timeout=600)
    (whl,) = [f for f in os.listdir(out) if f.endswith(".whl")]
    return out / whl


@pytest.mark.timeout(900)
def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("byteps/core/_reduce") and n.endswith(".so") for n in names), names
    assert not any(n.endswith(".c") for n in names), "generated C sources must not ship"
    for pkg in ["byteps/__init__.py", "byteps/VERSION", "byteps/core/engine.py", "byteps/server/server.py",
                "byteps/scheduler/scheduler.py", "byteps/torch/__init__.py", "byteps/topology/__init__.py",
                "byteps/ray/executor.py", "byteps/cluster_env.py"]:
        assert pkg in names, pkg
    assert any(n.endswith("entry_points.txt") for n in names)


@pytest.mark.timeout(900)
def test_installed_wheel_imports_and_runs_a_job(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    # run outside the repository so nothing can import the source tree by accident
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    code = ("import importlib, byteps; "
            f"mods = [importlib.import_module(m) for m in {SUBPACKAGES!r}]; "
            "print(byteps.__file__)")
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().startswith(str(site)), p.stdout
    script = tmp_path / "job.py"
    script.write_text("import torch, byteps.torch as bps\n"
                      "bps.init()\n"
                      "t = torch.full((3,), float(bps.rank() + 1))\n"
                      "assert bps.push_pull(t, average=False, name='t').tolist() == [3.0] * 3\n"
                      "assert bps.__file__.startswith(%r)\n"
                      "bps.shutdown()\n" % str(site))
    p = subprocess.run([sys.executable, "-m", "byteps.launcher", "--local", "--workers", "2", "--servers", "1", "--",
                        sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
