"""The checks of scripts/gpu_check.py that start two ranks or exercise DSA (see there).

tp2-ep2 (TP2 and TP2xEP2 against TP1), weight-sync (the trainer -> engine transport with checksums
in the engine's dtype), dsa-topk (FP8 vs Megatron index scoring) and dsa-bf16 (an MLA + DSA model's
bf16 forward and backward against fp32). The work lives in
tests/gpu/mp_scripts/; this module chooses the backend, runs them time-bounded and judges what they
report. Standard library only (it runs in the orchestrating process).
"""

from __future__ import annotations

import json

from gpu_check_lib import EMBEDDED_ENGINE_DTYPE, Context, Line, not_applicable, not_applicable_below, python, tail

# ---------------------------------------------------------------- two ranks: TP2 and EP2

LAYOUT_SIZES = {"tp2": {"tp": 2, "ep": 1, "dp": 1}, "tp2_ep2": {"tp": 2, "ep": 2, "dp": 1}}
"""What each layout of tests/gpu/mp_scripts/tp_ep_layouts.py must report having run with."""


def two_rank_backend(gpus: int) -> str:
    """NCCL with a GPU per rank; gloo with CUDA tensors when both ranks share the one GPU (NCCL
    cannot put two ranks on one device). The weight-sync transport's broadcasts work over either;
    Megatron's TP/EP layouts need NCCL (``ONE_GPU_LAYOUTS``)."""
    return "nccl" if gpus >= 2 else "gloo"


ONE_GPU_LAYOUTS = (
    "Megatron's TP/EP step needs collectives gloo refuses for CUDA tensors, at DP 1 too: "
    "allreduce_coalesced (DDP's gradient sync, finalize_model_grads), reduce_scatter_tensor_coalesced "
    "and allgather_into_tensor_coalesced (distributed optimizer), and the expert-TP dispatcher's uneven "
    "all_gather; NCCL cannot put two ranks on one GPU. Staging through host memory would test a path "
    "production never takes. Run on a node with 2 GPUs (NCCL); on CPU the same layouts run over gloo "
    "in tests/gpu/test_tp_ep_layouts.py")
"""Why tp2-ep2 is not applicable on one GPU (found on the first H200 run, issue 37)."""


def torchrun(nproc: int, script: str, *args: str) -> list[str]:
    return [*python(), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]


def judge_layout_rows(rows: list[dict], rc: int, backend: str) -> list[Line]:
    """One line per part; FAIL for a non-zero exit, a missing part, or sizes/backend other than asked."""
    lines, seen = [], set()
    for r in rows:
        base = r["layout"].removesuffix(" critic")
        want = dict(LAYOUT_SIZES.get(base, {}), backend=backend)
        got = {k: r.get(k) for k in want}
        status = r["status"] if r["status"] in ("PASS", "FAIL") else "FAIL"
        detail = r.get("detail", "")
        if got != want:
            status, detail = "FAIL", f"ran with {got}, expected {want}; " + detail
        seen.add(r["layout"])
        lines.append(Line(status, f"tp2-ep2 {r['layout']}", detail))
    for part in [*LAYOUT_SIZES, *(f"{n} critic" for n in LAYOUT_SIZES)]:
        if part not in seen:
            lines.append(Line("FAIL", f"tp2-ep2 {part}", f"did not run (rc={rc})"))
    if rc and all(ln.status == "PASS" for ln in lines):
        lines.append(Line("FAIL", "tp2-ep2", f"the ranks exited with rc={rc}"))
    return lines


