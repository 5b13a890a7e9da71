"""This checkout's CPU kernels against another build of them, alternating in one process so that a noisy
minute hits both alike: two engines over the same checkpoint, each built while `cpu_kernels.load()`
returned its side's kernels. The other build is either a compiled torch-extension module (the JIT builds
that servelm made before the kernels moved to install time, cached as
`~/.cache/servelm/kernels/<tag>/servelm_cpu_<tag>.so`) or another checkout, whose kernels are built into
the cache. Per repeat: W2's TPOT and optionally W1's throughput. Prints one JSON object with each side's
repeats, medians and ratios.

  python bench/kernel_build_ab.py --model DIR --base ~/.cache/servelm/kernels/a02d8631f7b2/servelm_cpu_a02d8631f7b2.so --w1

A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
from pathlib import Path

from ab_repeats import alternate, parser  # bench/ is on sys.path when run


def base_kernels(path: Path):
    """The other side's kernels: a torch-extension .so imported as a module, or a checkout built from source."""
    import torch  # noqa: F401  (the extension module links libtorch)

    from servelm.model.kernels import cpu as cpu_kernels

    if path.suffix == ".so":
        name = path.stem
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    return cpu_kernels.build(path / "servelm" / "model" / "csrc")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--base", type=Path, required=True, help="the other build: an extension .so or a checkout")
    a = p.parse_args()
    from servelm import LLM
    from servelm.model.kernels import cpu as cpu_kernels

    sides = {"new": cpu_kernels.load(), "base": base_kernels(a.base.expanduser())}
    engines = {}
    for side, kernels in sides.items():
        cpu_kernels._module, cpu_kernels._tried = kernels, True  # what the model's layers pick up as they build
        engines[side] = LLM(a.model, dtype="bfloat16", num_threads=a.threads, enable_prefix_caching=False)
    def select(side: str):  # the sampler asks cpu_kernels for its argmax on every step
        cpu_kernels._module = sides[side]
        return engines[side]

    vocab = engines["new"].engine.core.model.spec.vocab_size
    out = {"model": a.model, "threads": a.threads, "base": str(a.base),
           **alternate(select, ("new", "base"), vocab, a.repeats, a.w1)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
