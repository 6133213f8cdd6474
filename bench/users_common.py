"""What bench_users.py and its parts share: the sizes, spreads and table cells, the worker's device."""
import statistics

SIZES = {"4KB": 4 << 10, "64KB": 64 << 10, "1MB": 1 << 20, "16MB": 16 << 20, "64MB": 64 << 20,
         "256MB": 256 << 20}
LATENCY_SIZES = ("4KB", "64KB", "1MB")


def spread(values):
    """(median, min, max) of a non-empty list, else (None, None, None)."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None, None
    return statistics.median(values), min(values), max(values)


def _f(x, fmt=".2f"):
    return "—" if x is None else format(x, fmt)


def device(args, torch):
    """The torch device of this worker's tensors (``--device``): a CUDA worker takes GPU local_rank
    modulo the GPUs there are, so processes share a GPU when there are fewer GPUs than processes."""
    if args.device == "cpu":
        return torch.device("cpu")
    import byteps.torch as bps

    return torch.device("cuda", bps.local_rank() % torch.cuda.device_count())
