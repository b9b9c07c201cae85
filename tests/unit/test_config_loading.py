"""Strict YAML loading: unknown keys, types, includes, overrides, resolved round trip."""

from __future__ import annotations

import dataclasses
import pathlib
import textwrap

import pytest
import yaml

from sao_megatron.config import (
    ConfigError, ExperimentConfig, OptimizerConfig, from_dict, load_config, load_yaml_tree, to_dict,
    write_resolved,
)

pytestmark = pytest.mark.unit


def write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


# ---------------------------------------------------------------- strictness


def test_unknown_key_names_path_file_and_suggestion(tmp_path):
    f = write(tmp_path / "exp.yaml", """
        model:
          num_layers: 2
          hiden_size: 64
    """)
    msg = error_of(f)
    assert str(f) in msg
    assert "'model.hiden_size'" in msg
    assert "Did you mean 'hidden_size'" in msg


def test_unknown_top_level_section(tmp_path):
    msg = error_of(write(tmp_path / "exp.yaml", "optimiser: {lr: 1.0}\n"))
    assert "unknown key 'optimiser'" in msg and "Valid keys under '<root>'" in msg


def test_unknown_key_deep_in_nested_section(tmp_path):
    msg = error_of(write(tmp_path / "exp.yaml", "critic: {optimizer: {learning_rate: 1.0}}\n"))
    assert "'critic.optimizer.learning_rate'" in msg


@pytest.mark.parametrize("yaml_text, key, expect", [
    ("model: {num_layers: true}", "model.num_layers", "expected int, got bool"),
    ("model: {num_layers: 2.0}", "model.num_layers", "expected int, got float"),
    ("model: {num_layers: '2'}", "model.num_layers", "expected int, got str"),
    ("actor: {optimizer: {lr: false}}", "actor.optimizer.lr", "expected float, got bool"),
    ("actor: {optimizer: {lr: fast}}", "actor.optimizer.lr", "expected float, got str"),
    ("actor: {optimizer: {lr: nan}}", "actor.optimizer.lr", "expected float, got str"),
    ("model: {qk_layernorm: 1}", "model.qk_layernorm", "expected bool, got int"),
    ("model: {family: llama}", "model.family", "'llama' is not one of"),
    ("scheduler: {mode: true}", "scheduler.mode", "is not one of"),
    ("critic: {trainable: value_head}", "critic.trainable", "expected a list"),
    ("critic: {trainable: [value_head, 3]}", "critic.trainable[1]", "expected str, got int"),
    ("model: {moe_layer_freq: [1, true]}", "model.moe_layer_freq", "matches none of"),
    ("model: {kv_channels: 1.5}", "model.kv_channels", "expected int, got float"),
    ("data: {phases: [{start_version: 0, target: a}, {start_version: x}]}", "data.phases[1].start_version",
     "expected int, got str"),
    ("model: 3", "model", "expected a mapping for ModelConfig"),
])
def test_wrong_types_are_rejected(tmp_path, yaml_text, key, expect):
    f = write(tmp_path / "exp.yaml", yaml_text + "\n")
    msg = error_of(f)
    assert f"'{key}'" in msg, msg
    assert expect in msg, msg
    assert str(f) in msg


@pytest.mark.parametrize("yaml_text, attr, expect", [
    ("actor: {optimizer: {lr: 1e-5}}", ("actor", "optimizer", "lr"), 1e-5),  # YAML 1.1 reads 1e-5 as str
    ("actor: {optimizer: {lr: 3}}", ("actor", "optimizer", "lr"), 3.0),
    ("model: {kv_channels: null}", ("model", "kv_channels"), None),
    ("model: {moe_layer_freq: [0, 1]}", ("model", "moe_layer_freq"), [0, 1]),
    ("critic: {init_from: /ckpt/value}", ("critic", "init_from"), "/ckpt/value"),
])
def test_accepted_values(tmp_path, yaml_text, attr, expect):
    cfg = load_config(write(tmp_path / "exp.yaml", yaml_text + "\n"), check=False)
    value = cfg
    for a in attr:
        value = getattr(value, a)
    assert value == expect and type(value) is type(expect)


def test_int_to_float_only_for_float_fields(tmp_path):
    cfg = load_config(write(tmp_path / "e.yaml", "algorithm: {dis: {eps_high: 5}}\n"))
    assert isinstance(cfg.algorithm.dis.eps_high, float)


