"""The config tree in sections: flat names (LLM(...)'s keywords, --flags, SERVELM_<FIELD>, the file's older
`engine:`/`server:` mappings) each set exactly one section's field; each section validates its own fields;
precedence CLI > env > file holds for a field in any section; `--help` groups the flags by section."""

import argparse
import dataclasses

import pytest

from servelm.config.args import add_engine_args
from servelm.config.engine import (
    ENGINE_FIELDS,
    ENGINE_SECTIONS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    RuntimeSettings,
)
from servelm.config.settings import FIELDS, SECTIONS, ServerConfig, load

# one field of every section, a valid value other than its default, and a value its section refuses
PROBES = {
    "model": ("quantization_group_size", 64, 48),
    "cache": ("block_size", 32, 3),
    "scheduler": ("max_num_seqs", 7, 0),
    "parallel": ("tensor_parallel_size", 2, 0),
    "device": ("cpu_nice", 5, 20),
    "speculative": ("num_speculative_tokens", 3, 0),
    "lora": ("max_loras", 2, 0),
    "structured_outputs": ("structured_output_backend", "llguidance", "outlines"),
    "api": ("port", 9001, 70000),
    "oip": ("oip_max_batch_size", 9, 0),
    "embedding": ("embedding_max_batch_size", 4, 0),
    "lifecycle": ("drain_timeout", 5.0, -1.0),
    "auth": ("prefix_cache_isolation", "none", "tenant"),
    "storage": ("redis_timeout_s", 2.0, 0.0),
    "rollout": ("canary_interval_s", 3.0, 0.0),
    "observability": ("drift_window", 100, 1),
    "admission": ("max_n", 4, 0),
}


def test_every_section_is_probed_and_every_flat_name_is_in_one_section():
    assert set(PROBES) == set(SECTIONS)
    assert sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values()) == len(FIELDS)  # none in two
    assert {FIELDS[name] for name, _, _ in PROBES.values()} == set(SECTIONS)
    assert set(ENGINE_SECTIONS) == {"model", "cache", "scheduler", "parallel", "device", "speculative", "lora",
                                    "structured_outputs"}


@pytest.mark.parametrize("section", list(PROBES))
def test_a_flat_name_sets_its_own_section_and_nothing_else(section):
    name, value, _ = PROBES[section]
    assert FIELDS[name] == section
    c = load({name: value}, env={})
    assert getattr(c.section(section), name) == value and c.sources[f"{section}.{name}"] == "cli"
    default = load({}, env={}).to_dict()
    changed = {(sec, k) for sec, vals in c.to_dict().items() for k, v in vals.items() if default[sec][k] != v}
    assert changed == {(section, name)}
    if section in ENGINE_SECTIONS:  # the same through EngineConfig(**flat), as LLM(...) builds it
        flat = EngineConfig(**{name: value})
        assert getattr(flat.section(section), name) == value
        assert {s for s in ENGINE_SECTIONS if flat.section(s) != EngineConfig().section(s)} == {section}


@pytest.mark.parametrize("section", list(PROBES))
def test_each_section_validates_its_fields(section):
    name, _, bad = PROBES[section]
    with pytest.raises(ConfigError, match=rf"^{section}\.{name} must be .*\(set by --{name.replace('_', '-')}\)"):
        load({name: bad}, env={})
    if section in ENGINE_SECTIONS:  # however the engine config is built or changed
        with pytest.raises(ConfigError, match=rf"^{name} must be"):
            EngineConfig(**{name: bad})
        with pytest.raises(ConfigError, match=rf"^{name} must be"):
            EngineConfig().replace(**{name: bad})
        with pytest.raises(ConfigError, match=rf"^{name} must be"):
            EngineConfig(**{f"{section}_config": dataclasses.replace(EngineConfig().section(section),
                                                                     **{name: bad})})
    elif section != "admission":
        with pytest.raises(ConfigError, match=rf"^{name} must be"):
            ServerConfig(**{name: bad})


def test_cross_section_checks_live_in_the_engine_config():
    with pytest.raises(ConfigError, match="tensor_parallel_size must be 1, or run with no LoRA adapters"):
        EngineConfig(tensor_parallel_size=2, enable_lora=True)
    with pytest.raises(ConfigError, match="kv_cache_dtype must be auto with batch_invariant"):
        EngineConfig(kv_cache_dtype="fp8", batch_invariant=True)


