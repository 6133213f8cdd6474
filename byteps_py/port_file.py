"""The scheduler's port file: how a scheduler that bound a free port tells whoever started it.

The scheduler writes the port and a newline to BYTEPS_SCHEDULER_PORT_FILE (a temporary name renamed
into place); bpslaunch, rank 0 of a torchrun/mpirun job and the Ray services wait for it.
"""
import os
import time


def write(path, port):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)


def read(path):
    """The port in ``path``, or None while it is not there (yet); ValueError if it is not a port."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    if not text.endswith("\n"):
        return None  # not complete yet (the scheduler renames it into place, but be safe)
    try:
        port = int(text.strip(), 10)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise ValueError(f"malformed port {text.strip()!r}")
    return port


def wait(path, exited, limit, tick=0.02, check=None):
    """The port once the scheduler has written it to ``path``, polled every ``tick`` seconds after
    ``check()`` (which may raise); None when ``exited()`` says the scheduler ended first; TimeoutError
    after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while True:
        if check is not None:
            check()
        port = read(path)
        if port is not None:
            return port
        if exited():
            return None
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no port in {path} within {limit:g} s")
        time.sleep(tick)