def test_union_keeps_exact_types(tmp_path):
    # data.options is dict[str, int | float | str | bool]: "1" must stay a string, True a bool.
    f = write(tmp_path / "e.yaml", "data: {options: {a: '1', b: '1e-5', c: true, d: 2, e: 2.5}}\n")
    opts = load_config(f).data.options
    assert opts == {"a": "1", "b": "1e-5", "c": True, "d": 2, "e": 2.5}
    assert [type(v) for v in opts.values()] == [str, str, bool, int, float]


def test_missing_file():
    msg = error_of("/nonexistent/dir/exp.yaml")
    assert "not found" in msg and "/nonexistent/dir/exp.yaml" in msg


@pytest.mark.parametrize("text, expect", [
    ("model: {num_layers: [1, 2\n", "not valid YAML"),
    ("- a\n- b\n", "top level must be a mapping, got list"),
    ("model:\n  num_layers: 2\n   hidden_size: 3\n", "not valid YAML"),
])
def test_bad_yaml(tmp_path, text, expect):
    f = write(tmp_path / "bad.yaml", text)
    msg = error_of(f)
    assert expect in msg and str(f) in msg


def test_empty_file_gives_defaults(tmp_path):
    assert load_config(write(tmp_path / "e.yaml", "")) == ExperimentConfig()


def test_partial_nested_section_keeps_the_fields_own_default(tmp_path):
    # critic.optimizer defaults to lr=1e-5 (not OptimizerConfig's 1e-6): a partial section keeps it.
    cfg = load_config(write(tmp_path / "e.yaml", "critic: {optimizer: {weight_decay: 0.1}}\n"))
    assert cfg.critic.optimizer == dataclasses.replace(ExperimentConfig().critic.optimizer, weight_decay=0.1)
    assert cfg.critic.optimizer.lr == 1e-5 != OptimizerConfig().lr


# ---------------------------------------------------------------- _base_ includes


def test_base_relative_to_including_file_and_deep_merge(tmp_path):
    write(tmp_path / "models" / "m.yaml", """
        model: {num_layers: 6, hidden_size: 96, num_attention_heads: 6, num_query_groups: 3}
        run: {seed: 7}
    """)
    f = write(tmp_path / "experiments" / "e.yaml", """
        _base_: ../models/m.yaml
        model: {num_layers: 3}
        algorithm: {dis: {eps_low: 0.8}}
    """)
    cfg = load_config(f)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads) == (3, 96, 6)
    assert cfg.run.seed == 7 and cfg.algorithm.dis.eps_low == 0.8


def test_nested_bases_and_lists_in_order(tmp_path):
    write(tmp_path / "a.yaml", "run: {seed: 1, num_steps: 1}\nmodel: {num_layers: 2}\n")
    write(tmp_path / "sub" / "b.yaml", "_base_: ../a.yaml\nrun: {seed: 2}\n")
    write(tmp_path / "c.yaml", "run: {num_steps: 3}\nlogging: {log_interval: 5}\n")
    f = write(tmp_path / "top.yaml", "_base_: [sub/b.yaml, c.yaml]\nlogging: {log_interval: 9}\n")
    tree = load_yaml_tree(f)
    # later bases override earlier ones, the including file overrides all bases
    assert tree == {"run": {"seed": 2, "num_steps": 3}, "model": {"num_layers": 2},
                    "logging": {"log_interval": 9}}


def test_base_inside_a_section(tmp_path):
    write(tmp_path / "opt.yaml", "lr: 3.0e-6\nweight_decay: 0.1\n")
    f = write(tmp_path / "e.yaml", "actor:\n  optimizer: {_base_: opt.yaml, lr: 2.0e-6}\n")
    opt = load_config(f).actor.optimizer
    assert (opt.lr, opt.weight_decay) == (2e-6, 0.1)


def test_error_in_a_section_base_names_that_file_and_the_full_key(tmp_path):
    opt = write(tmp_path / "opt.yaml", "lr: 1.0e-6\nbeta1: 0.9\n")
    top = write(tmp_path / "e.yaml", "actor:\n  optimizer: {_base_: opt.yaml}\n")
    msg = error_of(top)
    assert msg.startswith(f"{opt} (included from {top})") and "'actor.optimizer.beta1'" in msg
    assert "Did you mean 'adam_beta1'" in msg


