"""The GPU acceptance script's verdicts, checked on CPU (issue 25): every check PASSes having done
what its name says, or FAILs.

Each test failed on the code before the fix: a SKIP was never a failure and --allow-skip did not
exist; the per-check timeouts added up to 736 s against a 290 s budget; the layouts check turned
any "unsupported" message into SKIP and ignored the ranks' exit code, and ran DP2 layouts that
gloo cannot all-reduce with CUDA tensors; the env check passed without TE and with any
transformers; the sync check never said which transport it used nor compared in the engine's dtype.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check  # noqa: E402
import gpu_check_lib as lib  # noqa: E402
import gpu_check_multi as multi  # noqa: E402
import gpu_env  # noqa: E402

pytestmark = pytest.mark.unit


def test_per_check_timeouts_add_up_to_at_most_the_budget():
    for mode in ("gpu", "cpu"):
        total = sum(c.timeout_s[mode] for c in gpu_check.CHECKS)
        assert total <= gpu_check.BUDGET_S[mode], (mode, total)
    assert gpu_check.BUDGET_S["gpu"] <= 8 * 60


def _run_main(monkeypatch, tmp_path, lines, *args):
    check = gpu_check.Check(name="fake", run=lambda ctx: [lib.Line(*ln) for ln in lines],
                            timeout_s={"gpu": 1, "cpu": 1})
    monkeypatch.setattr(gpu_check, "CHECKS", [check])
    rc = gpu_check.main(["--mode", "gpu", "--out", str(tmp_path), *args])
    return rc, json.loads((tmp_path / "gpu_check_summary.json").read_text())


def test_a_skip_is_a_failure_unless_allowed_and_is_counted(monkeypatch, tmp_path, capsys):
    rc, summary = _run_main(monkeypatch, tmp_path, [("PASS", "fake", "ok"), ("SKIP", "test fake::t", "no TE")])
    assert rc == 1 and summary["failed"] == 1
    assert "--allow-skip fake" in summary["lines"][1]["detail"]
    rc, summary = _run_main(monkeypatch, tmp_path, [("PASS", "fake", "ok"), ("SKIP", "test fake::t", "no TE")],
                            "--allow-skip", "fake")
    assert rc == 0 and summary["counts"]["SKIP"] == 1 and summary["allowed_skips"] == ["test fake::t"]
    assert "1 SKIP allowed (test fake::t)" in capsys.readouterr().out


def test_not_applicable_is_neither_pass_nor_skip(monkeypatch, tmp_path):
    rc, summary = _run_main(monkeypatch, tmp_path, [(lib.NA, "fake", "not applicable on CPU: x")])
    assert rc == 0 and summary["counts"] == {"PASS": 0, "FAIL": 0, "SKIP": 0, lib.NA: 1, "INFO": 0}
    assert "1 not applicable" in summary["text"]


def test_a_failing_line_is_exit_code_one(monkeypatch, tmp_path):
    rc, summary = _run_main(monkeypatch, tmp_path, [("PASS", "fake", "a"), ("FAIL", "fake", "b")])
    assert rc == 1 and summary["failed"] == 1


def test_layouts_attempt_never_turns_unsupported_into_skip():
    sys.path.insert(0, str(REPO / "tests" / "gpu" / "mp_scripts"))
    import tp_ep_layouts

    def gloo_says_no(*_):
        raise RuntimeError("ProcessGroupGloo::allreduce_coalesced: unsupported device type cuda")

    row = tp_ep_layouts.attempt(gloo_says_no, "tp2", None)
    assert row["status"] == "FAIL" and "unsupported device type" in row["detail"]
    assert all(v["dp"] == 1 for v in tp_ep_layouts.EXPECTED_SIZES.values())
    assert tp_ep_layouts.EXPECTED_SIZES["tp2_ep2"]["ep"] == 2 and tp_ep_layouts.EXPECTED_SIZES["tp2"]["tp"] == 2


def _rows(**override):
    rows = []
    for name, sizes in multi.LAYOUT_SIZES.items():
        for part in (name, f"{name} critic"):
            rows.append({"layout": part, "status": "PASS", "detail": "d", **sizes, "backend": "gloo"})
    for r in rows:
        r.update(override.get(r["layout"], {}))
    return rows


def test_layout_rows_honour_exit_code_sizes_and_missing_parts():
    assert [ln.status for ln in multi.judge_layout_rows(_rows(), 0, "gloo")] == ["PASS"] * 4
    assert "FAIL" in [ln.status for ln in multi.judge_layout_rows(_rows(), 1, "gloo")]  # ranks crashed after
    bad = multi.judge_layout_rows(_rows(tp2={"dp": 2}), 0, "gloo")
    assert bad[0].status == "FAIL" and "expected" in bad[0].detail
    assert multi.judge_layout_rows(_rows(), 0, "nccl")[0].status == "FAIL"  # asked NCCL, ran gloo
    assert multi.judge_layout_rows(_rows(tp2={"status": "SKIP"}), 0, "gloo")[0].status == "FAIL"
    partial = multi.judge_layout_rows(_rows()[:1], 0, "gloo")
    assert [ln.status for ln in partial].count("FAIL") == 3


def test_two_gpus_use_nccl_one_gpu_gloo():
    assert multi.two_rank_backend(2) == "nccl" and multi.two_rank_backend(8) == "nccl"
    assert multi.two_rank_backend(1) == "gloo"


ENV = {"torch": "2.9.0", "cuda": "12.8", "cuda_ok": True, "gpu": "H200", "gpu_gib": 139.8, "gpus": 1,
       "bf16": True, "megatron_core": "0.19.2", "transformer_engine": None, "te_usable": False,
       "numba": None, "transformers": "5.23.0", "apex": None, "tilelang": None}


def test_env_requires_te_on_a_gpu_unless_told_and_the_pinned_transformers():
    line = lib.judge_env(ENV, gpu=True, require_te=True)
    assert line.status == "FAIL" and "--no-te" in line.detail
    line = lib.judge_env(ENV, gpu=True, require_te=False)
    assert line.status == "PASS" and "NOT checked" in line.detail
    assert lib.judge_env(ENV | {"te_usable": True, "transformer_engine": "2.20.2"}, gpu=True,
                         require_te=True).status == "PASS"
    line = lib.judge_env(ENV | {"transformers": "4.57.1"}, gpu=True, require_te=False)
    assert line.status == "FAIL" and "5.23.0" in line.detail and "4.57.1" in line.detail


def test_transformers_pin_is_enforced_on_the_node_and_te_is_required_unless_no_te():
    text = (REPO / "scripts" / "gpu_requirements.txt").read_text()
    reqs = gpu_env.parse_requirements(text)
    assert ("transformers", "5.23.0", False) in reqs  # strict: no '# keep' escape
    assert ("transformers", md.version("transformers"), False) in reqs  # what requirements.txt tests
    names = {n for n, _, _ in reqs}
    assert {"transformer-engine", "transformer-engine-torch"} <= names and "tilelang" not in names
    no_te = {n for n, _, _ in gpu_env.parse_requirements(text, drop_tags={"optional", "te"})}
    assert not {"transformer-engine", "transformer-engine-torch"} & no_te and "transformers" in no_te
    assert gpu_env.missing([("transformers", "4.57.1", False)], sys.path) == ["transformers==4.57.1"]


def test_gpu_wheels_dry_run_lists_te_and_dsa_kernels_for_cp312_manylinux(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_wheels.sh"), str(tmp_path), "--dry-run"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    wheels, sources = proc.stdout.split("sources")
    for pin in ("transformer-engine==", "transformer-engine-cu12==", "tilelang==", "nvidia-cudnn-frontend==",
                "transformers==5.23.0"):
        assert pin in wheels, pin
    assert "transformer-engine-torch==" in sources  # no binary wheel: built on the node
    assert "--python-version 3.12 --abi cp312" in proc.stdout and "manylinux_2_28_x86_64" in proc.stdout
    assert not list(tmp_path.glob("*.whl"))
    lean = subprocess.run(["bash", str(REPO / "scripts" / "gpu_wheels.sh"), str(tmp_path), "--dry-run", "--no-te",
                           "--no-optional"], capture_output=True, text=True, timeout=60)
    assert "transformer-engine" not in lean.stdout and "tilelang" not in lean.stdout


SYNC = {"backend": "gloo", "devices": ["cuda:0", "cuda:0"], "tensors": 4, "sent_dtype": "bfloat16",
        "engine_dtype": "float32", "equal": 4, "as_sent_differ": 4}


def test_sync_verdict_states_the_transport_and_whether_nccl_ran():
    one_gpu = multi.judge_sync(SYNC, backend="gloo", gpu=True)
    assert one_gpu.status == "PASS" and "NCCL NOT exercised (one GPU" in one_gpu.detail
    two = multi.judge_sync(SYNC | {"backend": "nccl", "devices": ["cuda:0", "cuda:1"]}, backend="nccl", gpu=True)
    assert two.status == "PASS" and "NCCL exercised" in two.detail
    assert multi.judge_sync(SYNC, backend="nccl", gpu=True).status == "FAIL"  # two GPUs must use NCCL
    assert multi.judge_sync(SYNC | {"equal": 3}, backend="gloo", gpu=True).status == "FAIL"
    assert multi.judge_sync(SYNC | {"devices": ["cpu", "cpu"]}, backend="gloo", gpu=True).status == "FAIL"


def test_timeout_scale_multiplies_each_checks_and_each_commands_limit(tmp_path):
    seen = []
    check = gpu_check.Check(name="probe", run=lambda ctx: seen.append(ctx.timeout_s) or [lib.Line("PASS", "probe", "")],
                            timeout_s={"gpu": 30, "cpu": 120})
    ctx = lib.Context(mode="gpu", out=tmp_path, deadline=time.monotonic() + 1e4, timeout_scale=4.0)
    gpu_check.run_check(check, ctx)
    assert seen == [120.0]
    sleep = [sys.executable, "-c", "import time; time.sleep(1.5)"]
    assert ctx.run("scaled", sleep, limit=0.5).returncode == 0  # 0.5 s x 4 = 2 s
    with pytest.raises(lib.CheckTimeout):  # unscaled, the same command is cut at 1 s
        lib.Context(mode="gpu", out=tmp_path, deadline=time.monotonic() + 1e4).run("plain", sleep, limit=0.5)


def test_sao_run_names_the_engine_dtype_for_a_bf16_trainer():
    ctx = lib.Context(mode="gpu", out=pathlib.Path("."), deadline=0.0)
    sets, notes = lib.run_overrides(ctx)
    assert "model.params_dtype=bf16" in sets
    assert any("engine float32: checksums compared in float32" in n for n in notes)


def test_sao_run_sets_and_reports_the_transport_by_its_section_key(tmp_path):
    """The run asks for the distributed sync with this checkout's key, which the loader accepts, and reads
    the transport back from the resolved config's rollout.weight_sync section."""
    from sao_megatron.config import load_config, write_resolved

    sets, _ = lib.run_overrides(lib.Context(mode="cpu", out=tmp_path, deadline=0.0))
    assert "rollout.weight_sync.transport=distributed" in sets
    cfg = load_config(REPO / "configs" / "experiments" / "tiny_cpu.yaml", sets)
    write_resolved(cfg, tmp_path)
    assert "; weight_sync=distributed (" in lib.transport("", tmp_path)


