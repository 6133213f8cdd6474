"""An alltoall's splits, checked alike on every rank (byteps.torch and byteps.tensorflow).

Each rank sends its row of the table (:func:`splits_row`) in the alltoall's first gather; every rank then
checks every row (:func:`send_table`). Bad splits on one rank so fail the alltoall on every rank at once,
naming that rank: a rank that refused alone would leave the others waiting for its part until
BYTEPS_TIMEOUT.
"""
import numpy as np


def splits_row(rows, splits, n):
    """This rank's row: [dim 0 (-1: a scalar), how many splits it gave (-1: none: equal blocks), its first
    ``n`` splits (zero-padded)], as int64."""
    row = np.zeros(n + 2, dtype=np.int64)
    row[0], row[1] = rows, -1
    if splits is not None:
        given = np.asarray(splits, dtype=np.int64).reshape(-1)
        row[1] = given.size
        row[2:2 + min(n, given.size)] = given[:n]
    return row


def _problem(rank, row, n):
    rows, count, splits = int(row[0]), int(row[1]), row[2:]
    if rows < 0:
        return f"rank {rank}'s tensor is a scalar (alltoall splits dim 0)"
    if count < 0:
        return None if rows % n == 0 else (f"rank {rank}'s dim 0 ({rows}) must be divisible by the number of ranks "
                                           f"({n}) when it gives no splits")
    if count != n or (splits < 0).any() or splits.sum() > rows:
        shown = splits.tolist() if count == n else f"{count} entries"
        return f"rank {rank}'s splits ({shown}) must be {n} non-negative entries summing to at most its dim 0 ({rows})"
    return None


def rows_sent(row, n):
    """How many rows (from the top of dim 0) a rank whose row is ``row`` sends: none if its splits are wrong."""
    if _problem(0, row, n):
        return 0
    return int(row[2:].sum()) if row[1] >= 0 else int(row[0])


def send_table(name, rows_of_ranks):
    """``rows_of_ranks``: every rank's :func:`splits_row`, in rank order. Returns ``table[src][dst]``, the rows
    ``src`` sends to ``dst``; ValueError naming every rank whose splits are wrong."""
    table = np.asarray(rows_of_ranks, dtype=np.int64)
    n = table.shape[0]
    problems = [p for p in (_problem(r, row, n) for r, row in enumerate(table)) if p]
    if problems:
        raise ValueError(f"alltoall {name!r}: " + "; ".join(problems))
    return np.stack([row[2:] if row[1] >= 0 else np.full(n, row[0] // n) for row in table])