def check_tp_ep_layouts(ctx: Context) -> list[Line]:
    if not ctx.gpu:
        return not_applicable("tp2-ep2", "TP2 and TP2xEP2 on CUDA (the same layouts run on the CPU in "
                              "tests/component/test_megatron_parallel.py and tests/gpu/test_tp_ep_layouts.py)")
    gpus = int(ctx.info.get("gpus") or 1)
    if gpus < 2:
        return not_applicable_below("tp2-ep2", 2, gpus, ONE_GPU_LAYOUTS)
    workdir = ctx.workdir("tp2-ep2")
    script = "tests/gpu/mp_scripts/tp_ep_layouts.py"
    ref = ctx.run("tp2-ep2-ref", torchrun(1, script, str(workdir / "ref_rows.json"), str(workdir), "--ref-only"))
    if ref.returncode or not (workdir / "ref.json").is_file():
        return [Line("FAIL", "tp2-ep2", f"TP1 reference failed rc={ref.returncode}: {tail(ref.stdout)}")]
    backend = two_rank_backend(gpus)
    out = workdir / "results.json"
    proc = ctx.run("tp2-ep2", torchrun(2, script, str(out), str(workdir), "--backend", backend),
                   env={"OMP_NUM_THREADS": "2"})
    rows = json.loads(out.read_text()) if out.is_file() else []
    return judge_layout_rows(rows, proc.returncode, backend)


# ---------------------------------------------------------------- weight-sync transport

def judge_sync(res: dict, *, backend: str, gpu: bool) -> Line:
    """PASS when every tensor's checksum agrees in the engine's dtype over the asked backend."""
    devices = " -> ".join(res["devices"])
    ok = (res["backend"] == backend and res["equal"] == res["tensors"]
          and all(d.startswith("cuda") for d in res["devices"]) == gpu)
    nccl = "NCCL exercised" if res["backend"] == "nccl" else "NCCL NOT exercised (" + (
        "one GPU: two ranks cannot share a device under NCCL" if gpu else "no GPU") + ")"
    return Line("PASS" if ok else "FAIL", "weight-sync",
                f"transport {res['backend']} (asked {backend}), {devices}: {res['tensors']} {res['sent_dtype']} "
                f"tensors, engine holds {res['engine_dtype']}: {res['equal']}/{res['tensors']} checksums equal "
                f"in {res['engine_dtype']} (as-sent {res['sent_dtype']} hashes differ for {res['as_sent_differ']}); "
                + nccl)


def check_weight_sync(ctx: Context) -> list[Line]:
    gpus = int(ctx.info.get("gpus") or 0) if ctx.gpu else 0
    backend = two_rank_backend(gpus) if ctx.gpu else "gloo"
    out = ctx.workdir("weight-sync") / "result.json"
    proc = ctx.run("weight-sync", torchrun(2, "tests/gpu/mp_scripts/weight_sync_transport.py", str(out),
                                           "--backend", backend, "--engine-dtype", EMBEDDED_ENGINE_DTYPE,
                                           "--sent-dtype", "bfloat16"))
    if proc.returncode or not out.is_file():
        return [Line("FAIL", "weight-sync", f"rc={proc.returncode}: {tail(proc.stdout)}")]
    return [judge_sync(json.loads(out.read_text()), backend=backend, gpu=ctx.gpu)]


# ---------------------------------------------------------------- DSA top-k: engine FP8 vs Megatron

TOPK_AGREEMENT_FLOOR = 0.5
"""Below this the FP8 emulation or the scoring is broken, not merely rounded; the numbers are the point."""


def check_dsa_topk(ctx: Context) -> list[Line]:
    if not ctx.gpu:
        return not_applicable("dsa-topk", "FP8 (float8_e4m3fn) index scoring at 2k and 8k tokens is measured on CUDA")
    out = ctx.workdir("dsa-topk") / "result.json"
    proc = ctx.run("dsa-topk", [*python(), "tests/gpu/mp_scripts/dsa_topk_agreement.py", str(out),
                                "--lengths", "2048,8192", "--device", "cuda"])
    if proc.returncode or not out.is_file():
        return [Line("FAIL", "dsa-topk", f"rc={proc.returncode}: {tail(proc.stdout)}")]
    lines = []
    for r in json.loads(out.read_text())["rows"]:
        ok = r["agreement"] >= TOPK_AGREEMENT_FLOOR
        lines.append(Line("PASS" if ok else "FAIL", f"dsa-topk {r['length']}",
                          f"FP8 vs Megatron fp32 indexer, top-{r['topk']} of up to {r['length']} keys: mean "
                          f"agreement {r['agreement']:.4f}, worst query {r['min_row']:.4f} over {r['queries']} "
                          f"queries (floor {TOPK_AGREEMENT_FLOOR})"))
    return lines


