"""`servelm serve` starts its engine process before anything heavy: the API side's imports up to the
engine launch must not pull in torch or transformers (each costs seconds of start-up)."""

from __future__ import annotations

import subprocess
import sys


def test_api_side_imports_stay_light():
    code = ("import sys, servelm, servelm.entrypoints.cli, servelm.server.serve, servelm.server.async_engine; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_package_exports_still_resolve():
    import servelm

    assert servelm.LLM.__name__ == "LLM" and servelm.SamplingParams.__name__ == "SamplingParams"
    assert set(servelm.__all__) <= set(dir(servelm)) | set(servelm._LAZY) | {"__version__"}
