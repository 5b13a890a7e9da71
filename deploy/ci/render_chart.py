"""Render deploy/helm/servelm with Helm's own engine (the pip package helm-python-sdk, no helm binary) for the
value profiles the tests use, one YAML file per profile, for linters such as checkov:

    python deploy/ci/render_chart.py --out rendered && checkov -d rendered --framework kubernetes
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.project.test_deploy_chart import PROFILES, render  # the profiles the tests validate

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, values in PROFILES.items():
        (out / f"{name}.yaml").write_text(yaml.safe_dump_all(render(values), sort_keys=False))
        print(f"{out / name}.yaml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
