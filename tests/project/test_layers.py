"""The package's layers depend one way only: model <- engine <- worker <- control <- server <- entrypoints (and ray,
servelm on a Ray cluster, beside entrypoints).

Every `servelm.*` import in every module (top-level or inside a function) is checked against the layer of
the module that makes it; an import from a higher layer fails the test with the file and line."""

from __future__ import annotations

import ast
from pathlib import Path

import servelm

ROOT = Path(servelm.__file__).parent
# Lower number = lower layer. Shared leaf modules (config tree, params, outputs, progress, the beam search that
# runs over any engine's generate) sit below all.
LAYERS = {
    "config": 0, "version": 0, "sampling_params": 0, "pooling_params": 0, "outputs": 0, "progress": 0, "lora": 0,
    "beam_search": 0, "logs": 0,
    "model": 1, "engine": 2, "worker": 3, "runtimes": 3, "control": 4, "server": 5,
    "entrypoints": 6, "bench": 6, "ray": 6, "__init__": 6, "__main__": 6,
}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "servelm":
        return None
    return LAYERS[parts[1]] if len(parts) > 1 else LAYERS["__init__"]


def _imports(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def test_every_layer_is_listed():
    tops = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
            if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    assert tops <= set(LAYERS), f"modules with no layer: {tops - set(LAYERS)}"


def test_no_module_imports_from_a_layer_above_its_own():
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        own = _layer(".".join(rel.parts))
        for line, mod in _imports(path):
            target = _layer(mod)
            if target is not None and own is not None and target > own:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {mod}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)
