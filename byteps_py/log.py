"""Logging for every byteps process, configured by BYTEPS_LOG_LEVEL."""
import logging
import os
import sys
import time

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


class Throttled:
    """Warnings about peers a process does not control (strangers, malformed messages): at most
    ``limit`` of each kind (each format string) per ``window_s`` seconds, so a flood of one kind
    cannot hide another; the first one after a quiet spell says how many were not logged. A flood
    costs a counter, not a log line per message."""

    def __init__(self, limit=10, window_s=60.0, clock=time.monotonic):
        self.limit, self.window_s, self._clock = limit, window_s, clock
        self._start = None
        self._logged = {}  # format string -> lines logged in the current window
        self.suppressed = 0  # not logged in the current window, all kinds together

    def warning(self, msg, *args):
        now = self._clock()
        if self._start is None or now - self._start >= self.window_s:
            if self.suppressed:
                logger.warning("... %d more such warnings were not logged in the last %.0f s", self.suppressed,
                               self.window_s)
            self._start, self.suppressed = now, 0
            self._logged.clear()
        logged = self._logged.get(msg, 0)
        if logged < self.limit:
            self._logged[msg] = logged + 1
            logger.warning(msg, *args)
        else:
            self.suppressed += 1
