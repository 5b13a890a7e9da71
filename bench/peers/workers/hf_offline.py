"""transformers `generate`: W1 as one padded static batch (no padding is needed: equal lengths), W2 alone."""

import time

from common import SAMPLED, measure, parser, serve


def main() -> None:
    args = parser(__doc__).parse_args()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    load_s = time.perf_counter() - t

    def run(batch, n, sampled):
        how = {"do_sample": True, **SAMPLED, "top_k": 0} if sampled else {"do_sample": False}
        gen = GenerationConfig(**how, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            model.generate(torch.tensor(batch), attention_mask=torch.ones(len(batch), len(batch[0]), dtype=torch.long),
                           generation_config=gen)

    serve("transformers", transformers.__version__, args, load_s, lambda a: measure(a, run))


if __name__ == "__main__":
    main()