def test_diamond_include_is_not_a_cycle(tmp_path):
    write(tmp_path / "d.yaml", "run: {seed: 4}\n")
    write(tmp_path / "b.yaml", "_base_: d.yaml\n")
    write(tmp_path / "c.yaml", "_base_: d.yaml\n")
    assert load_config(write(tmp_path / "a.yaml", "_base_: [b.yaml, c.yaml]\n")).run.seed == 4


@pytest.mark.parametrize("files", [
    {"a.yaml": "_base_: a.yaml\n"},
    {"a.yaml": "_base_: b.yaml\n", "b.yaml": "_base_: a.yaml\n"},
    {"a.yaml": "_base_: b.yaml\n", "b.yaml": "model: {_base_: c.yaml}\n", "c.yaml": "_base_: a.yaml\n"},
])
def test_include_cycles_are_errors(tmp_path, files):
    for name, text in files.items():
        write(tmp_path / name, text)
    msg = error_of(tmp_path / "a.yaml")
    assert "circular _base_ include" in msg and "a.yaml" in msg


def test_missing_base_names_the_including_file(tmp_path):
    f = write(tmp_path / "e.yaml", "_base_: nope.yaml\n")
    msg = error_of(f)
    assert str(f) in msg and "'nope.yaml' not found" in msg


@pytest.mark.parametrize("base", ["3", "[]", "{a: 1}", "['']"])
def test_malformed_base(tmp_path, base):
    assert "must be a file path" in error_of(write(tmp_path / "e.yaml", f"_base_: {base}\n"))


def test_error_in_base_names_the_base_file(tmp_path):
    base = write(tmp_path / "models" / "m.yaml", "model: {num_layerz: 2}\n")
    top = write(tmp_path / "e.yaml", "_base_: models/m.yaml\nrun: {seed: 1}\n")
    msg = error_of(top)
    assert msg.startswith(f"{base} (included from {top})"), msg
    assert "'model.num_layerz'" in msg


def test_type_error_in_list_from_base_names_the_base_file(tmp_path):
    base = write(tmp_path / "b.yaml", "critic: {trainable: [value_head, 1]}\n")
    msg = error_of(write(tmp_path / "e.yaml", "_base_: b.yaml\n"))
    assert msg.startswith(str(base)) and "'critic.trainable[1]'" in msg


def test_key_overridden_in_top_file_is_blamed_on_top_file(tmp_path):
    write(tmp_path / "b.yaml", "model: {num_layers: 2}\n")
    top = write(tmp_path / "e.yaml", "_base_: b.yaml\nmodel: {num_layers: two}\n")
    msg = error_of(top)
    assert msg.startswith(f"{top}: ") and "included" not in msg


# ---------------------------------------------------------------- --set overrides


def test_overrides_nested_lists_and_mappings(tmp_path):
    f = write(tmp_path / "e.yaml", "model: {num_layers: 2}\n")
    cfg = load_config(f, ["model.num_layers=4", "critic.trainable=[value_head, router]",
                          "actor.optimizer.lr=2e-6", "rollout.engine_urls=[http://a:1, http://b:2]",
                          "data.options={k: v, n: 3}", "model.kv_channels=null", "run.seed= 9"])
    assert cfg.model.num_layers == 4
    assert cfg.critic.trainable == ["value_head", "router"]
    assert cfg.actor.optimizer.lr == 2e-6
    assert cfg.rollout.engine_urls == ["http://a:1", "http://b:2"]
    assert cfg.data.options == {"k": "v", "n": 3}
    assert cfg.model.kv_channels is None and cfg.run.seed == 9


def test_override_into_missing_section_and_later_wins(tmp_path):
    f = write(tmp_path / "e.yaml", "")
    cfg = load_config(f, ["scheduler.max_staleness=2", "scheduler.max_staleness=3"])
    assert cfg.scheduler.max_staleness == 3


@pytest.mark.parametrize("override, expect", [
    ("model.num_layers", "expected KEY=VALUE"),
    ("model..num_layers=2", "empty part"),
    ("model.num_layers=[1", "not valid YAML"),
    ("model.nope=1", "--set model.nope=1: unknown key 'model.nope'"),
    ("model.num_layers=abc", "--set model.num_layers=abc: 'model.num_layers': expected int"),
    ("model.num_layers.x=1", "'model.num_layers': expected int, got dict"),
])
def test_invalid_overrides(tmp_path, override, expect):
    f = write(tmp_path / "e.yaml", "model: {num_layers: 2}\n")
    msg = error_of(f, [override])
    assert expect in msg, msg


