"""Wait for a model's canary rollout to end: exit 0 once it is promoted, 1 when it failed or was rolled back
(the canary controller has then already sent all traffic back to the PRODUCTION version), 2 on timeout.

    SERVELM_URL=... SERVELM_ADMIN_KEY=... python deploy/ci/wait_canary.py --model smol --timeout 3600
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import httpx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--every", type=float, default=30, help="seconds between polls")
    a = ap.parse_args(argv)
    url, key = os.environ["SERVELM_URL"], os.environ["SERVELM_ADMIN_KEY"]
    deadline = time.monotonic() + a.timeout
    with httpx.Client(base_url=url, headers={"x-api-key": key}, timeout=30) as client:
        while time.monotonic() < deadline:
            r = client.get(f"/admin/models/{a.model}/canary")
            r.raise_for_status()
            status = r.json().get("status")
            print(f"canary {a.model}: {status} ({r.json().get('traffic_percent', '?')}% of traffic)", flush=True)
            if status == "promoted":
                return 0
            if status in ("failed", "rolled_back"):
                return 1
            time.sleep(a.every)
    return 2


if __name__ == "__main__":
    sys.exit(main())
