"""Wire dtype codes shared by workers, servers and the Cython kernels (core/kernels/bps_dtypes.h)."""
import numpy as np

FLOAT32, FLOAT64, FLOAT16, BFLOAT16, INT32, INT64, UINT8, INT8 = range(8)

#: code -> (name, element size in bytes)
INFO = {
    FLOAT32: ("float32", 4), FLOAT64: ("float64", 8), FLOAT16: ("float16", 2), BFLOAT16: ("bfloat16", 2),
    INT32: ("int32", 4), INT64: ("int64", 8), UINT8: ("uint8", 1), INT8: ("int8", 1),
}
BY_NAME = {name: code for code, (name, _) in INFO.items()}
FLOATING = {FLOAT32, FLOAT64, FLOAT16, BFLOAT16}


def name(code):
    return INFO[code][0]


def itemsize(code):
    return INFO[code][1]


def from_name(dtype_name):
    """Code for a dtype name such as 'float32' or 'torch.bfloat16'; ValueError if unsupported."""
    key = str(dtype_name).rsplit(".", 1)[-1]
    if key not in BY_NAME:
        raise ValueError(f"unsupported dtype {dtype_name}; supported: {', '.join(BY_NAME)}")
    return BY_NAME[key]


def numpy_view_dtype(code):
    """A numpy dtype with the code's element size (bfloat16 has none: its bits are viewed as uint16)."""
    return np.dtype(np.uint16) if code == BFLOAT16 else np.dtype(name(code))
