"""The `servelm` command line: generate, chat, serve, the model commands (pull, list, ps, rm, models), the
control database's migrations (db), bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from servelm.config.args import add_engine_args, engine_config_from_args

EXAMPLES = """examples:
  servelm generate "Once upon a time" --max-tokens 32 --temperature 0
  servelm generate "Tell me a joke" --chat --temperature 0.7 --seed 1
  servelm generate "def fib(n):" --model ./my-llama --stop "\\n\\n" --json
  servelm chat --system "You are terse."
  servelm chat --url http://127.0.0.1:8000   # a running server's chat API, streamed
  servelm serve --port 8000               # then: curl localhost:8000/v1/models
  servelm serve Qwen/Qwen3-0.6B           # a Hugging Face repo id: from the HF cache, else downloaded first
  servelm pull bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M && servelm list && servelm ps
  servelm bench throughput --workload W1 --baselines hf-static
  servelm bench serve --base-url http://127.0.0.1:8000 --rate 2
  servelm bench serve --dataset-name sharegpt --dataset-path sharegpt.json --num-prompts 200
  servelm models register smol ./SmolLM2 --validate && servelm models promote smol:1 && servelm models deploy smol
  servelm apply -f model.yaml && servelm get deployments && servelm describe smol
  servelm db upgrade --database-url postgresql+psycopg://servelm@db/servelm && servelm db current
"""


# The two sampling defaults that differ by command; every other one is SamplingParams' own. A model whose
# generation config states a default (servelm.config.generation) overrides them: a flag given overrides both.
GENERATE_DEFAULTS = {"max_tokens": 128, "temperature": 1.0}
CHAT_DEFAULTS = {"max_tokens": 512, "temperature": 0.7}
# the flags a model's generation config may give the default of
_MODEL_DEFAULTED = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty")


def add_sampling_args(parser: argparse.ArgumentParser, defaults: dict) -> None:
    from servelm.sampling_params import SamplingParams

    d = {f.name: f.default for f in dataclasses.fields(SamplingParams)} | defaults
    parser.set_defaults(command_sampling_defaults={k: d[k] for k in _MODEL_DEFAULTED})
    g = parser.add_argument_group("sampling", "a flag left out takes the model's default where its "
                                  "generation_config.json states one (--generation-config), else the one shown")

    def arg(flag: str, tp: type, help: str, **kw) -> None:
        dest = flag.lstrip("-").replace("-", "_")
        default = None if dest in _MODEL_DEFAULTED else d[dest]  # None: filled in by sampling_params_from_args
        g.add_argument(flag, type=tp, default=default, help=help + f" (default: {d[dest]})", **kw)

    arg("--max-tokens", int, "most tokens to generate per completion")
    arg("--temperature", float, "divides the logits; 0 means greedy")
    arg("--top-p", float, "keep the smallest set of tokens whose probability adds up to p (1 keeps all)")
    arg("--top-k", int, "keep the k most likely tokens (0 keeps all)")
    arg("--min-p", float, "drop tokens less likely than min-p times the most likely one (0 keeps all)")
    arg("--repetition-penalty", float, "above 1 discourages tokens already in the prompt or output")
    arg("--presence-penalty", float, "in [-2, 2]: subtracted once from each token already generated")
    arg("--frequency-penalty", float, "in [-2, 2]: subtracted per occurrence of each generated token")
    g.add_argument("--stop", action="append", default=None, help="end a completion at this string (repeatable)")
    arg("--min-tokens", int, "EOS and stop token ids are masked until this many tokens exist")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    arg("-n", int, "completions per prompt")
    g.add_argument("--logprobs", type=int, default=None, help="also return the top-k logprobs of each token")


def sampling_params_from_args(args: argparse.Namespace, model_defaults: dict | None = None):
    """The command's SamplingParams: each flag given, else the model's default (`model_defaults`: the engine's
    sampling_defaults), else the command's."""
    from servelm.sampling_params import SamplingParams

    model_defaults = model_defaults or {}
    picked = {k: v if (v := getattr(args, k)) is not None else model_defaults.get(k, default)
              for k, default in args.command_sampling_defaults.items()}
    return SamplingParams(n=args.n, stop=args.stop, min_tokens=args.min_tokens, ignore_eos=args.ignore_eos,
                          logprobs=args.logprobs, **picked)


