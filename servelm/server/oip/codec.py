"""Open Inference Protocol tensors to and from numpy: the REST JSON form (with the binary tensor data
extension that tritonclient uses by default) and the gRPC messages."""

from __future__ import annotations

import json
import struct

import numpy as np

from servelm.runtimes.tensors import datatype_of, numpy_dtype
from servelm.server.openai.protocol import APIError

HEADER = "inference-header-content-length"  # the binary extension: the JSON part's length


def error_body(err: APIError) -> dict:
    """The protocol's error shape, {"error": "<message>"} (its clients read a string there), with the OpenAI
    shape's code and param beside it."""
    return {"error": err.message, "code": err.code, "param": err.param}


def _tensor_array(t: dict, where: str, raw: bytes | None) -> np.ndarray:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
        raise APIError(400, f"{where} needs a name, datatype and shape", where)
    shape, datatype = t.get("shape"), t.get("datatype")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape) or len(shape) > 8:
        raise APIError(400, f"{where}.shape must be a list of at most 8 non-negative integers", f"{where}.shape")
    try:
        dtype = numpy_dtype(datatype) if isinstance(datatype, str) else numpy_dtype("?")
    except ValueError as e:
        raise APIError(400, f"{where}.datatype: {e}", f"{where}.datatype") from e
    count = int(np.prod(shape)) if shape else 1
    if raw is not None:
        if datatype == "BYTES":
            arr = np.array(_unpack_bytes(raw, where), dtype=object)
        else:
            if len(raw) != count * dtype.itemsize:
                raise APIError(400, f"{where}: {len(raw)} bytes of binary data for shape {shape} of {datatype}",
                               f"{where}.parameters.binary_data_size")
            arr = np.frombuffer(raw, dtype=dtype.newbyteorder("<"))
    else:
        if "data" not in t:
            raise APIError(400, f"{where} has no data", f"{where}.data")
        try:
            arr = np.asarray(t["data"], dtype=dtype if datatype != "BYTES" else object).reshape(-1)
        except (ValueError, TypeError, OverflowError) as e:
            raise APIError(400, f"{where}.data is not {datatype} data: {e}", f"{where}.data") from e
        if datatype != "BYTES" and dtype.kind == "f" and not np.isfinite(arr).all():
            raise APIError(400, f"{where}.data must be finite numbers", f"{where}.data")
    if arr.size != count:
        raise APIError(400, f"{where} has {arr.size} values for shape {shape} ({count})", f"{where}.data")
    return arr.reshape(shape)


def _unpack_bytes(raw: bytes, where: str) -> list[bytes]:
    """BYTES tensors in binary form: each element a 4-byte little-endian length, then its bytes."""
    out, i = [], 0
    while i < len(raw):
        if i + 4 > len(raw):
            raise APIError(400, f"{where}: malformed BYTES binary data", where)
        (n,) = struct.unpack_from("<I", raw, i)
        out.append(raw[i + 4:i + 4 + n])
        i += 4 + n
    return out