def test_override_error_names_the_config_file(tmp_path):
    f = write(tmp_path / "e.yaml", "")
    assert error_of(f, ["run.seed=x"]).startswith(f"{f} --set run.seed=x")


def test_overrides_do_not_mutate_the_input_tree():
    from sao_megatron.config import apply_overrides

    tree = {"model": {"num_layers": 2}}
    out = apply_overrides(tree, ["model.num_layers=5"])
    assert tree == {"model": {"num_layers": 2}} and out == {"model": {"num_layers": 5}}


# ---------------------------------------------------------------- the rollout section's old weight-push keys

OLD_WEIGHT_SYNC_KEYS = [  # (old key, a value, the key the error must name)
    ("weight_sync_bucket_mb", "1024", "rollout.weight_sync.bucket_mb"),
    ("weight_sync_timeout_s", "60", "rollout.weight_sync.timeout_s"),
    ("weight_sync_verify", "false", "rollout.weight_sync.verify"),
    ("overlap_weight_push", "false", "rollout.weight_sync.overlap"),
    ("engine_weight_format", "fp8_block", "rollout.weight_sync.format"),
]


@pytest.mark.parametrize("old, value, new", OLD_WEIGHT_SYNC_KEYS)
def test_an_old_weight_push_key_names_its_new_place(tmp_path, old, value, new):
    f = write(tmp_path / "e.yaml", f"rollout:\n  {old}: {value}\n")
    msg = error_of(f)
    assert msg == f"{f}: 'rollout.{old}' is an old key: write {new}", msg
    msg = error_of(write(tmp_path / "empty.yaml", ""), [f"rollout.{old}={value}"])
    assert f"--set rollout.{old}={value}: 'rollout.{old}' is an old key: write {new}" in msg, msg


SCALAR_WEIGHT_SYNC = ("'rollout.weight_sync' is an old key: rollout.weight_sync is a section now: write "
                      "rollout.weight_sync.transport: distributed (or disk); on the command line "
                      "--set rollout.weight_sync.transport=distributed")


@pytest.mark.parametrize("value", ["distributed", "disk", "nccl"])
def test_the_old_scalar_weight_sync_names_the_transport_key(tmp_path, value):
    """``--set rollout.weight_sync=distributed`` is in READMEs, docs and issue texts: its error is exact."""
    f = write(tmp_path / "e.yaml", f"rollout: {{weight_sync: {value}}}\n")
    assert error_of(f) == f"{f}: {SCALAR_WEIGHT_SYNC}"
    base = write(tmp_path / "empty.yaml", "")
    assert error_of(base, [f"rollout.weight_sync={value}"]) == (
        f"{base} --set rollout.weight_sync={value}: {SCALAR_WEIGHT_SYNC}")


def test_nccl_is_refused_with_its_new_name(tmp_path):
    """The alias is met once, by the loader, which refuses it (validation never rewrites a config)."""
    f = write(tmp_path / "e.yaml", "")
    assert error_of(f, ["rollout.weight_sync.transport=nccl"]) == (
        f"{f} --set rollout.weight_sync.transport=nccl: 'rollout.weight_sync.transport': 'nccl' is the old name "
        f"of 'distributed': write rollout.weight_sync.transport: distributed "
        f"(--set rollout.weight_sync.transport=distributed)")


def test_the_weight_sync_section_loads_partially_and_from_set(tmp_path):
    f = write(tmp_path / "e.yaml", "rollout: {weight_sync: {transport: distributed, bucket_mb: 1024}}\n")
    ws = load_config(f, ["rollout.weight_sync.overlap=false"]).rollout.weight_sync
    assert (ws.transport, ws.bucket_mb, ws.overlap) == ("distributed", 1024, False)
    assert (ws.timeout_s, ws.verify, ws.format) == (300.0, True, "unquantized")  # the section's defaults


# ---------------------------------------------------------------- resolved config round trip


