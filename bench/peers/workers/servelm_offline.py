"""servelm's offline `LLM.generate` on a shared workload (run by ../run_peers.py)."""

import time

from common import SAMPLED, measure, parser, serve


def main() -> None:
    args = parser(__doc__).parse_args()
    import servelm
    from servelm import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False,
              quantization=args.quantization)
    load_s = time.perf_counter() - t

    def run(batch, n, sampled):
        sp = SamplingParams(**(SAMPLED if sampled else {"temperature": 0}), max_tokens=n, ignore_eos=True)
        llm.generate(batch, sp, use_tqdm=False)

    serve("servelm", servelm.__version__, args, load_s, lambda a: measure(a, run))


if __name__ == "__main__":
    main()