def decode_rest(body: bytes, header_length: str | None) -> tuple[dict[str, np.ndarray], list[str], set[str],
                                                                  dict, str | None]:
    """(inputs, requested outputs, outputs wanted as binary, request parameters, id) of a REST infer body."""
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise APIError(400, f"{HEADER} must be the length of the JSON part ({len(body)} bytes in all)")
        n = int(header_length)
        head, binary = body[:n], body[n:]
    else:
        head, binary = body, b""
    try:
        req = json.loads(head)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list) or not req["inputs"]:
        raise APIError(400, "the request needs a non-empty inputs list", "inputs")
    params = req.get("parameters") or {}
    if not isinstance(params, dict):
        raise APIError(400, "parameters must be an object", "parameters")
    inputs, offset = {}, 0
    for i, t in enumerate(req["inputs"]):
        tp = (t.get("parameters") or {}) if isinstance(t, dict) else {}
        size = tp.get("binary_data_size") if isinstance(tp, dict) else None
        raw = None
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise APIError(400, f"inputs.{i}.parameters.binary_data_size is past the binary data",
                               f"inputs.{i}.parameters.binary_data_size")
            raw, offset = binary[offset:offset + size], offset + size
        arr = _tensor_array(t, f"inputs.{i}", raw)
        if t["name"] in inputs:
            raise APIError(400, f"input {t['name']!r} is given twice", f"inputs.{i}.name")
        inputs[t["name"]] = arr
    outputs, binary_out = [], set()
    all_binary = params.get("binary_data_output") is True
    for i, o in enumerate(req.get("outputs") or []):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise APIError(400, f"outputs.{i} needs a name", f"outputs.{i}.name")
        outputs.append(o["name"])
        if (o.get("parameters") or {}).get("binary_data", all_binary) is True:
            binary_out.add(o["name"])
    if not outputs and all_binary:
        binary_out = {"*"}
    rid = req.get("id")
    return inputs, outputs, binary_out, params, rid if isinstance(rid, str) else None


def encode_rest(model: str, version: str, rid: str | None, outputs: dict[str, np.ndarray],
                binary: set[str]) -> tuple[bytes, dict[str, str]]:
    """The response body and its extra headers (the JSON part's length when some outputs are binary)."""
    tensors, chunks = [], []
    for name, arr in outputs.items():
        arr = np.asarray(arr)
        t = {"name": name, "datatype": datatype_of(arr.dtype), "shape": list(arr.shape)}
        if name in binary or "*" in binary:
            raw = _raw(arr)
            t["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            t["data"] = [x.decode() if isinstance(x, bytes) else x for x in arr.reshape(-1).tolist()]
        tensors.append(t)
    body = {"model_name": model, "model_version": version, "outputs": tensors}
    if rid is not None:
        body["id"] = rid
    head = json.dumps(body, separators=(",", ":")).encode()
    if not chunks:
        return head, {"content-type": "application/json"}
    return head + b"".join(chunks), {"content-type": "application/octet-stream", HEADER: str(len(head))}


def _raw(arr: np.ndarray) -> bytes:
    if datatype_of(arr.dtype) == "BYTES":
        out = bytearray()
        for x in arr.reshape(-1).tolist():
            b = x if isinstance(x, bytes) else str(x).encode()
            out += struct.pack("<I", len(b)) + b
        return bytes(out)
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def decode_grpc(req) -> tuple[dict[str, np.ndarray], list[str], dict]:
    """(inputs, requested outputs, parameters) of a ModelInferRequest."""
    raw = list(req.raw_input_contents)
    if raw and len(raw) != len(req.inputs):
        raise APIError(400, f"{len(raw)} raw_input_contents for {len(req.inputs)} inputs", "raw_input_contents")
    inputs = {}
    for i, t in enumerate(req.inputs):
        d = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if not raw:
            field = _CONTENTS.get(t.datatype)
            if field is None:
                d["data"] = []
            else:
                d["data"] = list(getattr(t.contents, field))
        arr = _tensor_array(d, f"inputs.{i}", raw[i] if raw else None)
        if t.name in inputs:
            raise APIError(400, f"input {t.name!r} is given twice", f"inputs.{i}.name")
        inputs[t.name] = arr
    params = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in req.parameters.items()
              if v.WhichOneof("parameter_choice")}
    return inputs, [o.name for o in req.outputs], params


def encode_grpc(pb, model: str, version: str, rid: str, outputs: dict[str, np.ndarray]):
    """A ModelInferResponse with the outputs as raw_output_contents (what tritonclient and KServe read)."""
    resp = pb.ModelInferResponse(model_name=model, model_version=version, id=rid)
    for name, arr in outputs.items():
        arr = np.asarray(arr)
        resp.outputs.add(name=name, datatype=datatype_of(arr.dtype), shape=list(arr.shape))
        resp.raw_output_contents.append(_raw(arr))
    return resp
