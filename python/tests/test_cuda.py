"""moekit from torch on CUDA: tensors through DLPack without copies on torch's current stream, every CUDA
backend in f32 / bf16 / f16 on each device against an f64 reference, torch.no_grad(), torch.cuda.graph capture
of the capturable backends, errors as Python exceptions, and the transformers integration on the GPU.
Skipped without a CUDA device or without a CUDA build of moekit."""
import warnings

import pytest

moekit = pytest.importorskip("moekit")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and moekit.cuda_available()),
                                reason="needs a CUDA device and a CUDA build of moekit")

E, H, I, K = 16, 256, 128, 4
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}  # relative L2 vs f64


def cuda_backends():
    return [b["name"] for b in moekit.backends() if b["available_cuda"]]


def capturable_backends():
    return [b["name"] for b in moekit.backends() if b["available_cuda"] and b["graph_capturable"]]


def devices():
    if not torch.cuda.is_available():
        return [0]
    n = torch.cuda.device_count()
    return [0] if n == 1 else [0, n - 1]


def weights(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    down = torch.randn(E, H, I, generator=g) / I ** 0.5
    return gate_up.to(device, dtype), down.to(device, dtype)


def routing(T, device, dtype=torch.float32, seed=1, index_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(index_dtype)
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x.to(device, dtype), idx.to(device), w.to(device)


def reference(x, idx, w, gate_up, down):
    """sum_k w[t, k] * down[e] (silu(gate) * up), gate/up the halves of gate_up[e] x, in f64."""
    x, gate_up, down = x.double(), gate_up.double(), down.double()
    h = torch.einsum("tkoh,th->tko", gate_up[idx], x)
    a = torch.nn.functional.silu(h[..., :I]) * h[..., I:]
    y = torch.einsum("tkhi,tki->tkh", down[idx], a)
    return (y * w.double()[..., None]).sum(1)


def rel_err(got, ref):
    return float((got.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("backend", cuda_backends())
def test_backend_on_device_and_dtype(backend, dtype, device):
    dev = torch.device("cuda", device)
    gate_up, down = weights(dev, dtype)
    experts = moekit.Experts(gate_up, down, implementation=backend)
    ok, why = experts.supports(backend, {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[dtype])
    if not ok:
        pytest.skip(why)
    for T in (1, 37):
        x, idx, w = routing(T, dev, dtype, seed=T)
        out = torch.full_like(x, float("nan"))
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            got = experts(x, idx, w, out=out)
        s.synchronize()
        assert got is out and out.device == dev and out.dtype == dtype
        err = rel_err(out, reference(x, idx, w, gate_up, down))
        assert err < TOLERANCE[dtype], f"{backend} {dtype} cuda:{device} T={T}: rel err {err}"


def test_runs_on_the_current_stream():
    dev = torch.device("cuda", 0)
    gate_up, down = weights(dev, torch.bfloat16)
    experts = moekit.Experts(gate_up, down, implementation="grouped_mm")
    x_old, idx, w = routing(64, dev, torch.bfloat16, seed=2)
    x_new = routing(64, dev, torch.bfloat16, seed=3)[0]
    x = x_old.clone()
    torch.cuda.synchronize()
    s = torch.cuda.Stream(dev)
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # about 25 ms: work on another stream would read x before the copy
        x.copy_(x_new)
        out = experts(x, idx, w)
    s.synchronize()
    assert rel_err(out, reference(x_new, idx, w, gate_up, down)) < TOLERANCE[torch.bfloat16]


def test_weights_are_used_in_place_and_no_grad():
    dev = torch.device("cuda", 0)
    gate_up, down = weights(dev, torch.float32)
    down = torch.nn.Parameter(down)  # requires grad: accepted, inference only
    experts = moekit.Experts(gate_up, down, implementation="grouped_mm")
    x, idx, w = routing(20, dev, seed=4)
    before = experts(x, idx, w)
    with torch.no_grad():
        down.mul_(2.0)  # the module reads the weights in place: no copy was taken
        after = experts(x, idx, w)
    assert not after.requires_grad
    torch.testing.assert_close(after, 2 * before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", capturable_backends())
def test_torch_cuda_graph_capture(backend):
    dev = torch.device("cuda", 0)
    gate_up, down = weights(dev, torch.bfloat16, seed=5)
    experts = moekit.Experts(gate_up, down, implementation=backend)
    if not experts.supports(backend, "bf16")[0]:
        pytest.skip(experts.supports(backend, "bf16")[1])
    graphs = []
    # Two graphs on torch's capture stream, the second needing a larger workspace: it grows during capture
    # and the first graph keeps its own.
    for T in (4, 300):
        sx, sidx, sw = routing(T, dev, torch.bfloat16, seed=10 + T)
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):  # warm-up on a side stream, as torch's recipe has it
            experts(sx, sidx, sw)
        torch.cuda.current_stream(dev).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            sout = experts(sx, sidx, sw)
        graphs.append((T, g, sx, sidx, sw, sout))
    for rep in range(2):
        for T, g, sx, sidx, sw, sout in graphs:
            x, idx, w = routing(T, dev, torch.bfloat16, seed=100 * rep + T)  # fresh inputs, copied in
            sx.copy_(x)
            sidx.copy_(idx)
            sw.copy_(w)
            sout.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            err = rel_err(sout, reference(x, idx, w, gate_up, down))
            assert err < TOLERANCE[torch.bfloat16], f"{backend} replay T={T}: rel err {err}"
            direct = experts(x, idx, w)
            torch.cuda.synchronize()
            assert rel_err(sout, direct.double()) < 1e-3


def test_eager_is_refused_inside_capture():
    dev = torch.device("cuda", 0)
    gate_up, down = weights(dev, torch.bfloat16)
    experts = moekit.Experts(gate_up, down, implementation="eager")
    x, idx, w = routing(8, dev, torch.bfloat16)
    s = torch.cuda.Stream(dev)
    with torch.cuda.stream(s):
        experts(x, idx, w)
    torch.cuda.current_stream(dev).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the empty graph
        with pytest.raises(NotImplementedError, match="eager"):
            with torch.cuda.graph(g):
                experts(x, idx, w)
    torch.cuda.synchronize()


def test_errors():
    dev = torch.device("cuda", 0)
    gate_up, down = weights(dev, torch.float32)
    experts = moekit.Experts(gate_up, down, implementation="grouped_mm")
    x, idx, w = routing(6, dev)
    with pytest.raises(ValueError, match="experts live on cuda:0"):
        experts(x.cpu(), idx.cpu(), w.cpu())
    with pytest.raises(ValueError, match="hidden size"):
        experts(x[:, :8].contiguous(), idx, w)
    with pytest.raises(ValueError, match="contiguous"):
        experts(x, idx.t().contiguous().t(), w)
    bad = idx.clone()
    bad[3, 1] = E + 1
    experts.check_errors()  # clean so far
    experts(x, bad, w)
    with pytest.raises(ValueError, match=r"top_k_index\[3, 1\] = 17 is out of range"):
        experts.check_errors()
    experts.check_errors()  # the record was cleared
    if "deepgemm" in cuda_backends():
        with pytest.raises(NotImplementedError, match="deepgemm"):
            experts(x, idx, w, implementation="deepgemm")  # f32 experts


# ---- transformers on the GPU ----

transformers = pytest.importorskip("transformers")
mt = pytest.importorskip("moekit.integrations.transformers")

from conftest import FIXTURES  # noqa: E402


def load(name, implementation, dtype=torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype=dtype,
                                                              experts_implementation=implementation)
    return model.to("cuda").eval()


def prompt(model):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (2, 9), generator=g).cuda()


def test_register_asks_the_registry():
    names = mt.register()
    runs = [b["name"] for b in moekit.backends()
            if (b["available_cpu"] or b["available_cuda"]) and not b["load_time_only"]]
    assert names == ["moekit_" + n for n in runs]
    assert {"moekit_eager", "moekit_batched_mm", "moekit_grouped_mm"} <= set(names)
    if torch.cuda.get_device_capability(0)[0] == 9:
        assert "moekit_deepgemm" in names
    assert "moekit_deepgemm_megamoe" not in names


def test_generate_on_the_gpu_matches_transformers_and_switches_for_decode():
    mt.register()
    ref = load("qwen3_moe", "grouped_mm")
    ids = prompt(ref)
    with torch.no_grad():
        ref_logits = ref(ids).logits
        ref_tokens = ref.generate(ids, max_new_tokens=8, do_sample=False)
    model = load("qwen3_moe", "moekit_grouped_mm")
    from transformers.integrations.moe import ExpertsInterface

    seen = []
    originals = {n: ExpertsInterface._global_mapping[n] for n in ("moekit_grouped_mm", "moekit_batched_mm")}

    def spy(fn):
        def forward(self, *args):
            seen.append(self.config._experts_implementation)
            return fn(self, *args)
        return forward

    for n, fn in originals.items():
        ExpertsInterface.register(n, spy(fn))
    try:
        with torch.no_grad():
            logits = model(ids).logits
            tokens = model.generate(ids, max_new_tokens=8, do_sample=False)
    finally:
        for n, fn in originals.items():
            ExpertsInterface.register(n, fn)
    err = (logits - ref_logits).abs().max().item()
    assert err <= 1e-4, f"max |logits - grouped_mm's| = {err}"
    assert torch.equal(tokens, ref_tokens)
    # Prefill ran moekit_grouped_mm, the decode steps moekit_batched_mm (SPEC section 4), then the map was restored.
    assert "moekit_grouped_mm" in seen and "moekit_batched_mm" in seen
    assert model.get_experts_implementation()[""] == "moekit_grouped_mm"


@pytest.mark.parametrize("impl", ["moekit_grouped_mm", "moekit_deepgemm"])
def test_bf16_model_and_experts_module_in_a_cuda_graph(impl):
    names = mt.register()
    if impl not in names:
        pytest.skip(f"{impl} does not run here")
    model = load("qwen3_moe", impl, torch.bfloat16)
    ref = load("qwen3_moe", "grouped_mm", torch.bfloat16)
    ids = prompt(model)
    with torch.no_grad():
        got, want = model(ids).logits.float(), ref(ids).logits.float()
    assert float((got - want).norm() / want.norm()) < 5e-2  # bf16: a routing choice may flip between the two
    # The Experts module alone, captured by torch.cuda.graph and replayed on new inputs.
    experts = model.model.layers[0].mlp.experts
    ref_experts = ref.model.layers[0].mlp.experts
    hidden = model.config.hidden_size
    n_exp, k = experts.num_experts, model.config.num_experts_per_tok

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(12, hidden, generator=g).to("cuda", torch.bfloat16)
        idx = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(12)]).cuda()
        w = torch.softmax(torch.randn(12, k, generator=g), -1).to("cuda", torch.bfloat16)
        return x, idx, w

    sx, sidx, sw = inputs(0)
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            experts(sx, sidx, sw)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            sout = experts(sx, sidx, sw)
        x, idx, w = inputs(1)
        sx.copy_(x)
        sidx.copy_(idx)
        sw.copy_(w)
        g.replay()
        want = ref_experts(x, idx, w)
        torch.cuda.synchronize()
    assert float((sout.float() - want.float()).norm() / want.float().norm()) < 2e-2
