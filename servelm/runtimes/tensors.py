"""The Open Inference Protocol's tensor datatypes and their numpy dtypes."""

from __future__ import annotations

import numpy as np

DATATYPES = {"BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
             "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64", "FP16": "float16",
             "FP32": "float32", "FP64": "float64", "BYTES": "object"}
_BY_DTYPE = {np.dtype(v): k for k, v in DATATYPES.items() if v != "object"}


def numpy_dtype(datatype: str) -> np.dtype:
    """ValueError for a datatype the protocol does not have."""
    if datatype not in DATATYPES:
        raise ValueError(f"unknown datatype {datatype!r}; one of {', '.join(DATATYPES)}")
    return np.dtype(DATATYPES[datatype])


def datatype_of(dtype: np.dtype) -> str:
    """The protocol's name of a numpy dtype (strings and objects are BYTES)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OSU":
        return "BYTES"
    return _BY_DTYPE.get(dtype.newbyteorder("=") if dtype.byteorder not in "=|" else dtype, "FP64")