# ---------------------------------------------------------------- DSA in bf16: forward + backward

DSA_BF16_TOL = {"logprob_max_diff": 0.1, "logprob_mean_diff": 0.01, "grad_rel_err": 0.1}
"""bf16 vs fp32 on the same weights (tests/gpu/mp_scripts/dsa_bf16.py). bf16 keeps 8 significant bits:
unit roundoff u = 2^-8 ≈ 0.004 per rounding. Along any path of the tiny GLM-5 (2 layers: embedding,
norms, q/kv LoRA down and up, indexer, scores, softmax, output projection, router, experts, LM head)
about a dozen roundings occur in forward and as many again in backward; at worst their relative
errors add: ~12u ≈ 0.05 on the logits, ~25u ≈ 0.1 on the gradients. Log-probs are O(1) logits apart
and move by at most 2·max|Δlogit|, so 0.1 on the worst token; the mean over tokens sees far less
(errors of both signs), 0.01. Measured on CPU (bf16 CPU kernels): 0.033, 0.0017, 0.049. A wrong
bf16 path (a lost scale, a mis-cast softmax, top-k on garbage scores) gives O(1) errors."""
DSA_WORST_COS = 0.95
"""Every parameter's bf16 gradient points the way of its fp32 one (measured on CPU: 0.991 at worst)."""


def judge_dsa_bf16(res: dict, *, device: str) -> Line:
    """PASS when bf16 ran on ``device`` with finite gradients, within DSA_BF16_TOL of fp32."""
    within = all(res[k] <= tol for k, tol in DSA_BF16_TOL.items()) and res["worst_grad_cos"] >= DSA_WORST_COS
    on = res["device"].startswith(device) and "torch.bfloat16" in res["params"]
    ok = res["finite"] and within and on and res["num_grads"] > 0
    return Line("PASS" if ok else "FAIL", "dsa-bf16",
                f"tiny GLM-5 (MLA + DSA top-8 of {res['seq_len']} tokens) bf16 vs fp32 forward + backward on "
                f"{res['device']} ({', '.join(res['params'])}): loss {res['loss_bf16']:.4f} vs {res['loss_fp32']:.4f}, "
                f"max |Δlogp| {res['logprob_max_diff']:.1e} (tol {DSA_BF16_TOL['logprob_max_diff']:g}), mean "
                f"{res['logprob_mean_diff']:.1e} (tol {DSA_BF16_TOL['logprob_mean_diff']:g}); {res['num_grads']} "
                f"grads {'finite' if res['finite'] else 'NOT finite'}, relative error "
                f"{res['grad_rel_err']:.1e} (tol {DSA_BF16_TOL['grad_rel_err']:g}), worst cosine "
                f"{res['worst_grad_cos']:.4f} (floor {DSA_WORST_COS})")


def check_dsa_bf16(ctx: Context) -> list[Line]:
    """On the GPU in GPU mode, on the CPU with --cpu (the same script: its plumbing and bound)."""
    device = "cuda" if ctx.gpu else "cpu"
    out = ctx.workdir("dsa-bf16") / "result.json"
    proc = ctx.run("dsa-bf16", [*python(), "tests/gpu/mp_scripts/dsa_bf16.py", str(out), "--device", device])
    if proc.returncode or not out.is_file():
        return [Line("FAIL", "dsa-bf16", f"rc={proc.returncode}: {tail(proc.stdout)}")]
    return [judge_dsa_bf16(json.loads(out.read_text()), device=device)]
