"""One decoder-only transformer for the Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3, Mixtral, Qwen2-MoE
and Qwen3-MoE families.

It runs a flattened batch of tokens from many sequences (no padding); attention goes through an
`AttentionBackend` over the paged KV cache. Q/K/V and gate/up projections are fused into one matmul each.
`run_layers` is the one definition of the layer stack: where the fused CPU kernels run it, pure-decode
steps replay its recorded kernel calls from C++ (model/kernels/tape.py) instead of running it in Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servelm.model import memory
from servelm.model.attention import AttentionBackend, AttentionMetadata
from servelm.model.attention.kv_quant import is_fp8
from servelm.model.families.moe import SparseMoe, take_sparse_moe
from servelm.model.kernels.tape import DecodeTapes
from servelm.model.layers.blocks import (
    GateUpLinear,
    Linear,
    PartsLinear,
    add_rms_norm,
    contiguous_rows,
    fused_kernels,
    linear_for,
    rms_norm,
    rotary_,
    rotary_write_kv,
)
from servelm.model.layers.lora import LoraBatch, add_lora
from servelm.model.layers.parallel import TensorParallel
from servelm.model.quant.gguf import GGUFMatmul
from servelm.model.quant.weight_only import fuse_rows
from servelm.model.spec import ModelSpec


@dataclass
class LayerWeights:
    input_norm: torch.Tensor | None  # None: the attention reads the residual stream itself (OLMo)
    qkv: Linear | PartsLinear
    o_proj: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor | None  # the norm in front of the MLP (None: the MLP reads the stream, OLMo)
    gate_up: GateUpLinear | None  # the dense MLP (None in a mixture-of-experts layer)
    down: Linear | None
    attn_out_norm: torch.Tensor | None = None  # sandwich norms (Gemma) and OLMo's: on the attention output
    mlp_out_norm: torch.Tensor | None = None  # and on the MLP output, before each residual add
    moe: SparseMoe | None = None  # the sparse MLP of a mixture-of-experts layer (servelm/model/families/moe.py)
    # (k_scale, v_scale) of an fp8 KV cache: the checkpoint's self_attn.k_scale / v_scale (vLLM's names), else 1.0
    kv_scales: tuple[float, float] = (1.0, 1.0)


class DecoderLM:
    """Weights plus a forward pass; holds no per-request state."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 backend: Callable[..., AttentionBackend], tp: TensorParallel | None = None) -> None:
        """With `tp`, `spec` and `weights` are that rank's shard (model/layers/parallel.py): its heads and MLP columns,
        and each layer's o_proj and down outputs are summed over the ranks."""
        self.spec = spec
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.dtype = dtype
        self.batch_invariant = False  # set by model.invariant.check_batch_invariant
        self.quantization = "none"  # set by the loader (model/quant/weight_only.py)
        # what a weight update must bring (model/weight_update.py): the checkpoint's names and shapes
        self.checkpoint_shapes = {k: tuple(t.shape) for k, t in weights.items()
                                  if not k.endswith("rotary_emb.inv_freq")}
        self.embed, self.norm, self.lm_head = self._take_globals(weights)
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
        # pure-decode steps replayed from kernel tapes where the fused kernels run the loop (model/kernels/tape.py); not
        # with tensor parallelism, whose all-reduce between layers is no kernel of the tape's
        self.tapes = DecodeTapes(self, self.fused) if self.fused is not None and self.tp is None else None

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
        linears = [p for lin in linears for p in (lin.parts if isinstance(lin, PartsLinear) else [lin])]
        kernels = [lin.kernel for lin in linears]
        return slots + [(lin, "bias") for lin in linears if hasattr(lin, "bias")] + [
            (k, n) for k in kernels for n in ("tiled", "panels", "weight") if hasattr(k, n)] + [
            (k.matmul, "packed") for k in kernels if isinstance(getattr(k, "matmul", None), GGUFMatmul)]

    def _take_globals(self, w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, Linear]:
        """The embedding, the final norm and the LM head (the embedding's, where tied), taken out of `w`."""
        embed = w.pop("model.embed_tokens.weight")
        norm = self._norm_weight(w.pop("model.norm.weight"))
        lm_head = w.pop("lm_head.weight", None)
        return embed, norm, Linear(embed if lm_head is None or self.spec.tie_word_embeddings else lm_head)

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

        if self.spec.fused_checkpoint:  # Phi-3: Q, K, V in one matrix, gate and up in another (GLM-4: those only)
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
            if self.spec.fused_checkpoint or p + "mlp.gate_up_proj.weight" in w:
                gate, up = take("mlp.gate_up_proj.weight").chunk(2)
            else:
                gate, up = take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")
            gate_up, down = GateUpLinear(gate, up, self.spec.hidden_act), Linear(take("mlp.down_proj.weight"))
        sandwich, post_only = self.spec.sandwich_norms, self.spec.post_norms_only
        norm = self._norm_weight
        # the norms on the sublayers' outputs (Gemma, GLM-4, OLMo), and the one in front of the MLP: Llama names it
        # post_attention_layernorm, Gemma pre_feedforward_layernorm, GLM-4 post_attention_layernorm; OLMo has none
        attn_out, mlp_in, mlp_out = (self.spec.sandwich_norm_names if sandwich else
                                     ("post_attention_layernorm", None, "post_feedforward_layernorm") if post_only else
                                     (None, None, None) if self.spec.parallel_residual else  # Cohere: one norm
                                     (None, "post_attention_layernorm", None))
        before_mlp = None if mlp_in is None else take(mlp_in + ".weight")
        q_norm, k_norm = norm(take("self_attn.q_norm.weight", False)), norm(take("self_attn.k_norm.weight", False))
        if self.spec.whole_qk_norm and q_norm is not None:
            width = (self.spec.num_heads * self.spec.head_dim, self.spec.num_kv_heads * self.spec.head_dim)
            if (q_norm.numel(), k_norm.numel()) != width:
                raise ValueError(f"{p}self_attn.q_norm/k_norm: {q_norm.numel()} and {k_norm.numel()} wide, expected "
                                 f"the whole projections' {width[0]} and {width[1]}")
        return LayerWeights(
            input_norm=None if post_only else norm(take("input_layernorm.weight")),
            qkv=linear_for(qkv_weight, qkv_bias),
            o_proj=Linear(take("self_attn.o_proj.weight"), take("self_attn.o_proj.bias", False)),
            q_norm=q_norm,
            k_norm=k_norm,
            post_norm=norm(before_mlp),
            gate_up=gate_up,
            down=down,
            attn_out_norm=None if attn_out is None else norm(take(attn_out + ".weight")),
            mlp_out_norm=None if mlp_out is None else norm(take(mlp_out + ".weight")),
            moe=moe,
            kv_scales=self._kv_scales(take),
        )

    @staticmethod
    def _kv_scales(take) -> tuple[float, float]:
        """A layer's fp8 KV cache scales as a checkpoint made for an fp8 KV cache gives them (loaded in the
        model's dtype like every tensor: a scale is used as rounded, by the writes and the reads alike); an
        older single kv_scale serves both."""
        both = take("self_attn.kv_scale", False)
        k, v = take("self_attn.k_scale", False), take("self_attn.v_scale", False)
        k, v = (k if k is not None else both), (v if v is not None else both)
        return (1.0 if k is None else float(k.float().max()), 1.0 if v is None else float(v.float().max()))

    def _rope_cache(self, max_pos: int) -> None:
        self.cos, self.sin = self._rope_tables(self.spec.inv_freq, max_pos, self.spec.rope_attention_factor)
        local = self.spec.local_inv_freq  # Gemma 3, OLMo 3: the sliding-window layers' own RoPE
        self.cos_local, self.sin_local = (self.cos, self.sin) if local is None else self._rope_tables(
            local, max_pos, self.spec.local_rope_attention_factor)

    def _rope_tables(self, inv_freq: torch.Tensor, max_pos: int, f: float) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * f).to(device=self.embed.device, dtype=self.dtype),
                (emb.sin() * f).to(device=self.embed.device, dtype=self.dtype))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                lora: LoraBatch | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]. A pure-decode step replays its kernel tape where
        there is one (the same kernel calls as `run_layers`, from C++); a step with LoRA rows runs the layers, and
        so does every step over an fp8 KV cache, which the C++ kernels a tape replays do not read, and every
        step with queries to scale (a tape holds no scaling)."""
        if self.tapes is not None and not meta.prefills and lora is None and not is_fp8(kv_caches[0][0]) \
                and self._query_scales(positions) is None:
            hidden = self.tapes.forward(input_ids, positions, kv_caches, meta)
            if hidden is not None:
                return hidden
        return self.run_layers(self.embed_tokens(input_ids), positions, kv_caches, meta, lora)

    def embed_tokens(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream's start: the tokens' embedding rows (into `out` when given), scaled where the
        model says (Gemma)."""
        h = self.embed[input_ids] if out is None else torch.index_select(self.embed, 0, input_ids, out=out)
        if self.embed_scale is not None:
            h = h * self.embed_scale.to(h.device) if out is None else h.mul_(self.embed_scale.to(h.device))
        return h

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   meta: AttentionMetadata, lora: LoraBatch | None = None) -> torch.Tensor:
        """The layer stack over the residual stream h [T, hidden] (updated in place), then the final norm. One
        loop for every family; what differs is read from the spec and the layer's weights: sandwich norms
        (Gemma: the sublayers' outputs are normed before each residual add), norms after the sublayers only
        (OLMo), a parallel attention and MLP (Cohere), q/k norms, partial RoPE, a local RoPE for sliding-window
        layers, MoE MLPs. `lora`: the step's adapters, added to the rows that use
        them (model/layers/lora.py)."""
        s, fused = self.spec, self.fused
        # Gemma's RMSNorm scales by its weight in float32 and rounds once (as F.rms_norm does); the fused
        # kernel rounds before the scaling, as Llama's does, so it serves the other families only
        nf = None if s.norm_weight_in_float32 else fused
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        rot = s.rotary_dim  # partial RoPE: only the first `rot` of each head (no fused kernel for that)
        # the RoPE tables, and Gemma 3's sliding-window layers' own (another base); rotary_'s arguments for
        # them are made on first use, once for all layers (not at all where the CUDA kernel fuses RoPE)
        tables = {False: (self.cos, self.sin), True: (self.cos_local, self.sin_local)}
        rope: dict[bool, tuple] = {}
        # RoPE fused with the KV-cache write (blocks.rotary_write_kv) needs the whole head rotated and a
        # backend that attends over a cache written for it
        rope_kv = rot is None and self.attn.attends_written_cache
        delta = None  # the last sublayer's output, not yet added to h
        q_scales = self._query_scales(positions)  # Ministral 3, past its original context
        for i, lw in enumerate(self.layers):
            window = s.sliding_windows[i]
            x = self._residual(delta, h, lw.input_norm, nf)
            qkv = add_lora(lw.qkv(x), x, lora, i, "qkv")
            qk = qkv[:, :q_size + kv_size].view(-1, s.num_heads + s.num_kv_heads, s.head_dim)
            v = qkv[:, q_size + kv_size:].view(-1, s.num_kv_heads, s.head_dim)
            if lw.q_norm is not None and s.whole_qk_norm:  # OLMo: all heads' queries (and keys) as one vector
                q_all, k_all = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
                self._norm(q_all, lw.q_norm, nf, out=q_all)
                self._norm(k_all, lw.k_norm, nf, out=k_all)
            elif lw.q_norm is not None:
                q_part, k_part = qk[:, :s.num_heads], qk[:, s.num_heads:]
                self._norm(q_part, lw.q_norm, nf, out=q_part)
                self._norm(k_part, lw.k_norm, nf, out=k_part)
            local = window is not None and self.cos_local is not self.cos
            cos, sin = tables[local]
            q = qk[:, :s.num_heads]
            positional = s.rope_layers is None or s.rope_layers[i]  # SmolLM3's NoPE layers rotate nothing
            if positional and rope_kv and rotary_write_kv(qk, v, s.num_heads, cos, sin, positions, kv_caches[i],
                                                          meta.slot_mapping):
                if q_scales is not None:
                    q.mul_(q_scales)
                o = self.attn.attend(q, kv_caches[i], meta, window)
            else:
                if positional:
                    if local not in rope:
                        rope[local] = self._rope_at(cos, sin, positions, rot)
                    rotary_(qk if rot is None else qk[..., :rot], *rope[local], fused)  # queries and keys at once
                if q_scales is not None:
                    q.mul_(q_scales)
                if not self.attn.strided_qkv:  # the C++ kernels and SDPA get contiguous rows
                    q, v = contiguous_rows(q, fused), contiguous_rows(v, fused)
                o = self.attn.forward(q, qk[:, s.num_heads:], v, kv_caches[i], meta, window)
            o = o.reshape(-1, q_size)
            delta = self._reduce(add_lora(lw.o_proj(o), o, lora, i, "o"))
            if s.residual_scale is not None:  # Granite: residual + output * multiplier
                delta = delta * s.residual_scale
            if lw.attn_out_norm is not None:
                delta = self._norm(delta, lw.attn_out_norm, nf)
            if s.parallel_residual:  # Cohere: the MLP reads the attention's input; both outputs join h at once
                attn_delta = delta
            else:
                x = self._residual(delta, h, lw.post_norm, nf)
            if lw.moe is not None:
                delta = lw.moe(x, fused)
            else:
                if lora is not None and lora.any(i, "gate_up"):  # the update goes in before the activation
                    act = lw.gate_up.activate(add_lora(lw.gate_up.preactivation(x), x, lora, i, "gate_up"), fused)
                else:
                    act = lw.gate_up(x, fused)
                delta = self._reduce(add_lora(lw.down(act), act, lora, i, "down"))
            if s.residual_scale is not None:
                delta = delta * s.residual_scale
            if lw.mlp_out_norm is not None:
                delta = self._norm(delta, lw.mlp_out_norm, nf)
            if s.parallel_residual:
                delta = delta + attn_delta
        return self._residual(delta, h, self.norm, nf)

    def _residual(self, delta: torch.Tensor | None, h: torch.Tensor, norm: torch.Tensor | None, fused
                  ) -> torch.Tensor:
        """h += delta (the last sublayer's output; none before the first layer), then the input of the next
        sublayer: h under its norm, or h itself where the model has no norm before its sublayers (OLMo)."""
        if norm is None:
            return h if delta is None else h.add_(delta)
        if delta is None or self.spec.layer_norm:
            return self._norm(h if delta is None else h.add_(delta), norm, fused)
        return add_rms_norm(delta, h, norm, self.spec.rms_norm_eps, fused)

    def _query_scales(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Ministral 3's queries, after RoPE, times 1 + beta * log(1 + floor(position / L)) (Llama 4's attention
        temperature; L its original context), as [T, 1, 1] in the model's dtype; None where nothing scales (on the
        CPU, a step whose positions are all under L, which then may replay a kernel tape). A GPU step always
        scales, so that a captured CUDA graph holds the scaling for every later position."""
        spec = self.spec
        if spec.query_scale_beta is None:
            return None
        if positions.device.type == "cpu" and int(positions.max()) < spec.query_scale_length:
            return None
        scales = 1 + spec.query_scale_beta * torch.log1p(torch.floor(positions.float() / spec.query_scale_length))
        return scales.to(self.dtype)[:, None, None]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, fused, out: torch.Tensor | None = None) -> torch.Tensor:
        """The model's norm over x's last dim (into `out` when given): RMSNorm, or Cohere's LayerNorm (centred, no
        bias, its weight applied in float32 before one rounding; a [heads, head_dim] weight gives each head its
        own)."""
        eps = self.spec.rms_norm_eps
        if not self.spec.layer_norm:
            return rms_norm(x, weight, eps, fused, out)
        y = (F.layer_norm(x.float(), (x.shape[-1],), None, None, eps) * weight.float()).to(x.dtype)
        return y if out is None else out.copy_(y)

    def _rope_at(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, rot: int | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What `rotary_` takes: the fused kernel reads the whole tables at the positions; the PyTorch path
        (and partial RoPE) gets the positions' rows, gathered once for all layers."""
        if self.fused is not None and rot is None:
            return cos, sin, positions
        return cos[positions], sin[positions], None

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output summed over the tensor-parallel ranks (x itself without them)."""
        return x if self.tp is None else self.tp.all_reduce(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab]: float32 where servelm's C++ kernels run the lm_head (they sum in float32 and store the
        sums unrounded), else the model's dtype (the sampler widens what it must); soft-capped where the model
        says (Gemma 2). A bf16 model's logits rounded to bf16 tie tokens less than one bf16 step apart (1/128
        of the logit's power of two), and greedy decoding then takes the lower token id, not the likelier one."""
        out = self.lm_head(hidden, float32=True)
        if self.spec.logits_divisor is not None:  # Granite's logits_scaling
            out = out / self.spec.logits_divisor
        if self.spec.logits_scale is not None:  # Cohere's logit_scale
            out = out * self.spec.logits_scale
        cap = self.spec.final_softcap
        return out if not cap else (torch.tanh(out.float() / cap) * cap).to(out.dtype)