def _load_llm(args: argparse.Namespace):
    """The LLM for generate and chat; a missing or unsupported model is one line (exit 2) before any load."""
    from servelm.model.loading.hf_overrides import engine_model
    from servelm.model.loading.hub import fetch_models
    from servelm.model.loading.metadata import check_model

    config = engine_config_from_args(args)
    from servelm.logs import configure_logging

    configure_logging(config.device_config.log_config_file)
    fetch_models(config)  # a Hub model not yet in the Hugging Face cache: downloaded now
    check_model(*engine_model(config.model_config))
    from servelm.entrypoints.llm import LLM

    return LLM.from_config(config)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _load_llm(args)
    params = sampling_params_from_args(args, llm.engine.sampling_defaults)
    if args.chat:
        prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompts]
    else:
        prompts = list(args.prompts)
    outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for prompt, out in zip(args.prompts, outs, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, "completions": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                 "stop_reason": c.stop_reason, "cumulative_logprob": c.cumulative_logprob}
                for c in out.outputs]}))
        else:
            for c in out.outputs:
                print(c.text if args.chat else prompt + c.text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    if args.url:
        from servelm.entrypoints.chat import RemoteError, api_key_from_env, run_remote_chat

        try:
            return run_remote_chat(args.url, args.model, args.api_key or api_key_from_env(),
                                   sampling_params_from_args(args), args.system)
        except RemoteError as e:
            print(f"servelm chat: {e}", file=sys.stderr)
            return 1
    from servelm.entrypoints.chat import run_chat

    llm = _load_llm(args)
    return run_chat(llm, sampling_params_from_args(args, llm.engine.sampling_defaults), args.system)


def _version() -> str:
    """The installed distribution's version (what pip reports), else the source tree's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("servelm")
    except PackageNotFoundError:
        from servelm import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="servelm", description="servelm: a fast LLM inference engine. Serves local folders and .gguf files, "
        "and Hugging Face repo ids from the Hugging Face cache (downloaded into it first unless HF_HUB_OFFLINE=1).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"servelm {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one or more prompts and print the results")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(gen)
    add_sampling_args(gen, GENERATE_DEFAULTS)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive chat in the terminal with streamed replies",
                          description="An interactive chat in the terminal with streamed replies: the model runs "
                          "in this process, or, with --url, on a running server (its OpenAI chat API; --model then "
                          "names a model the server serves, by default the first one /v1/models lists, and the "
                          "engine flags are not used).")
    chat.add_argument("--system", default=None, help="a system prompt")
    client = chat.add_argument_group("client of a running server")
    client.add_argument("--url", default=None,
                        help="a running server's root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)")
    client.add_argument("--api-key", default=None,
                        help="the server's API key (default: $SERVELM_API_KEY, else $OPENAI_API_KEY; the env vars "
                        "keep the key out of the process list)")
    add_engine_args(chat)
    add_sampling_args(chat, CHAT_DEFAULTS)
    chat.set_defaults(func=cmd_chat)

    from servelm.server.serve import add_args as add_serve_args

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server",
                           description="Serve a model over an OpenAI-compatible HTTP API. Every setting below "
                           "can also come from a config file (--config, YAML/TOML/JSON with sections engine, "
                           "server, admission) or an env var SERVELM_<SETTING>; precedence CLI > env > file.",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(serve)

    from servelm.entrypoints.run_batch import add_args as add_run_batch_args

    add_run_batch_args(sub)  # run-batch: a file of OpenAI Batch API requests

    from servelm.entrypoints.hub_cli import add_args as add_hub_args

    add_hub_args(sub)  # pull, list, ps, rm

    from servelm.entrypoints.models_cli import add_args as add_models_args

    models = sub.add_parser("models", help="manage a running server's models and deployments (admin API)",
                            description="The model platform's admin API: register versions, promote and roll "
                            "them back, deploy and scale them, read the audit trail.")
    add_models_args(models)

    from servelm.entrypoints.spec_cli import add_args as add_spec_args

    add_spec_args(sub)  # apply, get deployments, describe

    from servelm.entrypoints.db_cli import add_args as add_db_args

    add_db_args(sub)  # db upgrade, db current

    bench = sub.add_parser("bench", help="benchmarks that print JSON")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from servelm.bench.throughput import add_args as add_throughput_args

    thr = bench_sub.add_parser("throughput", help="offline workloads W1-W4 vs transformers, as JSON")
    add_throughput_args(thr)
    add_engine_args(thr)
    from servelm.bench.serve import add_args as add_serve_bench_args

    sv = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server with workload S1 or a dataset "
                              "(JSONL, ShareGPT), as JSON")
    add_serve_bench_args(sv)
    return parser


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "httpx2", "httpcore"):  # one INFO line per HTTP request (the Hub's, the admin API's)
        logging.getLogger(name).setLevel(logging.WARNING)
    # Alembic's INFO lines name its plugins and each step; servelm logs what a migration did in one line
    for name in ("alembic.runtime.plugins", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"servelm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading: stop quietly, with the shell's code for SIGINT
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
