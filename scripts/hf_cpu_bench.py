#!/usr/bin/env python3
"""Times transformers' own experts backends on the CPU, for the same shapes and token counts as `moekit bench`.

Runs the real transformers Experts modules (Qwen3MoeExperts, MixtralExperts, DeepseekV3Experts, ...) with random
bf16 weights and uniform random top-k routing on the CPU (torch's threads = OMP_NUM_THREADS), each of the given
experts implementations, and writes one JSON record per measurement:
  {"shape", "tokens", "impl", "median_us", "min_us", "iters"}  (or "skipped" / "error")
Each case: one warm-up call, then timed calls until --min-time seconds and --min-iters calls (at most --iters).

Usage: python3 scripts/hf_cpu_bench.py --json hf.json --shapes qwen3-30b-a3b --tokens 1,8,64,512,2048
                                        [--impls eager,batched_mm,grouped_mm] [--budget-s 60] [--peak]
                                        [--experts E (fewer routed experts of the same size, for a quick check)]
--peak also times torch's bf16 GEMM (oneDNN, AMX where the CPU has it) on a 4096^3 problem: "torch_bf16_gemm_tflops".
"""
import argparse, json, os, statistics, sys, time

import torch
from transformers import AutoConfig

# name: (model_type, experts class path, config kwargs)
SHAPES = {
    "qwen3-30b-a3b": ("qwen3_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts",
                      dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)),
    "mixtral-8x7b": ("mixtral", "transformers.models.mixtral.modeling_mixtral.MixtralExperts",
                     dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2)),
    "deepseek-v3": ("deepseek_v3", "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts",
                    dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8)),
}


def load_class(path):
    mod, name = path.rsplit(".", 1)
    m = __import__(mod, fromlist=[name])
    if hasattr(m, name):
        return getattr(m, name)
    for k in dir(m):
        if k.endswith("Experts"):
            return getattr(m, k)
    raise AttributeError(path)


def fill_tiled(t, block, shift=0):
    """Fills t with copies of block (rotated by `shift` so that tensors differ): one parallel copy."""
    flat = t.view(-1)
    n, b = flat.numel(), block.numel()
    block = torch.roll(block, shift * 4099)
    full = n // b
    if full:
        flat[: full * b].view(full, b).copy_(block.expand(full, b))
    if n - full * b:
        flat[full * b:].copy_(block[: n - full * b])


def time_us(fn, min_time, min_iters, iters):
    fn()  # warm-up
    ts = []
    start = time.perf_counter()
    while len(ts) < iters and (len(ts) < min_iters or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts), min(ts), len(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--shapes", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,8,64,512,2048")
    ap.add_argument("--impls", default="eager,batched_mm,grouped_mm")
    ap.add_argument("--min-time", type=float, default=0.3)
    ap.add_argument("--min-iters", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--max-gb", type=float, default=4.0, help="skip batched_mm where its per-pair weight copy exceeds this")
    ap.add_argument("--max-call-s", type=float, default=3.0, help="skip the larger T of an impl once a call took this long")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting cases after this many seconds")
    ap.add_argument("--experts", type=int, default=0,
                    help="routed experts instead of the shape's (same expert size; a small run of a large shape)")
    ap.add_argument("--peak", action="store_true", help="also time torch's bf16 GEMM (4096^3, best of 4)")
    a = ap.parse_args()
    torch.manual_seed(0)
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or os.cpu_count()
    torch.set_num_threads(threads)
    t_start = time.perf_counter()
    print(f"transformers CPU experts: torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    records = []
    meta = {"threads": threads, "torch": torch.__version__}
    if a.peak:
        n = 4096
        x, y = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
        _, best_us, _ = time_us(lambda: torch.mm(x, y), 0.0, 4, 4)
        meta["torch_bf16_gemm_tflops"] = 2.0 * n ** 3 / (best_us * 1e-6) / 1e12
        print(f"torch bf16 GEMM {n}^3: {meta['torch_bf16_gemm_tflops']:.2f} TFLOP/s", flush=True)
        del x, y

    def emit(rec):
        records.append(rec)
        print(json.dumps(rec), flush=True)
        json.dump(dict(meta, records=records), open(a.json, "w"), indent=1)

    for shape in a.shapes.split(","):
        mt, cls_path, kw = SHAPES[shape]
        if a.experts:
            kw = {k: (a.experts if k in ("num_experts", "num_local_experts", "n_routed_experts") else v)
                  for k, v in kw.items()}
        cfg = AutoConfig.for_model(mt, **kw)
        cfg._experts_implementation = "eager"
        t0 = time.perf_counter()
        # Parameters made uninitialised on the meta device first (no 22.5 GB of initialisation work for deepseek-v3's
        # experts), then allocated with torch.empty and filled by tiling one small random block: a parallel copy,
        # seconds where normal_ over the whole module took minutes. The values only need to be ordinary bf16 numbers.
        try:  # bf16 parameters from the start (to_empty then allocates 22.5 GB for deepseek-v3, not 45 in f32)
            torch.set_default_dtype(torch.bfloat16)
            with torch.device("meta"):
                ex = load_class(cls_path)(cfg)
        finally:
            torch.set_default_dtype(torch.float32)
        ex = ex.to_empty(device="cpu").to(torch.bfloat16)
        with torch.no_grad():
            block = torch.randn(1 << 20, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
            for i, p in enumerate(ex.parameters()):
                fill_tiled(p.data, block, shift=i)
        print(f"{shape}: experts module ready in {time.perf_counter() - t0:.1f} s "
              f"({sum(p.numel() * p.element_size() for p in ex.parameters()) / 1e9:.1f} GB, {next(ex.parameters()).dtype})", flush=True)
        H = cfg.hidden_size
        E = ex.num_experts
        K = cfg.num_experts_per_tok
        expert_bytes = sum(p.numel() * p.element_size() for p in ex.parameters()) / E
        slow = set()
        for T in [int(t) for t in a.tokens.split(",")]:
            x = torch.randn(T, H, dtype=torch.bfloat16)
            idx = torch.rand(T, E).argsort(dim=-1)[:, :K].contiguous()
            w = torch.softmax(torch.randn(T, K), -1).to(torch.bfloat16)
            for impl in a.impls.split(","):
                rec = {"shape": shape, "tokens": T, "impl": impl}
                if time.perf_counter() - t_start > a.budget_s:
                    rec["skipped"] = "time budget"; emit(rec); continue
                if impl in slow:
                    rec["skipped"] = f"a smaller T took over {a.max_call_s} s per call"; emit(rec); continue
                if impl == "batched_mm" and T * K * expert_bytes > a.max_gb * 1e9:
                    rec["skipped"] = "weight copy too large"; emit(rec); continue
                try:
                    cfg._experts_implementation = impl
                    with torch.no_grad():
                        med, mn, n = time_us(lambda: ex(x, idx, w), a.min_time, a.min_iters, a.iters)
                    rec.update(median_us=round(med, 1), min_us=round(mn, 1), iters=n)
                    if med > a.max_call_s * 1e6:
                        slow.add(impl)
                except Exception as e:  # noqa: BLE001 - recorded, the next case runs
                    rec["error"] = repr(e)[:300]
                emit(rec)
        del ex


if __name__ == "__main__":
    main()
