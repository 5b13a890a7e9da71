"""llama.cpp through llama-cpp-python, one request at a time (its Python API has no batching across
requests): W2's TTFT and TPOT, and W1's rate over the first --max-requests requests."""

import time

from common import SAMPLED, Timer, median, output_len, parser, prompts, sampled, serve


def main() -> None:
    args = parser(__doc__).parse_args()
    import llama_cpp  # built by run_peers.py with its AMX fix: the extra buffer types (AMX, repack) stay on

    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=1024, n_batch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)
    load_s = time.perf_counter() - t

    def one(prompt, n, sample=False):
        """Generation of n tokens (greedy, or SAMPLED's settings) from a cleared cache; returns (ttft, e2e)."""
        llm.reset()
        start = time.perf_counter()
        first = None
        how = dict(top_k=0, temp=SAMPLED["temperature"], top_p=SAMPLED["top_p"]) if sample else dict(top_k=1, temp=0.0)
        for i, _ in enumerate(llm.generate(prompt, **how, reset=True)):
            if first is None:
                first = time.perf_counter() - start
            if i + 1 >= n:
                break
        return first, time.perf_counter() - start

    one(prompts("W2")[0][:32], 4)

    def measure_one(a):
        ps, out = prompts(a.workload), output_len(a.workload)
        if len(ps) == 1:
            runs = [one(ps[0], out) for _ in range(a.reps)]
            t1, e = median([r[0] for r in runs]), median([r[1] for r in runs])
            return {"ttft_ms": round(1000 * t1, 2), "tpot_ms": round(1000 * (e - t1) / (out - 1), 3)}
        batch = ps[: a.max_requests or len(ps)]
        with Timer() as tm:
            for p in batch:
                one(p, out, sampled(a.workload))
        return {"output_tok_per_s": round(len(batch) * out / tm.s, 1), "requests_timed": len(batch)}

    serve("llama.cpp (llama-cpp-python, sequential)", llama_cpp.__version__, args, load_s, measure_one)


if __name__ == "__main__":
    main()
