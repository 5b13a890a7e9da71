"""servelm's `LLM.beam_search` on the beam workload (common.BEAM), prefix caching on (its default)."""

import time

from common import BEAM, beam_parser, report_beam


def main() -> None:
    args = beam_parser(__doc__).parse_args()
    import servelm
    from servelm import LLM, BeamSearchParams

    t = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=64, max_model_len=1024, num_threads=args.threads)
    load_s = time.perf_counter() - t
    params = BeamSearchParams(beam_width=BEAM["width"], max_tokens=BEAM["out"], ignore_eos=True)

    def search(prompts):
        return [[s.tokens for s in o.sequences] for o in llm.beam_search(prompts, params)]

    report_beam("servelm", servelm.__version__, args, load_s, search)


if __name__ == "__main__":
    main()