def test_resolved_round_trip_equals(tmp_path):
    write(tmp_path / "b.yaml", "model: {num_layers: 4, moe_layer_freq: [0, 1, 1, 1]}\n")
    f = write(tmp_path / "e.yaml", """
        _base_: b.yaml
        data:
          options: {style: '1e-5', n: 3, flag: true, name: 'yes'}
          phases: [{start_version: 0, target: terse}, {start_version: 10, target: verbose}]
        critic: {optimizer: {weight_decay: 0.01}, init_from: /ckpt}
        rollout: {engine_urls: ['http://127.0.0.1:3000'], weight_sync: {transport: distributed, verify: false}}
    """)
    cfg = load_config(f, ["actor.optimizer.lr=1e-7", "rollout.weight_sync.bucket_mb=64"])
    out = write_resolved(cfg, tmp_path / "run" / "nested")
    assert out == tmp_path / "run" / "nested" / "config.yaml"
    again = load_config(out)
    assert again == cfg
    # the file is a full, plain mapping: every field of every section, no includes
    tree = yaml.safe_load(out.read_text())
    assert tree == to_dict(cfg) and "_base_" not in out.read_text()
    assert set(tree) == {f.name for f in dataclasses.fields(ExperimentConfig)}
    assert tree["rollout"]["weight_sync"] == {"transport": "distributed", "bucket_mb": 64, "timeout_s": 300.0,
                                              "verify": False, "overlap": True, "format": "unquantized"}


def test_from_dict_of_to_dict_is_identity_for_defaults():
    cfg = ExperimentConfig()
    assert from_dict(ExperimentConfig, to_dict(cfg)) == cfg


def test_config_cli_show_prints_resolved_config(tmp_path, capsys):
    from sao_megatron.cli import main

    f = write(tmp_path / "e.yaml", "model: {num_layers: 4}\n")
    assert main(["config", "show", "--config", str(f), "--set", "run.seed=5"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["model"]["num_layers"] == 4 and tree["run"]["seed"] == 5


def test_config_cli_check_fails_with_exit_code_2(tmp_path, capsys):
    from sao_megatron.cli import main

    f = write(tmp_path / "e.yaml", "model: {num_layerz: 4}\n")
    assert main(["config", "check", "--config", str(f)]) == 2
    assert "num_layerz" in capsys.readouterr().err


# ---------------------------------------------------------------- the algorithm section's old flat keys

OLD_ALGORITHM_KEYS = [  # (old key: value, what the error must name)
    ("gamma: 0.9", "algorithm.gae.gamma"), ("lam: 0.9", "algorithm.gae.lam"),
    ("gae: token", "algorithm.gae.skip_observations: true (skip_observation) or false (token)"),
    ("eps_low: 0.8", "algorithm.dis.eps_low"), ("eps_high: 3.0", "algorithm.dis.eps_high"),
    ("clip_low: 0.2", "algorithm.ppo_clip.clip_low"), ("clip_high: 0.28", "algorithm.ppo_clip.clip_high"),
    ("dual_clip: 3.0", "algorithm.ppo_clip.dual_clip"), ("normalize_group_std: false", "algorithm.group.normalize_std"),
    ("running_mean: exact", "algorithm.running_mean.momentum: 0.99 (exponential) or null (exact)"),
    ("running_mean_momentum: 0.9", "algorithm.running_mean.momentum"),
]


@pytest.mark.parametrize("old, new", OLD_ALGORITHM_KEYS)
def test_an_old_flat_algorithm_key_names_its_new_place(tmp_path, old, new):
    key = old.split(":")[0]
    f = write(tmp_path / "e.yaml", f"algorithm:\n  {old}\n")
    msg = error_of(f)
    assert f"'algorithm.{key}' is an old key" in msg and new in msg and str(f) in msg, msg
    msg = error_of(write(tmp_path / "empty.yaml", ""), [f"algorithm.{key}={old.split(': ')[1]}"])
    assert f"'algorithm.{key}' is an old key" in msg and new in msg and "--set" in msg, msg


def test_the_new_sections_load(tmp_path):
    f = write(tmp_path / "e.yaml", """
        algorithm:
          name: sao_running_mean
          running_mean: {momentum: null}
          dis: {eps_low: 0.8, eps_high: 3}
        critic: {enabled: false}
    """)
    alg = load_config(f).algorithm
    assert (alg.running_mean.momentum, alg.dis.eps_low, alg.dis.eps_high) == (None, 0.8, 3.0)
