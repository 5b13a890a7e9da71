"""Runtimes for non-LLM models (the Open Inference Protocol's models): scikit-learn, XGBoost and ONNX.

A predictor takes named numpy arrays whose first axis is the batch and returns named arrays with the same
first axis, so the batcher can stack several requests into one call and split the result. Each runtime is an
optional extra (`servelm[sklearn]`, `servelm[xgboost]`, `servelm[onnx]`), imported only when a model of its
kind is loaded.

Artifacts: a file, or a folder holding one `model.<ext>` file: `.joblib`/`.pkl` (scikit-learn, loaded with
joblib: only load artifacts you trust, a pickle runs code), `.ubj` or an XGBoost `.json` (XGBoost's own
formats), `.onnx` (onnxruntime).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

RUNTIMES = ("sklearn", "xgboost", "onnx")
_EXT = {".joblib": "sklearn", ".pkl": "sklearn", ".pickle": "sklearn", ".ubj": "xgboost", ".onnx": "onnx"}
EXTRA = {"sklearn": "scikit-learn", "xgboost": "xgboost", "onnx": "onnxruntime"}


@dataclass
class TensorSpec:
    name: str
    datatype: str  # the protocol's name: FP32, INT64, ...
    shape: list[int]  # -1 for any size (the batch axis always)


def artifact_file(path: Path) -> tuple[Path, str] | None:
    """(the model file, its runtime) when `path` is a predictor artifact, else None."""
    path = Path(path)
    if path.is_dir():
        found = [f for f in sorted(path.glob("model.*")) if artifact_file(f) is not None]
        return artifact_file(found[0]) if len(found) == 1 else None
    if not path.is_file():
        return None
    if path.suffix in _EXT:
        return path, _EXT[path.suffix]
    if path.suffix == ".json":  # XGBoost's JSON model format has a learner; any other JSON is not a model
        try:
            with open(path, "rb") as f:
                head = f.read(4096)
        except OSError:
            return None
        return (path, "xgboost") if b'"learner"' in head else None
    return None


def _datatype(dtype) -> str:
    from servelm.runtimes.tensors import datatype_of

    return datatype_of(np.dtype(dtype))


class Predictor:
    """One loaded model: `inputs`/`outputs` describe it, `predict` runs a batch (called from a worker thread;
    the runtimes release the GIL in their native code)."""

    runtime: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    def predict(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def single_input(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        if len(inputs) != 1:
            raise ValueError(f"this {self.runtime} model takes one input tensor, got {len(inputs)}")
        return next(iter(inputs.values()))


class SklearnPredictor(Predictor):
    runtime = "sklearn"

    def __init__(self, file: Path) -> None:
        import joblib

        self.model = joblib.load(file)
        n = getattr(self.model, "n_features_in_", -1)
        self.inputs = [TensorSpec("input-0", "FP64", [-1, int(n)])]
        self.methods = [m for m in ("predict", "predict_proba") if hasattr(self.model, m)]
        out_dtype = _datatype(getattr(self.model, "classes_", np.zeros(1)).dtype)
        classes = len(getattr(self.model, "classes_", ())) or -1
        self.outputs = [TensorSpec("predict", out_dtype, [-1])]
        if "predict_proba" in self.methods:
            self.outputs.append(TensorSpec("predict_proba", "FP64", [-1, classes]))

    def predict(self, inputs, outputs):
        x = self.single_input(inputs)
        return {name: np.asarray(getattr(self.model, name)(x)) for name in outputs}


class XGBoostPredictor(Predictor):
    runtime = "xgboost"

    def __init__(self, file: Path) -> None:
        import xgboost

        self.booster = xgboost.Booster()
        self.booster.load_model(str(file))
        self.booster.set_param({"nthread": 1})  # one batch at a time per model; leave cores to the rest
        n = self.booster.num_features()
        self.inputs = [TensorSpec("input-0", "FP32", [-1, int(n)])]
        self.outputs = [TensorSpec("predict", "FP32", [-1])]

    def predict(self, inputs, outputs):
        import xgboost

        x = self.single_input(inputs)
        return {"predict": np.asarray(self.booster.inplace_predict(x) if x.ndim == 2 else
                                      self.booster.predict(xgboost.DMatrix(x)))}


class OnnxPredictor(Predictor):
    runtime = "onnx"

    def __init__(self, file: Path) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(file), opts, providers=["CPUExecutionProvider"])
        self.inputs = [TensorSpec(i.name, _onnx_type(i.type), _dims(i.shape)) for i in self.session.get_inputs()]
        self.outputs = [TensorSpec(o.name, _onnx_type(o.type), _dims(o.shape)) for o in self.session.get_outputs()]

    def predict(self, inputs, outputs):
        names = [i.name for i in self.inputs]
        if len(names) == 1 and len(inputs) == 1:  # one input: whatever the client called it
            feed = {names[0]: next(iter(inputs.values()))}
        else:
            missing = set(names) - set(inputs)
            if missing:
                raise ValueError(f"missing inputs {sorted(missing)}; the model takes {names}")
            feed = {n: inputs[n] for n in names}
        want = self.session.get_inputs()
        feed = {i.name: feed[i.name].astype(np.dtype(_ONNX_NP[i.type]), copy=False) for i in want}
        return dict(zip(outputs, self.session.run(outputs, feed), strict=True))


_ONNX_NP = {"tensor(float)": "float32", "tensor(double)": "float64", "tensor(int64)": "int64",
            "tensor(int32)": "int32", "tensor(bool)": "bool", "tensor(float16)": "float16",
            "tensor(uint8)": "uint8", "tensor(int8)": "int8", "tensor(string)": "object"}


def _onnx_type(t: str) -> str:
    return "BYTES" if t == "tensor(string)" else _datatype(_ONNX_NP.get(t, "float32"))


def _dims(shape) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in shape]


def load_predictor(path: str | Path) -> Predictor:
    """Load a predictor artifact; ValueError for one that is not, ImportError naming the extra it needs."""
    found = artifact_file(Path(path))
    if found is None:
        raise ValueError(f"{path} is not a scikit-learn, XGBoost or ONNX model artifact")
    file, runtime = found
    try:
        cls = {"sklearn": SklearnPredictor, "xgboost": XGBoostPredictor, "onnx": OnnxPredictor}[runtime]
        return cls(file)
    except ImportError as e:
        raise ImportError(f"serving {runtime} models needs {EXTRA[runtime]} (pip install 'servelm[{runtime}]'): "
                          f"{e}") from e


def describe(path: str | Path) -> dict | None:
    """What the registry records of a predictor artifact, from its file name alone; None if it is not one."""
    found = artifact_file(Path(path))
    if found is None:
        return None
    return {"runtime": found[1], "file": found[0].name}

