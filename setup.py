"""Builds servelm's C++ CPU kernels when servelm is installed (`pip install .`, `pip install -e .`,
`pip wheel .`): every instruction-set variant of this architecture, compiled with plain `c++` into
servelm/model/kernels/lib (servelm/model/kernels/build.py). A variant that cannot build is recorded in the
manifest and skipped at run time; an install never fails for the kernels' sake."""

import importlib.util
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent


def _kernel_build():
    # by path: the package's dependencies (torch...) are not in pip's build environment
    spec = importlib.util.spec_from_file_location("servelm_kernel_build", ROOT / "servelm/model/kernels/build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class BuildKernels(build_ext):
    """build_ext for libraries that are not Python extensions: compile each kernel variant into the package
    (in place for editable installs, into build_lib for wheels)."""

    def run(self):
        kb = _kernel_build()
        inplace = self.inplace or getattr(self, "editable_mode", False)
        out = kb.OUT_DIR if inplace else Path(self.build_lib) / "servelm" / "model" / "kernels" / "lib"
        try:
            manifest = kb.build(out, kb.SRC_DIR, jobs=self.parallel or None)
        except Exception as e:  # never fail the install: the engine runs on the PyTorch path instead
            print(f"servelm kernels: build failed ({e}); servelm will use the PyTorch path")
            return
        if not manifest["built"]:
            print("servelm kernels: no variant built; servelm will use the PyTorch path")

    def get_outputs(self):
        return []


class BinaryDistribution(Distribution):
    """A platform wheel: it carries compiled libraries, though no Python extension module."""

    def has_ext_modules(self):
        return True


setup(distclass=BinaryDistribution, cmdclass={"build_ext": BuildKernels})