def test_precedence_cli_over_env_over_file_for_a_sectioned_field(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("cache:\n  block_size: 8\n  swap_space_gb: 2\nspeculative:\n  num_speculative_tokens: 2\n")
    env = {"SERVELM_BLOCK_SIZE": "32", "SERVELM_NUM_SPECULATIVE_TOKENS": "5"}
    c = load({"block_size": 64}, env, str(f))
    cache = c.engine.cache_config
    assert (cache.block_size, cache.swap_space_gb, c.engine.speculative_config.num_speculative_tokens) == (64, 2, 5)
    assert c.sources["cache.block_size"] == "cli" and c.sources["cache.swap_space_gb"] == "file"
    assert c.sources["speculative.num_speculative_tokens"] == "env"
    assert load({}, env, str(f)).engine.cache_config.block_size == 32
    assert load({}, {}, str(f)).engine.cache_config.block_size == 8


def test_the_files_section_form_and_flat_form_agree(tmp_path):
    flat, nested, mixed = tmp_path / "flat.yaml", tmp_path / "nested.yaml", tmp_path / "mixed.yaml"
    flat.write_text("engine:\n  block_size: 32\n  max_num_seqs: 3\n  device: cpu\nserver:\n  port: 9001\n"
                    "  api_key: sk-long-enough\n")
    nested.write_text("cache:\n  block_size: 32\nscheduler:\n  max_num_seqs: 3\ndevice:\n  device: cpu\n"
                      "api:\n  port: 9001\nauth:\n  api_key: sk-long-enough\n")
    mixed.write_text("engine:\n  block_size: 32\n  device: cpu\nscheduler:\n  max_num_seqs: 3\n"
                     "cache:\n  block_size: 32\nserver:\n  api_key: sk-long-enough\napi:\n  port: 9001\n")
    a, b, m = (load({}, {}, str(p)) for p in (flat, nested, mixed))
    assert a.to_dict() == b.to_dict() == m.to_dict() and a.sources == b.sources == m.sources
    assert a.engine.cache_config.block_size == 32 and a.server.api_config.port == 9001
    assert a.sources["scheduler.max_num_seqs"] == "file" and a.sources["auth.api_key"] == "file"
    clash = tmp_path / "clash.yaml"
    clash.write_text("engine:\n  block_size: 32\ncache:\n  block_size: 16\n")
    with pytest.raises(ConfigError, match=r"cache\.block_size must be given once, or the same in both places"):
        load({}, {}, str(clash))
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("server:\n  block_size: 32\n")
    with pytest.raises(ConfigError, match=r"server\.block_size must be a known key of \[server\] \(block_size is "
                                          r"in \[cache\]\)"):
        load({}, {}, str(wrong))


def test_patch_takes_flat_sectioned_and_older_group_forms():
    c = load({}, env={})
    assert c.patch({"max_num_seqs": 3}) == {"scheduler.max_num_seqs": 3}
    assert c.patch({"scheduler": {"priority_aging_s": 2}}) == {"scheduler.priority_aging_s": 2.0}
    assert c.patch({"engine": {"max_num_seqs": 5}, "admission": {"max_n": 2}}) == {
        "scheduler.max_num_seqs": 5, "admission.max_n": 2}
    assert c.engine.scheduler_config.max_num_seqs == 5 and c.sources["scheduler.max_num_seqs"] == "runtime"
    assert RuntimeSettings.of(c.engine) == RuntimeSettings(5, "priority", 2.0)
    with pytest.raises(ConfigError, match=r"cache\.max_num_seqs must be a known key of \[cache\]"):
        c.patch({"cache": {"max_num_seqs": 4}})
    with pytest.raises(ConfigError, match=r"cache\.block_size .*changed only at start-up"):
        c.patch({"block_size": 32})
    with pytest.raises(ConfigError, match=r"^scheduler\.max_num_seqs must be >= 1"):
        c.patch({"scheduler": {"max_num_seqs": 0}})
    assert c.engine.scheduler_config.max_num_seqs == 5  # all or nothing


def test_engine_config_has_no_flat_attributes_and_round_trips_flat():
    c = EngineConfig(model="m", block_size=32, max_num_seqs=4, enable_lora=True)
    assert not hasattr(c, "block_size") and c.cache_config.block_size == 32
    with pytest.raises(AttributeError, match="cache_config"):
        c.block_size = 8
    assert EngineConfig(**c.to_dict()) == c and set(c.to_dict()) == set(ENGINE_FIELDS)
    d = c.replace(block_size=64)
    assert (d.cache_config.block_size, c.cache_config.block_size) == (64, 32)
    assert d.cache_config is not c.cache_config and d.model_config is not c.model_config
    assert EngineConfig(cache_config=CacheConfig(block_size=8), block_size=16).cache_config.block_size == 16
    with pytest.raises(TypeError, match="unknown setting 'block_sizes'"):
        EngineConfig(block_sizes=8)
    assert RuntimeSettings(9, "fcfs", 0.0).apply(c).scheduler_config.max_num_seqs == 9


def _groups(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    return {g.title: {o for a in g._group_actions for o in a.option_strings} for g in parser._action_groups}


def test_help_groups_the_flags_by_section():
    from servelm.server.serve import add_args

    p = argparse.ArgumentParser()
    add_args(p)
    groups = _groups(p)
    for sec, cls in SECTIONS.items():
        assert {"--" + f.name.replace("_", "-") for f in dataclasses.fields(cls)} <= groups[f"{sec} config"]
    assert "--block-size" in groups["cache config"] and "--port" in groups["api config"]
    text = p.format_help()
    assert all(f"{sec} config:" in text for sec in SECTIONS)
    g = argparse.ArgumentParser()
    add_engine_args(g)
    assert {t for t in _groups(g) if t.endswith(" config")} == {f"{s} config" for s in ENGINE_SECTIONS}
    assert "--max-num-seqs" in _groups(g)["scheduler config"]
