"""Build script for byteps: maps the fixed top-level layout onto the `byteps` package.

The tree keeps each part of the system in its own top-level folder (see docs/architecture.md);
setuptools' `package_dir` maps them under one import name. Cython does not follow
`package_dir`, so `cython_include_tree()` builds a symlinked `byteps/` tree for cimports
(a `cimport byteps.core...` must find the .pxd/.pyx files under a folder named like the package).
"""
import glob
import os

from setuptools import Extension, find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))

#: import name -> folder in this repository
PACKAGE_DIR = {
    "byteps": "byteps_py",
    "byteps.core": "core",
    "byteps.server": "summation",
    "byteps.scheduler": "scheduler",
    "byteps.topology": "topology",
    "byteps.torch": "plugins/torch",
    "byteps.tensorflow": "plugins/tensorflow",
    "byteps.keras": "plugins/keras",
    "byteps.mxnet": "plugins/mxnet",
    "byteps.ray": "plugins/ray",
}


def packages():
    """Every package and nested subpackage (an explicit list misses nested ones in wheels)."""
    found = []
    for pkg, src in PACKAGE_DIR.items():
        found.append(pkg)
        found += [f"{pkg}.{sub}" for sub in find_packages(os.path.join(HERE, src), exclude=["tests*"])]
    return found


def cython_include_tree():
    """Create build/cython-include/byteps/<sub> -> ../../../<folder> so cimports resolve."""
    root = os.path.join(HERE, "build", "cython-include", "byteps")
    os.makedirs(root, exist_ok=True)
    open(os.path.join(root, "__init__.pxd"), "a").close()
    for pkg, src in PACKAGE_DIR.items():
        if pkg == "byteps":
            continue
        link = os.path.join(root, pkg.split(".", 1)[1])
        target = os.path.relpath(os.path.join(HERE, src), root)
        if not os.path.islink(link):
            os.symlink(target, link)
    return os.path.dirname(root)


def ucx_include_dir():
    """UCX's headers for the UCX transport (core/transport/bps_ucx.h): the libucx wheel's (pip install
    libucx-cu12), else a system UCX's (Debian libucx-dev); None builds without it (docs/ucx.md).
    Only the headers are needed: libucp is loaded at run time (core/ucx.py), never linked."""
    if os.environ.get("BYTEPS_BUILD_UCX", "1") == "0":
        return None
    import importlib.util
    spec = importlib.util.find_spec("libucx")
    candidates = [os.path.join(os.path.dirname(spec.origin), "include")] if spec and spec.origin else []
    candidates.append("/usr/include")
    for inc in candidates:
        if os.path.exists(os.path.join(inc, "ucp", "api", "ucp.h")):
            return inc
    return None


def extensions():
    """Cython extensions. Portable baseline flags; wider SIMD is dispatched at run time."""
    import numpy
    from Cython.Build import cythonize

    # every native header is included by its path from the repository root ("core/transport/bps_link.h")
    # no OpenMP: core/kernels/bps_pool.h has its own pool of helpers that sleep between calls (libgomp's spin)
    compile_args = ["-O3", "-fno-strict-aliasing", "-pthread"]
    link_args = ["-pthread"]
    ucx = ucx_include_dir()
    # the native cores get the UCX transport when its headers are here (libucp is dlopen()ed: -ldl)
    ucx_macros, ucx_includes, ucx_libs = ([("BPS_HAVE_UCX", "1")], [ucx], ["dl"]) if ucx else ([], [], [])
    # the C++ is all headers: a change to any of them rebuilds the extensions (Cython sees only those it names)
    headers = sorted(glob.glob(os.path.join("core", "**", "*.h"), recursive=True)
                     + glob.glob(os.path.join("summation", "native", "*.h")))
    exts = [
        Extension(
            "byteps.core._reduce",
            ["core/_reduce.pyx"],
            depends=headers,
            include_dirs=[HERE, numpy.get_include()],
            language="c++",
            # the codecs (bps_codecs.h) must round once per operation: no fused multiply-adds
            extra_compile_args=compile_args + ["-std=c++17", "-ffp-contract=off"],
            extra_link_args=link_args,
        ),
        Extension(
            "byteps.core._pipeline",
            ["core/_pipeline.pyx"],
            include_dirs=[HERE],
            language="c++",
            extra_compile_args=["-O2", "-std=c++17"],
        ),
        Extension(  # the worker's native data plane (libzmq, the one pyzmq loaded: core/transport/bps_zmq.h)
            "byteps.core._worker_core",
            ["core/_worker_core.pyx"],
            depends=headers,
            include_dirs=[HERE] + ucx_includes,
            define_macros=ucx_macros,
            libraries=["dl"],  # dlopen: libzmq, the CUDA runtime (core/pipeline/cuda_runtime.h) and UCX
            language="c++",
            # the local reduce's sums (bps_reduce.h) are compiled as in _reduce, and the wire codecs
            # (bps_codecs.h, encoded and decoded by byteps-net) round once per operation as there
            extra_compile_args=["-O3", "-std=c++17", "-fno-strict-aliasing", "-pthread", "-ffp-contract=off"],
            extra_link_args=["-pthread"],
        ),
        Extension(  # the server's native data plane (summation/native/bps_server.h)
            "byteps.server._server_core",
            ["summation/_server_core.pyx"],
            depends=headers,
            include_dirs=[HERE] + ucx_includes,
            define_macros=ucx_macros,
            libraries=ucx_libs,
            language="c++",
            extra_compile_args=["-O2", "-std=c++17", "-fno-strict-aliasing", "-pthread"],
            extra_link_args=["-pthread"],
        ),
        Extension(  # empties the native span buffers of the two cores above (BYTEPS_TIMELINE)
            "byteps.core._trace",
            ["core/_trace.pyx"],
            include_dirs=[HERE],
            language="c++",
            extra_compile_args=["-O2", "-std=c++17"],
        ),
    ]
    return cythonize(
        exts,
        include_path=[cython_include_tree()],
        build_dir="build/cython",
        compiler_directives={"language_level": 3, "boundscheck": False, "wraparound": False,
                             "cdivision": True, "initializedcheck": False},
    )


def read_version():
    with open(os.path.join(HERE, "byteps_py", "VERSION")) as f:
        return f.read().strip()


setup(
    version=read_version(),
    packages=packages(),
    package_dir=PACKAGE_DIR,
    package_data={"byteps": ["VERSION", "py.typed"],
                  "byteps.core": ["*.pxd", "*.pyi", "transport/*.h", "pipeline/*.h", "kernels/*.h"],
                  "byteps.server": ["native/*.h"],
                  "byteps.topology": ["fixtures/*.json"]},  # example machines (docs/topology.md)
    ext_modules=extensions(),
    zip_safe=False,
)
