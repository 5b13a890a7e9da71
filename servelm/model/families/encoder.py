"""A BERT-family sentence encoder (all-MiniLM-L6-v2 and its kin) for the embeddings endpoints, and BERT
sequence classifiers (cross-encoder rerankers such as ms-marco-MiniLM) for scores, reranking and /classify.

Built here from the checkpoint's tensors rather than through transformers' AutoModel, which imports
transformers' whole modelling stack (3-4 s of server start-up) to run twenty lines of arithmetic.
tests/model/test_encoder.py checks it against transformers' BertModel and BertForSequenceClassification. Other
encoder families go through AutoModel and AutoModelForSequenceClassification (see `load_encoder`,
`load_classifier`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from servelm.model.loading.hf_files import read_json

_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # GELU approximation


@dataclass(frozen=True)
class EncoderSpec:
    num_layers: int
    num_heads: int
    eps: float
    gelu_approximate: str

    @classmethod
    def from_config(cls, cfg: dict) -> EncoderSpec | None:
        """The spec, or None for a config this encoder does not reproduce exactly."""
        if (cfg.get("model_type") != "bert" or cfg.get("position_embedding_type", "absolute") != "absolute"
                or cfg.get("is_decoder") or cfg.get("hidden_act", "gelu") not in _ACTIVATIONS):
            return None
        return cls(cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg.get("layer_norm_eps", 1e-12),
                   _ACTIVATIONS[cfg.get("hidden_act", "gelu")])


class BertEncoder:
    """Token ids -> last hidden states, as BertModel computes them (no pooler)."""

    def __init__(self, spec: EncoderSpec, weights: dict[str, torch.Tensor]) -> None:
        self.spec = spec
        # Checkpoints saved from BertForX prefix every name with "bert.".
        self.w = {k.removeprefix("bert."): v for k, v in weights.items()}

    @classmethod
    def load(cls, folder: Path) -> BertEncoder | None:
        spec = EncoderSpec.from_config(read_json(folder / "config.json") or {})
        if spec is None or not (folder / "model.safetensors").is_file():
            return None
        from safetensors.torch import load_file

        return cls(spec, {k: v.float() for k, v in load_file(folder / "model.safetensors").items()})

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[f"{name}.weight"], self.w[f"{name}.bias"], self.spec.eps)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"])

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        w, (b, t) = self.w, input_ids.shape
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = (w["embeddings.word_embeddings.weight"][input_ids] + w["embeddings.position_embeddings.weight"][:t]
             + w["embeddings.token_type_embeddings.weight"][token_type_ids])
        x = self._norm(x, "embeddings.LayerNorm")
        keys = attention_mask.bool()[:, None, None, :]  # every query attends to the real tokens only
        heads = self.spec.num_heads
        for i in range(self.spec.num_layers):
            p = f"encoder.layer.{i}"
            q, k, v = (self._linear(x, f"{p}.attention.self.{n}").view(b, t, heads, -1).transpose(1, 2)
                       for n in ("query", "key", "value"))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=keys).transpose(1, 2).reshape(b, t, -1)
            x = self._norm(self._linear(a, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm")
            h = F.gelu(self._linear(x, f"{p}.intermediate.dense"), approximate=self.spec.gelu_approximate)
            x = self._norm(self._linear(h, f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
        return x


def pool(hidden, mask, modes: tuple[str, ...]):
    """Sentence vectors [batch, len(modes) x hidden] from token states [batch, tokens, hidden] and the attention
    mask, each mode as sentence-transformers' Pooling computes it (padding on either side), concatenated in order:
    cls the first real token, max and mean over the real ones, mean_sqrt_len_tokens the sum over the square root
    of the count, weightedmean weighted 1, 2, ... from the first real token, lasttoken the last real one."""
    m = mask.to(hidden.dtype)[..., None]
    rows = torch.arange(hidden.shape[0])
    first = mask.to(torch.int32).argmax(1)  # the first real token (after any left padding)
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(hidden[rows, first])
        elif mode == "max":
            out.append(hidden.masked_fill(m == 0, float("-inf")).max(1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            count = m.sum(1).clamp(min=1e-9)
            out.append((hidden * m).sum(1) / (count if mode == "mean" else count.sqrt()))
        elif mode == "weightedmean":
            weights = m * (torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype)[None, :, None]
                           - first[:, None, None].to(hidden.dtype))
            out.append((hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9))
        elif mode == "lasttoken":
            last = hidden.shape[1] - 1 - mask.flip(1).to(torch.int32).argmax(1)
            out.append(hidden[rows, last])
        else:
            raise ValueError(f"pooling mode {mode!r}")
    return torch.cat(out, dim=-1)


def load_encoder(folder: Path):
    """A callable (input_ids, attention_mask[, token_type_ids]) -> last hidden states, float32."""
    enc = BertEncoder.load(folder)
    if enc is not None:
        return enc
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(**inputs: torch.Tensor) -> torch.Tensor:
        return model(**inputs).last_hidden_state

    return run


class BertClassifier:
    """Token ids -> logits [batch, labels], as BertForSequenceClassification computes them: BERT's pooler
    (tanh of a dense layer over the first token) and the classifier layer."""

    def __init__(self, encoder: BertEncoder) -> None:
        self.encoder = encoder

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        enc = self.encoder
        first = enc(input_ids, attention_mask, token_type_ids)[:, 0]
        return enc._linear(torch.tanh(enc._linear(first, "pooler.dense")), "classifier")


def load_classifier(folder: Path, tokenizer=None):
    """A callable (input_ids, attention_mask[, token_type_ids][, position_ids]) -> logits [batch, labels],
    float32. A decoder's classifier reads its last token that is not padding, which it finds by the pad id:
    the tokenizer's stands in where its config names none. A config with `classifier_from_token` (vLLM's
    --hf-overrides; model/loading/hf_overrides.py) is a causal LM scored by those tokens' logits."""
    import json

    config = json.loads((Path(folder) / "config.json").read_text())
    if config.get("classifier_from_token"):
        return TokenClassifier(folder, config, tokenizer)
    enc = BertEncoder.load(folder)
    if enc is not None and "classifier.weight" in enc.w and "pooler.dense.weight" in enc.w:
        return BertClassifier(enc)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    text = model.config.get_text_config()
    if text.pad_token_id is None and tokenizer is not None and tokenizer.pad_token_id is not None:
        text.pad_token_id = model.config.pad_token_id = tokenizer.pad_token_id

    @torch.inference_mode()
    def run(**inputs: torch.Tensor) -> torch.Tensor:
        return model(**inputs).logits

    return run


class TokenClassifier:
    """A causal LM as a classifier (vLLM's `classifier_from_token`): the logits of the named tokens at each
    input's last token, from the final hidden state and those tokens' rows of the output embedding; with
    `is_original_qwen3_reranker`, one label, the "yes" logit minus the "no" one (a sigmoid of it is
    P(yes) / (P(yes) + P(no)), Qwen3-Reranker's score)."""

    def __init__(self, folder: Path, config: dict, tokenizer) -> None:
        from transformers import AutoModelForCausalLM

        tokens = list(config["classifier_from_token"])
        ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
        missing = [t for t, i in zip(tokens, ids, strict=True) if i is None or i == tokenizer.unk_token_id]
        if missing:
            raise ValueError(f"{folder}: classifier_from_token names {missing}, which the tokenizer does not have "
                             "as single tokens")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        rows = model.get_output_embeddings().weight.detach()[ids].float()  # [tokens, hidden]
        if config.get("is_original_qwen3_reranker"):
            rows = (rows[1] - rows[0])[None]  # ["no", "yes"]: yes over no
        self.body, self.rows = model.base_model, rows

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor | None = None, **_: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids).last_hidden_state
        return pool(hidden, attention_mask, ("lasttoken",)).float() @ self.rows.T
