"""One decoder-only transformer for the Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3, Mixtral, Qwen2-MoE
and Qwen3-MoE families.

It runs a flattened batch of tokens from many sequences (no padding); attention goes through an
`AttentionBackend` over the paged KV cache. Q/K/V and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from servelm.model import memory
from servelm.model.attention import AttentionBackend, AttentionMetadata, CpuPagedAttention
from servelm.model.gguf_quant import GGUFMatmul
from servelm.model.layers import (
    GateUpLinear,
    Linear,
    add_rms_norm,
    apply_rotary,
    fused_kernels,
    rms_norm,
    rotary_,
)
from servelm.model.moe import SparseMoe, take_sparse_moe
from servelm.model.parallel import TensorParallel
from servelm.model.quant import fuse_rows
from servelm.model.spec import ModelSpec


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: GateUpLinear | None  # the dense MLP (None in a mixture-of-experts layer)
    down: Linear | None
    attn_out_norm: torch.Tensor | None = None  # sandwich norms (Gemma): on the attention output
    mlp_out_norm: torch.Tensor | None = None  # and on the MLP output, before each residual add
    moe: SparseMoe | None = None  # the sparse MLP of a mixture-of-experts layer (servelm/model/moe.py)


class DecoderLM:
    """Weights plus a forward pass; holds no per-request state."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 backend: Callable[..., AttentionBackend], tp: TensorParallel | None = None) -> None:
        """With `tp`, `spec` and `weights` are that rank's shard (model/parallel.py): its heads and MLP columns,
        and each layer's o_proj and down outputs are summed over the ranks."""
        self.spec = spec
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.dtype = dtype
        self.batch_invariant = False  # set by model.invariant.make_batch_invariant
        self.quantization = "none"  # set by the loader (model/quant.py)
        self.embed = weights.pop("model.embed_tokens.weight")
        self.norm = self._norm_weight(weights.pop("model.norm.weight"))
        lm_head = weights.pop("lm_head.weight", None)
        self.lm_head = Linear(self.embed if lm_head is None or spec.tie_word_embeddings else lm_head)
        self.layers = [self._take_layer(weights, i) for i in range(spec.num_layers)]
        unused = [k for k in weights if not k.endswith("rotary_emb.inv_freq")]
        if unused:
            raise ValueError(f"checkpoint has tensors this model does not use: {unused[:5]}")
        scale = spec.attn_scale or spec.head_dim ** -0.5
        self.fused = fused_kernels(dtype, self.embed.device)
        if spec.attn_softcap:  # no kernel soft-caps scores: the PyTorch reference path, on every device
            from servelm.model.attention.softcap import SoftcapPagedAttention

            self.attn = SoftcapPagedAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim, scale,
                                              spec.attn_softcap)
        else:
            self.attn = backend(spec.num_heads, spec.num_kv_heads, spec.head_dim, scale)
        # the embedding scale rounded to the model's dtype, as transformers applies it
        self.embed_scale = None if spec.embed_scale is None else torch.tensor(spec.embed_scale, dtype=dtype)
        self._rope_cache(spec.max_position_embeddings)
        if self.embed.device.type == "cpu" and memory.WEIGHTS_IN_HUGE_PAGES:
            memory.move_to_huge_pages(self._streamed_tensors())
        # None where the C++ layer loop does not apply (with tensor parallelism: it cannot all-reduce mid-loop)
        self.cpp_decode = self._cpp_decode_weights() if self.tp is None else None

    def _streamed_tensors(self) -> list[tuple[object, str]]:
        """(holder, attribute) of every tensor a decode step reads in full: the linears' weights in the
        layout their kernel reads (oneDNN's opaque copies stay where oneDNN put them), biases and norms."""
        slots: list[tuple[object, str]] = [(self, "norm")]
        if self.lm_head.weight is self.embed:  # tied and read as is: one copy serves both
            slots.append((self, "embed"))
        linears = [self.lm_head]
        for lw in self.layers:
            slots += [(lw, n) for n in ("input_norm", "post_norm", "q_norm", "k_norm")]
            mlp = [lw.gate_up, lw.down] if lw.moe is None else lw.moe.linears()
            linears += [lw.qkv, lw.o_proj] + [getattr(x, "linear", None) or x for x in mlp]
        return slots + [(lin, n) for lin in linears for n in ("tiled", "weight", "bias") if hasattr(lin, n)] + [
            (lin.quant, "packed") for lin in linears if isinstance(getattr(lin, "quant", None), GGUFMatmul)]

    def _cpp_decode_weights(self) -> list[torch.Tensor] | None:
        """The flat weight list of the C++ layer loop for pure-decode steps (`decode_layers`): where the
        fused kernels, the CPU attention kernel and a packed-weight linear kernel (AMX tiles or AVX512-BF16, or
        the GGUF block kernel for a weight kept quantized) take every layer."""
        self.cpp_formats: list[int] | None = None  # the C++ loop's GGUF formats, where a linear has one
        if self.fused is None or not isinstance(self.attn, CpuPagedAttention) or not self.spec.llama_layers:
            return None  # the C++ loop runs the Llama layer shape only: Gemma, MoE, partial RoPE stay on Python's
        flat, formats = [], []
        none = torch.empty(0, dtype=self.dtype)

        def packed(x) -> torch.Tensor | None:  # the weight as the loop's kernels read it, noting its format
            if isinstance(getattr(x, "quant", None), GGUFMatmul) and (getattr(x, "bias", None) is None
                                                                      or x.bias_inside):
                formats.append(x.quant.fmt)  # a GGUF weight for quant_linear (bias, if any, added inside)
                return x.quant.packed
            formats.append(-1)
            return x.tiled if (x.tiles or x.avx512) is not None else None

        for lw in self.layers:
            weights = [packed(x) for x in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)]
            if any(w is None for w in weights):
                return None
            qkv, o_proj, gate_up, down = weights
            flat += [lw.input_norm, qkv, none if lw.qkv.bias is None else lw.qkv.bias, o_proj,
                     none if lw.o_proj.bias is None else lw.o_proj.bias, lw.post_norm, gate_up,
                     down, none if lw.q_norm is None else lw.q_norm, none if lw.k_norm is None else lw.k_norm]
        self.cpp_formats = formats if any(f >= 0 for f in formats) else None
        return flat

    def _norm_weight(self, w: torch.Tensor | None) -> torch.Tensor | None:
        """Gemma applies RMSNorm weights as (1 + w): add the one once here, in float32."""
        if w is None or not self.spec.norm_unit_offset:
            return w
        return (w.float() + 1.0).to(w.dtype)

    def _take_layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            t = w.pop(p + name, None)
            if t is None and required:
                raise ValueError(f"checkpoint is missing {p + name}")
            return t

        if self.spec.fused_checkpoint:  # Phi-3: Q, K, V in one matrix, gate and up in another
            qkv_weight, qkv_bias = take("self_attn.qkv_proj.weight"), take("self_attn.qkv_proj.bias", False)
        else:
            q, k, v = take("self_attn.q_proj.weight"), take("self_attn.k_proj.weight"), take("self_attn.v_proj.weight")
            qkv_weight = fuse_rows([q, k, v])
            biases = [take(f"self_attn.{n}_proj.bias", False) for n in "qkv"]
            qkv_bias = None
            if any(b is not None for b in biases):
                ref = next(b for b in biases if b is not None)  # q/k/v may be quantized: no dtype of their own
                qkv_bias = torch.cat([b if b is not None else torch.zeros(t.shape[0], dtype=ref.dtype, device=ref.device)
                                      for b, t in zip(biases, (q, k, v), strict=True)])
        moe, gate_up, down = None, None, None
        if self.spec.moe is not None and self.spec.moe.sparse_layers[i]:
            moe = take_sparse_moe(take, self.spec.moe)
        else:
            if self.spec.fused_checkpoint:
                gate, up = take("mlp.gate_up_proj.weight").chunk(2)
            else:
                gate, up = take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")
            gate_up, down = GateUpLinear(gate, up, self.spec.hidden_act), Linear(take("mlp.down_proj.weight"))
        sandwich = self.spec.sandwich_norms
        norm = self._norm_weight
        return LayerWeights(
            input_norm=norm(take("input_layernorm.weight")),
            qkv=Linear(qkv_weight, qkv_bias),
            o_proj=Linear(take("self_attn.o_proj.weight"), take("self_attn.o_proj.bias", False)),
            q_norm=norm(take("self_attn.q_norm.weight", False)),
            k_norm=norm(take("self_attn.k_norm.weight", False)),
            # the norm in front of the MLP: Llama names it post_attention_layernorm, Gemma pre_feedforward
            post_norm=norm(take("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight")),
            gate_up=gate_up,
            down=down,
            attn_out_norm=norm(take("post_attention_layernorm.weight")) if sandwich else None,
            mlp_out_norm=norm(take("post_feedforward_layernorm.weight")) if sandwich else None,
            moe=moe,
        )

    def _rope_cache(self, max_pos: int) -> None:
        self.cos, self.sin = self._rope_tables(self.spec.inv_freq, max_pos, self.spec.rope_attention_factor)
        local = self.spec.local_inv_freq  # Gemma 3: the sliding-window layers' own RoPE base
        self.cos_local, self.sin_local = (self.cos, self.sin) if local is None else self._rope_tables(local, max_pos, 1.0)

    def _rope_tables(self, inv_freq: torch.Tensor, max_pos: int, f: float) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * f).to(device=self.embed.device, dtype=self.dtype),
                (emb.sin() * f).to(device=self.embed.device, dtype=self.dtype))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]."""
        s, fused, eps = self.spec, self.fused, self.spec.rms_norm_eps
        if s.sandwich_norms:
            return self._forward_sandwich(input_ids, positions, kv_caches, meta)
        h = self.embed[input_ids]  # the residual stream, updated in place
        if self.cpp_decode is not None and not meta.prefills:  # the same kernels, looped in C++
            lw = self.layers[0]
            return fused.decode_layers(
                h, positions, self.cos, self.sin, self.cpp_decode, [c for kv in kv_caches for c in kv],
                meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens, self.norm,
                [w or 0 for w in s.sliding_windows], [lw.qkv.out_features, lw.o_proj.out_features,
                                                      lw.gate_up.out_features, lw.down.out_features],
                [s.num_heads, s.num_kv_heads, s.head_dim], eps, self.attn.scale, self.cpp_formats)
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        # the fused kernel reads the rotary tables at the positions; the PyTorch path gathers them once here
        cos, sin, rope_pos = (self.cos, self.sin, positions) if fused else (self.cos[positions], self.sin[positions], None)
        rot = s.rotary_dim  # partial RoPE: only the first `rot` of each head (no fused kernel for that)
        delta = None  # the last sublayer's output, not yet added to h
        for i, lw in enumerate(self.layers):
            x = rms_norm(h, lw.input_norm, eps, fused) if delta is None else add_rms_norm(delta, h, lw.input_norm, eps, fused)
            qkv = lw.qkv(x)
            qk = qkv[:, :q_size + kv_size].view(-1, s.num_heads + s.num_kv_heads, s.head_dim)
            v = qkv[:, q_size + kv_size:].view(-1, s.num_kv_heads, s.head_dim)
            if lw.q_norm is not None:
                q_part, k_part = qk[:, :s.num_heads], qk[:, s.num_heads:]
                rms_norm(q_part, lw.q_norm, eps, fused, out=q_part)
                rms_norm(k_part, lw.k_norm, eps, fused, out=k_part)
            if rot is None:
                rotary_(qk, cos, sin, rope_pos, fused)  # queries and keys rotated in one pass
            else:
                rotary_(qk[..., :rot], cos, sin, rope_pos)
            q, k = qk[:, :s.num_heads].contiguous(), qk[:, s.num_heads:]
            o = self.attn.forward(q, k, v.contiguous(), kv_caches[i], meta, s.sliding_windows[i])
            x = add_rms_norm(self._reduce(lw.o_proj(o.reshape(-1, q_size))), h, lw.post_norm, eps, fused)
            delta = self._reduce(lw.down(lw.gate_up(x, fused))) if lw.moe is None else lw.moe(x, fused)
        return add_rms_norm(delta, h, self.norm, eps, fused)

    def _forward_sandwich(self, input_ids: torch.Tensor, positions: torch.Tensor,
                          kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Gemma's layer: a norm before and after each sublayer, GeGLU, scaled embeddings, per-layer-type
        RoPE. Plain PyTorch ops (the fused elementwise kernels and the C++ loop implement the Llama shape)."""
        s, eps = self.spec, self.spec.rms_norm_eps
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        h = self.embed[input_ids]
        if self.embed_scale is not None:
            h = h * self.embed_scale.to(h.device)
        tables = {False: (self.cos[positions], self.sin[positions])}
        if self.cos_local is not self.cos:
            tables[True] = (self.cos_local[positions], self.sin_local[positions])
        for i, lw in enumerate(self.layers):
            window = s.sliding_windows[i]
            x = rms_norm(h, lw.input_norm, eps)
            qkv = lw.qkv(x)
            qk = qkv[:, :q_size + kv_size].reshape(-1, s.num_heads + s.num_kv_heads, s.head_dim)
            v = qkv[:, q_size + kv_size:].reshape(-1, s.num_kv_heads, s.head_dim)
            if lw.q_norm is not None:
                qk = torch.cat([rms_norm(qk[:, :s.num_heads], lw.q_norm, eps),
                                rms_norm(qk[:, s.num_heads:], lw.k_norm, eps)], dim=1)
            cos, sin = tables[window is not None and True in tables]  # local layers: their own RoPE, if any
            qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, :s.num_heads].contiguous(), qk[:, s.num_heads:].contiguous()
            o = self.attn.forward(q, k, v.contiguous(), kv_caches[i], meta, window)
            h = h + rms_norm(self._reduce(lw.o_proj(o.reshape(-1, q_size))), lw.attn_out_norm, eps)
            x = rms_norm(h, lw.post_norm, eps)
            h = h + rms_norm(self._reduce(lw.down(lw.gate_up(x))), lw.mlp_out_norm, eps)
        return rms_norm(h, self.norm, eps)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output summed over the tensor-parallel ranks (x itself without them)."""
        return x if self.tp is None else self.tp.all_reduce(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] in the model's dtype (the sampler widens what it must); soft-capped where the model
        says (Gemma 2)."""
        out = self.lm_head(hidden)
        cap = self.spec.final_softcap
        return out if not cap else (torch.tanh(out.float() / cap) * cap).to(out.dtype)
