"""DEVELOPMENT STAND-IN for `sao-megatron train` / `serve-local` until the real ones land.

Mimics the contracts the launch layout relies on: torchrun env rendezvous, engines answering
/health, checkpoint on SIGUSR1/SIGTERM then exit, `--resume auto`, audit.jsonl exactly-once.
"""
import http.server, json, os, pathlib, signal, sys, time, urllib.request


def serve(argv):
    a = dict(zip(argv[::2], argv[1::2]))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        do_POST = do_GET
        def log_message(self, *a): pass
    srv = http.server.ThreadingHTTPServer((a["--host"], int(a["--port"])), H)
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(0))
    print(f"standin engine on {a['--host']}:{a['--port']} model {a['--model-dir']}", flush=True)
    srv.serve_forever()


def train(argv):
    import torch, torch.distributed as dist
    run_dir = pathlib.Path(argv[argv.index("--run-dir") + 1])
    sets = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--set")
    num_steps, B = int(sets.get("run.num_steps", 8)), 4
    stop = {"flag": 0}
    def h(s, f):
        print(f"rank {os.environ['RANK']} pid {os.getpid()} got {signal.Signals(s).name}", flush=True)
        stop["flag"] = 1
    signal.signal(signal.SIGUSR1, h); signal.signal(signal.SIGTERM, h)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    urls = json.loads(sets.get("rollout.engine_urls", "[]"))
    if rank == 0:
        for u in urls + ([sets["rollout.router_url"]] if "rollout.router_url" in sets else []):
            urllib.request.urlopen(u + "/health", timeout=5).read()
        print(f"engines ok: {urls} router={sets.get('rollout.router_url')}", flush=True)
    ck = run_dir / "checkpoints"; audit = run_dir / "audit.jsonl"
    step = 0
    if (ck / "latest").exists():
        state = json.loads((ck / (ck / "latest").read_text().strip() / "state.json").read_text())
        step = state["step"]
        if rank == 0:
            lines = (audit.read_text().splitlines() if audit.exists() else [])[: state["num_audit"]]
            audit.write_text("".join(l + "\n" for l in lines))
            print(f"resumed at step {step}", flush=True)
    def save(step):
        if rank == 0:
            time.sleep(2)
            d = ck / f"step_{step:08d}"; d.mkdir(parents=True, exist_ok=True)
            n = len(audit.read_text().splitlines()) if audit.exists() else 0
            (d / "state.json").write_text(json.dumps({"step": step, "num_audit": n}))
            (ck / "latest").write_text(d.name + "\n")
        dist.barrier()
    while step < num_steps:
        time.sleep(1.0)
        flag = torch.tensor([stop["flag"]]); dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            save(step); print(f"rank {rank}: checkpointed at step {step} on signal, exiting", flush=True)
            dist.destroy_process_group(); return 0
        step += 1
        if rank == 0:
            with audit.open("a") as f:
                for i in range((step - 1) * B, step * B):
                    f.write(json.dumps({"index": i, "step": step}) + "\n")
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, "restart": os.environ.get("SLURM_RESTART_COUNT", "0")}) + "\n")
        if step % 3 == 0 or step == num_steps:
            save(step)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    verb, rest = sys.argv[1], sys.argv[2:]
    sys.exit(serve(rest) if verb == "serve-local" else train(rest))