@pytest.mark.component
def test_weight_sync_transport_compares_bf16_sent_in_the_engines_float32(tmp_path):
    """The real update-group transport on CPU: bf16 sent, float32 held, equal in float32 only."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(REPO / "tests" / "gpu" / "mp_scripts" / "weight_sync_transport.py"), str(out),
                           "--backend", "gloo"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["equal"] == res["tensors"] == 4 and res["as_sent_differ"] == 4
    assert multi.judge_sync(res, backend="gloo", gpu=False).status == "PASS"


def test_dsa_topk_fp8_emulation_is_close_to_megatrons_scores_and_agreement_is_exact_on_itself():
    """The dsa-topk check's plumbing on CPU at a short length: FP8 scores track megatron's fp32
    ``_compute_index_scores`` to e4m3 precision, a selection agrees with itself exactly, and FP8
    flips some near-tied keys (agreement below 1 but far above chance)."""
    import torch

    sys.path.insert(0, str(REPO / "tests" / "gpu" / "mp_scripts"))
    import dsa_topk_agreement as dt
    from megatron.core.transformer.experimental_attention_variant.dsa import _compute_index_scores

    g = torch.Generator().manual_seed(1)
    s, topk = 384, 64
    q, k = torch.randn(s, 1, 4, 128, generator=g), torch.randn(s, 1, 128, generator=g)
    w = torch.randn(s, 1, 4, generator=g)
    ref, fp8 = _compute_index_scores(q, w, k), dt.fp8_scores(q, w, k)
    assert float((fp8 - ref).norm() / ref.norm()) < 0.1  # e4m3: 3 mantissa bits, ~6 % per element at most
    ref_k, fp8_k = dt.causal_topk(ref, topk), dt.causal_topk(fp8, topk)
    assert dt.agreement(ref_k, ref_k, topk, s)[0] == 1.0
    mean, worst, n = dt.agreement(ref_k, fp8_k, topk, s)
    assert n == s - topk and 0.7 < mean < 1.0 and worst <= mean


def test_gpu_mode_without_a_gpu_fails_with_exit_code_one(tmp_path):
    """End to end through the real env probe: GPU mode on this CPU box is a FAIL line and rc 1. The
    env probe's 30 s (sized for a GPU node) is scaled: beside a CPU hog its imports alone took longer."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--mode", "gpu", "--only", "env",
                           "--timeout-scale", "8", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = json.loads((tmp_path / "gpu_check_summary.json").read_text())["lines"][0]
    assert line["status"] == "FAIL" and "no CUDA device" in line["detail"]


