"""Mixture-of-experts MLPs over the shared decoder: Mixtral, Qwen2-MoE, Qwen3-MoE and GLM-4.5 / 4.6.

In a sparse layer the MLP is a router and E experts (each a gated SiLU MLP of its own width): the router's
softmax over E picks each token's top k experts, whose outputs are summed weighted by those
probabilities (renormalised to sum to one: always for Mixtral, with `norm_topk_prob` for Qwen). Qwen2-MoE
adds a shared expert that every token takes, scaled by sigmoid(shared_expert_gate(x)). Qwen's
`mlp_only_layers` and `decoder_sparse_step` leave some layers dense (an ordinary MLP of
`intermediate_size`).

GLM-4.5 (`Glm4MoeForCausalLM`) routes as DeepSeek-V3 does: each expert's score is the sigmoid of its router logit
(float32); the experts are chosen by score plus a per-expert correction bias (`e_score_correction_bias`), first
the best `topk_group` of `n_group` groups (each group ranked by its two best), then the top k within them; the
chosen experts' scores (without the bias) are renormalised and times `routed_scaling_factor`. A shared MLP
(`n_shared_experts` experts' width) takes every token, ungated; the first `first_k_dense_replace` layers are dense.

Dispatch is grouped by expert, not by token: the (token, slot) pairs are sorted by expert, and each expert
that has any runs one gate/up and one down matmul over its group (`index_select`), its weighted rows
written back to the pairs' places (`index_copy_`); each token's k rows are then summed at once. That is
the order transformers' default `grouped_mm` path sums in (float32 accumulation of the k weighted rows,
rounded once), so bfloat16 results round where transformers' do. Qwen rounds the routing weights to the
model dtype before they scale the rows; Mixtral keeps them in float32 (so its weighted rows are float32).

These layers run on the decoder's Python layer loop (their routing is PyTorch ops, which keeps their decode
steps off kernel tapes, model/kernels/tape.py), and, since the groups' sizes are read on the host, not under CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from servelm.model.layers.blocks import GateUpLinear, Linear

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM")


@dataclass(frozen=True)
class MoeOptions:
    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate size
    norm_topk_prob: bool  # the top-k routing weights renormalised to sum to one
    round_weights: bool  # routing weights rounded to the model dtype before scaling (Qwen), else float32 (Mixtral)
    shared_expert_size: int | None  # Qwen2-MoE's shared expert (GLM-4.5's shared experts, together)
    sparse_layers: tuple[bool, ...]  # per layer: experts, or a dense MLP of intermediate_size
    sigmoid_routing: bool = False  # GLM-4.5: sigmoid scores, biased choice, groups, a routed scale
    n_group: int = 1
    topk_group: int = 1
    routed_scale: float = 1.0
    shared_gated: bool = True  # the shared expert scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)


def moe_options(config, arch: str) -> MoeOptions:
    """The MoE choices of a Mixtral, Qwen2-MoE, Qwen3-MoE or GLM-4.5 config."""
    n = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    k = config.num_experts_per_tok
    layers = config.num_hidden_layers
    if arch == "Glm4MoeForCausalLM":
        n = config.n_routed_experts
        groups, top_groups = config.n_group, config.topk_group
        if not 1 <= k <= n or n % groups or not 1 <= top_groups <= groups:
            raise ValueError(f"{arch}: num_experts_per_tok={k} of {n} experts in {groups} groups (topk_group "
                             f"{top_groups}) is not a valid routing")
        shared = config.moe_intermediate_size * config.n_shared_experts
        return MoeOptions(n, k, config.moe_intermediate_size, bool(config.norm_topk_prob), False, shared or None,
                          tuple(i >= config.first_k_dense_replace for i in range(layers)), sigmoid_routing=True,
                          n_group=groups, topk_group=top_groups, routed_scale=float(config.routed_scaling_factor),
                          shared_gated=False)
    if arch == "MixtralForCausalLM":
        if n < 1 or not 1 <= k <= n:
            raise ValueError(f"{arch}: num_experts_per_tok={k} with {n} experts is not a valid routing")
        return MoeOptions(n, k, config.intermediate_size, True, False, None, (True,) * layers)
    only = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", None) or 1
    sparse = tuple(n > 0 and i not in only and (i + 1) % step == 0 for i in range(layers))
    if any(sparse) and not 1 <= k <= n:
        raise ValueError(f"{arch}: num_experts_per_tok={k} with {n} experts is not a valid routing")
    shared = getattr(config, "shared_expert_intermediate_size", None) if arch == "Qwen2MoeForCausalLM" else None
    return MoeOptions(n, k, config.moe_intermediate_size, bool(getattr(config, "norm_topk_prob", False)), True,
                      shared or None, sparse)


class SparseMoe:
    """A sparse MLP: router, experts and (Qwen2-MoE) a gated shared expert; holds no per-request state."""

    def __init__(self, router: torch.Tensor, experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 opts: MoeOptions, shared: tuple[torch.Tensor, ...] | None = None,
                 correction: torch.Tensor | None = None) -> None:
        """`experts`: (gate, up, down) weights each; `shared`: (gate, up, down[, shared_expert_gate]);
        `correction`: GLM-4.5's per-expert bias on the scores that choose (float32)."""
        self.opts = opts
        # GLM-4.5 routes in float32 from its router's float32 weight (transformers upcasts both)
        self.router = None if opts.sigmoid_routing else Linear(router)
        self.router_weight = router.float().contiguous() if opts.sigmoid_routing else None
        self.correction = None if correction is None else correction.float()
        self.experts = [(GateUpLinear(g, u), Linear(d)) for g, u, d in experts]
        self.shared = None
        if shared is not None:
            g, u, d, *sg = shared
            self.shared = (GateUpLinear(g, u), Linear(d)) + tuple(Linear(t) for t in sg)

    def linears(self) -> list[object]:
        """Every linear it holds (for the decoder's huge-page placement)."""
        out = [self.router] if self.router is not None else []
        out += [lin for pair in self.experts for lin in pair]
        return out + list(self.shared or ())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), both [T, k]: the router's softmax (float32) over experts, its top k."""
        if self.opts.sigmoid_routing:
            return self._route_sigmoid(x)
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.opts.top_k, dim=-1)
        if self.opts.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.opts.round_weights else weights), ids

    def _route_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """GLM-4.5's (DeepSeek-V3's) routing: float32 sigmoid scores, the choice by score + correction within
        the best groups, the chosen scores renormalised and scaled. Weights float32, as transformers keeps them."""
        o = self.opts
        scores = torch.sigmoid(torch.nn.functional.linear(x.float(), self.router_weight))
        choice = scores if self.correction is None else scores + self.correction.to(scores.device)
        if o.n_group > 1:
            groups = choice.view(-1, o.n_group, o.num_experts // o.n_group).topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(groups).scatter_(1, torch.topk(groups, o.topk_group, dim=-1)[1], 1.0)
            keep = keep.unsqueeze(-1).expand(-1, o.n_group, o.num_experts // o.n_group).reshape(-1, o.num_experts)
            choice = choice.masked_fill(keep == 0, float("-inf"))
        ids = torch.topk(choice, o.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if o.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * o.routed_scale, ids

    def __call__(self, x: torch.Tensor, fused=None) -> torch.Tensor:
        """x [T, hidden] (normed) -> the MLP's output [T, hidden]."""
        t, hidden = x.shape
        weights, ids = self.route(x)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs, grouped by expert
        counts = torch.bincount(flat, minlength=self.opts.num_experts).tolist()
        tokens, w = order // k, weights.reshape(-1)
        rows = x.new_empty((t * k, hidden), dtype=torch.promote_types(x.dtype, weights.dtype))
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            pairs = order[start:start + n]
            gate_up, down = self.experts[e]
            y = down(gate_up(x.index_select(0, tokens[start:start + n]), fused))
            rows.index_copy_(0, pairs, y * w.index_select(0, pairs)[:, None])
            start += n
        out = rows.view(t, k, hidden).sum(dim=1).to(x.dtype)
        if self.shared is not None:
            gate_up, down, *gate = self.shared
            shared = down(gate_up(x, fused))
            out = out + (torch.sigmoid(gate[0](x)) * shared if gate else shared)
        return out


def take_sparse_moe(take: Callable[..., torch.Tensor | None], opts: MoeOptions) -> SparseMoe:
    """One layer's sparse MLP from the checkpoint; `take(name, required=True)` pops a tensor of the layer.

    Names: Qwen's `mlp.gate` and `mlp.experts.{e}.{gate,up,down}_proj`, Mixtral's `block_sparse_moe.gate` and
    `block_sparse_moe.experts.{e}.{w1,w3,w2}`, transformers 5's own layout (`mlp.experts.gate_up_proj`
    [E, 2I, H], gate first, and `mlp.experts.down_proj` [E, H, I]), which save_pretrained writes with
    save_original_format=False, or a GGUF's stacked `mlp.experts.{gate,up,down}_proj` (gguf_loader's names)."""
    root = "mlp."
    router = take(root + "gate.weight", False)
    if router is None:
        root = "block_sparse_moe."
        router = take(root + "gate.weight")
    n, size = opts.num_experts, opts.expert_size
    gate_up = take(root + "experts.gate_up_proj", False)
    gate = take(root + "experts.gate_proj", False) if gate_up is None else None
    if gate_up is not None or gate is not None:  # every expert stacked in one tensor per projection
        gate, up = (gate_up[:, :size], gate_up[:, size:]) if gate_up is not None else (gate, take(root + "experts.up_proj"))
        down = take(root + "experts.down_proj")
        if any(t.shape[0] != n for t in (gate, up, down)) or gate.shape[1] != size or up.shape[1] != size:
            raise ValueError(f"stacked experts of shapes {tuple(gate.shape)}, {tuple(up.shape)}, {tuple(down.shape)}: "
                             f"expected {n} experts of {size}")
        experts = [(gate[e], up[e], down[e]) for e in range(n)]
    else:
        names = ("w1", "w3", "w2") if root == "block_sparse_moe." else ("gate_proj", "up_proj", "down_proj")
        experts = [tuple(take(f"{root}experts.{e}.{m}.weight") for m in names) for e in range(n)]
    shared = None
    if opts.shared_expert_size and opts.shared_gated:
        shared = tuple(take(f"mlp.shared_expert.{m}.weight") for m in ("gate_proj", "up_proj", "down_proj"))
        shared += (take("mlp.shared_expert_gate.weight").reshape(1, -1),)  # [1, hidden] (a GGUF may store [hidden])
    elif opts.shared_expert_size:  # GLM-4.5's shared experts, one ungated MLP
        shared = tuple(take(f"mlp.shared_experts.{m}.weight") for m in ("gate_proj", "up_proj", "down_proj"))
    correction = take(root + "gate.e_score_correction_bias", False) if opts.sigmoid_routing else None
    return SparseMoe(router, experts, opts, shared, correction)
