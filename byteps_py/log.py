"""Logging for every byteps process, configured by BYTEPS_LOG_LEVEL."""
import logging
import os
import sys

_LEVELS = {"TRACE": 5, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
           "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}
logging.addLevelName(5, "TRACE")

logger = logging.getLogger("byteps")


def parse_level(value):
    """Map a BYTEPS_LOG_LEVEL value to a logging level; raises ValueError on an unknown name."""
    name = (value or "WARNING").strip().upper()
    if name not in _LEVELS:
        raise ValueError(f"BYTEPS_LOG_LEVEL={value!r} is not one of {', '.join(_LEVELS)}")
    return _LEVELS[name]


def setup(role="worker", ident=""):
    """Install one stderr handler whose prefix names the process ("[byteps worker 1]")."""
    logger.setLevel(parse_level(os.environ.get("BYTEPS_LOG_LEVEL")))
    for h in list(logger.handlers):
        logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    stamp = "" if os.environ.get("BYTEPS_LOG_HIDE_TIME") == "1" else "%(asctime)s "
    handler.setFormatter(logging.Formatter(f"{stamp}[byteps {role}{' ' + str(ident) if ident != '' else ''}] "
                                           "%(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    return logger
