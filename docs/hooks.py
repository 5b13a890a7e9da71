"""mkdocs hook: adds the generated reference pages (docs/gen_reference.py) to every build."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.structure.files import File

_spec = importlib.util.spec_from_file_location("servelm_docs_gen_reference", Path(__file__).with_name("gen_reference.py"))
gen_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_reference)


def on_files(files, config):
    for path, text in gen_reference.pages().items():
        files.append(File.generated(config, path, content=text))
    return files