class _Recording(lib.Context):
    """A GPU-mode context that records the commands a check starts instead of running them (rc 1)."""

    def run(self, name, cmd, *, limit=None, env=None):
        self.info.setdefault("commands", []).append((name, cmd, env))
        return subprocess.CompletedProcess(cmd, 1, "not run", "")


def test_no_te_does_not_run_the_te_tests_and_the_summary_names_them(tmp_path):
    """Issue 37: with --no-te the TE test ran, skipped, and the skip became a FAIL."""
    ctx = _Recording(mode="gpu", out=tmp_path, deadline=time.monotonic() + 60, require_te=False)
    lib.check_gpu_tests(ctx)
    ((_, cmd, _),) = ctx.info["commands"]
    collect = [a for a in cmd if not a.startswith("--junitxml")] + ["--collect-only", "-m", "gpu or not gpu"]
    proc = subprocess.run(collect, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert "test_gpu_check_policy.py" in proc.stdout, proc.stdout[-2000:]  # the collection itself worked
    assert "test_te_spec" not in proc.stdout, "--no-te still runs the TE tests"
    required = _Recording(mode="gpu", out=tmp_path, deadline=time.monotonic() + 60, require_te=True)
    lib.check_gpu_tests(required)
    assert not any("test_te_spec" in a for a in required.info["commands"][0][1])  # TE required: it runs
    text = gpu_check.summarise([], mode="gpu", seconds=1, budget=480, allow=set(), require_te=False)["text"]
    assert "Transformer Engine NOT checked (--no-te: tests/gpu/test_te_spec.py not run)" in text


def test_tp2_ep2_is_not_applicable_below_two_gpus_and_uses_nccl_with_two(tmp_path):
    """Issue 37: on one GPU the layouts ran over gloo with CUDA tensors and failed in Megatron's
    coalesced collectives; now a distinct N/A with the reason, named in the summary, not a SKIP."""
    one = _Recording(mode="gpu", out=tmp_path, deadline=time.monotonic() + 60, info={"gpus": 1})
    lines = multi.check_tp_ep_layouts(one)
    assert [ln.status for ln in lines] == [lib.NA] and "commands" not in one.info, [ln.text() for ln in lines]
    assert lines[0].detail.startswith("not applicable below 2 GPUs (1 visible): ")
    for collective in ("allreduce_coalesced", "reduce_scatter_tensor_coalesced", "all_gather", "NCCL"):
        assert collective in lines[0].detail
    summary = gpu_check.summarise([lib.Line("PASS", "env", ""), *lines], mode="gpu", seconds=1, budget=480,
                                  allow=set(), require_te=True)
    assert summary["failed"] == 0 and "1 not applicable here (tp2-ep2)" in summary["text"]
    two = _Recording(mode="gpu", out=tmp_path, deadline=time.monotonic() + 60, info={"gpus": 2})
    assert multi.check_tp_ep_layouts(two)[0].status == "FAIL"  # the recorded reference "failed"
    assert "torch.distributed.run" in two.info["commands"][0][1]


def test_a_checks_timeout_covers_all_its_commands_together(tmp_path):
    """bench-logprobs took 19 s against its 14 s timeout on the first H200 run: each command got the
    check's whole limit. Two 1.2 s commands in a check of 2 s: the second is cut."""
    sleep = [sys.executable, "-c", "import time; time.sleep(1.2)"]
    check = gpu_check.Check(name="two", run=lambda ctx: [ctx.run("a", sleep), ctx.run("b", sleep)] and [],
                            timeout_s={"gpu": 2, "cpu": 2})
    ctx = lib.Context(mode="gpu", out=tmp_path, deadline=time.monotonic() + 1e4)
    (line,) = gpu_check.run_check(check, ctx)
    assert line.status == "FAIL" and "timed out" in line.detail, line.text()


TRAIN_STEP = {"shape": "1b", "microbatches": 8, "seq_len": 2048, "device_name": "NVIDIA H200",
              "hf_actor": {"step_s": 3.0}}
ROLE = {"params_total": 1.1e9, "params_active": 4.0e8, "step_s": 1.0, "tokens_per_s": 16384.0, "tflops": 300.0,
        "mfu": 0.3, "peak_mem_gib": 40.0, "share": {"forward": 0.3, "backward": 0.5, "grad_reduce": 0.05,
                                                     "optimizer": 0.1, "other": 0.05}}


def test_train_step_lines_are_info_with_mfu_against_the_target_and_the_hf_ratio():
    lines = lib.train_step_lines(TRAIN_STEP | {"actor": ROLE, "critic": ROLE | {"mfu": 0.1}})
    assert [(ln.status, ln.name) for ln in lines] == [("INFO", "bench train-step actor"),
                                                      ("INFO", "bench train-step critic")]
    assert "MFU 30.0 % (target 25 %: met)" in lines[0].detail and "3.00x HF transformers" in lines[0].detail
    assert "target 25 %: NOT met" in lines[1].detail and "HF" not in lines[1].detail
    cpu = lib.train_step_lines(TRAIN_STEP | {"actor": ROLE | {"mfu": None, "peak_mem_gib": None},
                                             "critic": ROLE})
    assert "MFU n/a" in cpu[0].detail and "peak memory n/a on CPU" in cpu[0].detail
