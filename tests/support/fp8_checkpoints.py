"""FP8 checkpoints in Hugging Face's formats, written from a float folder's weights, each with its oracle twin:
the same model with every fp8 weight dequantized (code * scale in float32), which transformers runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from servelm.model.quant.weight_only import is_linear_weight

FP8 = torch.float8_e4m3fn

# scheme -> quantization_config written to config.json
CONFIGS = {
    "tensor": {"quant_method": "fp8", "activation_scheme": "static"},  # vLLM's fp8: one scale per tensor
    "channel": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},  # FBGEMM: one per row, [N, 1]
    "compressed": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}},
    "block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"},  # + weight_block_size
}


def _codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(FP8)


def quantize(w: torch.Tensor, scheme: str, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, the scale tensor as the scheme stores it) for a float32 [N, K] weight."""
    n, k = w.shape
    if scheme == "tensor":
        s = (w.abs().max() / 448).reshape(())
        return _codes(w, s), s
    if scheme in ("channel", "compressed"):
        s = w.abs().amax(dim=1, keepdim=True) / 448
        return _codes(w, s), s if scheme == "channel" else s.reshape(n)
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    s = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            s[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / 448
    full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return _codes(w, full), s


def dequantize(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    n, k = codes.shape
    if block is not None:
        bn, bk = block
        scale = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    elif scale.dim() == 1:
        scale = scale[:, None]
    return codes.float() * scale


def write_fp8_checkpoint(src: Path, out: Path, twin: Path, scheme: str,
                         block: tuple[int, int] | None = None) -> None:
    """`out`: src's model as an fp8 checkpoint (linears fp8, the rest as they were; the scales in a file of
    their own, read before the weights they scale); `twin`: the same weights dequantized, unquantized."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(src / "model.safetensors"))
    for d in (out, twin):
        d.mkdir(parents=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy(f, d / f.name)
    main, scales, dense = {}, {}, {}
    scale_suffix = "weight_scale_inv" if scheme == "block" else "weight_scale"
    for name, t in weights.items():
        if is_linear_weight(name):
            codes, s = quantize(t.float(), scheme, block)
            main[name] = codes
            scales[name.removesuffix("weight") + scale_suffix] = s.float().contiguous()
            if scheme == "tensor":  # a static activation scale, which servelm ignores
                scales[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.05)
            dense[name] = dequantize(codes, s, block if scheme == "block" else None)
        else:
            main[name] = dense[name] = t
    save_file(scales, str(out / "model-00001-of-00002.safetensors"))
    save_file(main, str(out / "model-00002-of-00002.safetensors"))
    save_file(dense, str(twin / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    qc = dict(CONFIGS[scheme])
    if scheme == "block":
        qc["weight_block_size"] = list(block)
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config))
