"""Model governance over HTTP, in-process (the `platform` app of test_traffic_api: real registry, control plane
and traffic service, fake engines): API key groups in segment rules, concept and embedding drift, the
webhook, the OTLP prediction-log sink, and traffic state that survives a restart."""

from __future__ import annotations

import pytest
from test_traffic_api import ADMIN, complete, platform, put_policy  # noqa: F401 (platform is a fixture)


def test_a_segment_rule_on_a_key_group_pins_that_groups_keys(platform, tmp_path):
    """Keys file entries carry `groups`; a rule on a group sends that group's keys to its version, every other
    key follows the split (key-group rules never matched before: no key had a group)."""
    from servelm.server.auth import KeyStore

    client, state, _ = platform
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n"
                    "  - {name: a1, key: sk-group-a1-key, groups: [beta, eu]}\n"
                    "  - {name: a2, key: sk-group-a2-key, groups: [beta]}\n"
                    "  - {name: b1, key: sk-group-b1-key, groups: [us]}\n"
                    "  - {name: c1, key: sk-group-c1-key}\n")
    state.keys = KeyStore.from_config(None, str(keys), ADMIN["x-api-key"])
    put_policy(client, {"arms": [{"version": 1}], "segments": [{"version": 3, "name": "beta",
                                                                "key_groups": ["beta"]}]})
    for name, want in (("a1", "m:3"), ("a2", "m:3"), ("b1", "m:1"), ("c1", "m:1")):
        for _ in range(3):
            r = complete(client, headers={"Authorization": f"Bearer sk-group-{name}-key"})
            assert r.status_code == 200, r.text
            assert r.headers["x-servelm-model-version"] == want, name
        assert r.headers["x-servelm-arm"] == ("segment:beta" if want == "m:3" else "v1")


@pytest.mark.parametrize("groups", ["beta", [1], ["ok", ""]])
def test_a_malformed_key_group_list_is_refused(tmp_path, groups):
    import json

    from servelm.server.auth import load_keys_file

    f = tmp_path / "keys.json"
    f.write_text(json.dumps([{"name": "k", "key": "sk-12345678", "groups": groups}]))
    with pytest.raises(ValueError, match="groups"):
        load_keys_file(str(f))
