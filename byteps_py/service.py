"""The body of ``python -m byteps.scheduler`` and ``python -m byteps.server``: one way for a service
process to load its configuration, log, run, and turn how it ended into an exit code."""
import sys

from . import config
from .errors import BytePSError, ConfigError
from .log import logger, setup as setup_logging

#: exit codes: 1 the service failed (its error is logged), 2 its configuration is wrong, 130 Ctrl-C
EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 1, 2, 130


def main(role, make):
    """Run the service ``make(cfg)`` builds for ``role`` ("scheduler" or "server"): an object with
    ``run()`` (returns the exit code) and ``close()`` (always called once it exists)."""
    try:
        cfg = config.load(role=role)
    except ConfigError as e:
        print(f"byteps {role}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(role)
    try:
        service = make(cfg)
    except ConfigError as e:
        logger.error("%s", e)
        return EXIT_CONFIG
    try:
        return service.run()
    except BytePSError as e:
        logger.error("%s", e)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        service.close()
