"""Bad inputs to `sao-megatron convert`: one clear error line, exit code 2, nothing left in the output.

All these are detected before Megatron is imported, so they run in-process through the real
``sao_megatron.cli.main`` (plus one real subprocess to check the entry point end to end).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from sao_megatron.cli import main

pytestmark = pytest.mark.component

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "convert_scripts"))
import hf_fixtures  # noqa: E402

from checkpoints_tools.common import atomic_output_dir  # noqa: E402


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> pathlib.Path:
    return hf_fixtures.write_hf_dir("glm_gqa2_dense0_shared1", tmp_path_factory.mktemp("hf") / "glm")


@pytest.fixture
def hf(pristine, tmp_path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(pristine, tmp_path / "hf"))


def convert_error(capsys, *args) -> str:
    """Run the CLI in-process; assert exit code 2 and a single stderr line; return it."""
    capsys.readouterr()
    assert main(["convert", *map(str, args)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sao-megatron convert "), err
    return err[0]


def shards(hf: pathlib.Path) -> list[pathlib.Path]:
    return sorted(hf.glob("model-*.safetensors"))


def edit_config(hf: pathlib.Path, **changes) -> None:
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, **changes}))


def test_missing_shard(hf, tmp_path, capsys):
    victim = shards(hf)[1]
    victim.unlink()
    line = convert_error(capsys, "hf-to-mcore", "--hf-dir", hf, "--out-dir", tmp_path / "out")
    assert "missing" in line and victim.name in line
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_truncated_safetensors(hf, tmp_path, capsys):
    victim = shards(hf)[-1]
    victim.write_bytes(victim.read_bytes()[:-64])
    line = convert_error(capsys, "hf-to-mcore", "--hf-dir", hf, "--out-dir", tmp_path / "out")
    assert "truncated" in line and victim.name in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changes, needle", [
    ({"num_hidden_layers": 3}, "missing"),            # config implies tensors the files lack
    ({"n_routed_experts": 2}, "not in the mapping"),  # files hold tensors the config does not explain
    ({"moe_intermediate_size": 16}, "has shape"),     # same names, other shapes
])
def test_config_weights_mismatch(hf, tmp_path, capsys, changes, needle):
    edit_config(hf, **changes)
    line = convert_error(capsys, "hf-to-mcore", "--hf-dir", hf, "--out-dir", tmp_path / "out", "--dry-run")
    assert "config/weights mismatch" in line and needle in line


def test_unsupported_architecture(hf, tmp_path, capsys):
    edit_config(hf, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2")
    line = convert_error(capsys, "hf-to-mcore", "--hf-dir", hf, "--out-dir", tmp_path / "out")
    assert "DeepSeek-V2" in line and "supported:" in line
    assert not (tmp_path / "out").exists()


def test_existing_output_is_left_alone(hf, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = convert_error(capsys, "hf-to-mcore", "--hf-dir", hf, "--out-dir", out)
    assert "not empty" in line and "--overwrite" in line
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_mcore_dir_without_metadata_and_mismatched_pair(hf, tmp_path, capsys):
    line = convert_error(capsys, "mcore-to-hf", "--mcore-dir", tmp_path, "--out-dir", tmp_path / "o")
    assert "model_config.yaml" in line and not (tmp_path / "o").exists()
    mc = tmp_path / "mc"
    mc.mkdir()
    from sao_megatron.config.loader import dump_yaml
    from sao_megatron.models.families import model_config_from_hf

    dump_yaml(model_config_from_hf(hf_fixtures.SHAPES["qwen_gqa2_dense0"]), mc / "model_config.yaml")
    line = convert_error(capsys, "check", "--hf-dir", hf, "--mcore-dir", mc)
    assert "describe different models" in line


def test_failure_after_writing_started_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_output_dir(out) as tmp:
            (tmp / "half.distcp").write_text("partial")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with atomic_output_dir(out) as tmp:
        (tmp / "done").write_text("ok")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "done").read_text() == "ok"


def test_entry_point_prints_one_line(hf, tmp_path):
    shards(hf)[0].unlink()
    proc = subprocess.run([sys.executable, "-m", "sao_megatron.cli", "convert", "hf-to-mcore", "--hf-dir", str(hf),
                           "--out-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sao-megatron convert hf-to-mcore: error: "), lines
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
