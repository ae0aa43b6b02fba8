"""moekit.Experts and experts_forward on torch tensors: every CPU backend against a plain torch loop, over
transformers' layouts (transposed, interleaved gate/up, biases, clamped SwiGLU, no gate), and errors."""
import pytest

moekit = pytest.importorskip("moekit")
torch = pytest.importorskip("torch")

E, H, I, T, K = 6, 24, 16, 9, 2


def cpu_backends():
    return [b["name"] for b in moekit.backends() if b["available_cpu"]]


def loop_forward(x, idx, w, gate_up, down, *, up=None, gate_up_bias=None, up_bias=None, down_bias=None,
                 transposed=False, concatenated=True, gate="act_mul", act=torch.nn.functional.silu,
                 alpha=1.702, limit=7.0):
    out = torch.zeros(x.shape, dtype=torch.float64)
    x = x.double()
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            first = gate_up if gate_up is not None else up
            fw = first[e].double()
            h = x[t] @ fw if transposed else fw @ x[t]
            b = gate_up_bias if gate_up is not None else up_bias
            if b is not None:
                h = h + b[e].double()
            if gate_up is None:
                a = act(h)
            else:
                g, u = (h[:I], h[I:]) if concatenated else (h[0::2], h[1::2])
                if gate == "act_mul":
                    a = act(g) * u
                else:
                    g = g.clamp(max=limit)
                    u = u.clamp(-limit, limit)
                    a = (u + 1) * g * torch.sigmoid(alpha * g)
            dw = down[e].double()
            y = a @ dw if transposed else dw @ a
            if down_bias is not None:
                y = y + down_bias[e].double()
            out[t] += float(w[t, k]) * y
    return out


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return g, x, idx, w


def rel_err(a, b):
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("layout", ["plain", "transposed_interleaved_bias_swiglu", "no_gate", "i32_index"])
def test_backend_matches_loop(backend, layout):
    g, x, idx, w = inputs()
    kw, ref_kw = {}, {}
    if layout in ("plain", "i32_index"):
        gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
        if layout == "i32_index":
            idx = idx.to(torch.int32)
        experts = moekit.Experts(gate_up, down, implementation=backend)
        ref = loop_forward(x, idx, w, gate_up, down)
    elif layout == "no_gate":
        up, down = torch.randn(E, I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
        experts = moekit.Experts(up_proj=up, down_proj=down, activation="gelu", implementation=backend)
        ref = loop_forward(x, idx, w, None, down, up=up, act=torch.nn.functional.gelu)
    else:
        gate_up, down = torch.randn(E, H, 2 * I, generator=g) * 0.2, torch.randn(E, I, H, generator=g) * 0.2
        gub, db = torch.randn(E, 2 * I, generator=g) * 0.1, torch.randn(E, H, generator=g) * 0.1
        experts = moekit.Experts(gate_up, down, gate_up_proj_bias=gub, down_proj_bias=db, is_transposed=True,
                                 is_concatenated=False, gate="clamped_swiglu", alpha=1.702, limit=0.5,
                                 implementation=backend)
        ref = loop_forward(x, idx, w, gate_up, down, gate_up_bias=gub, down_bias=db, transposed=True,
                           concatenated=False, gate="clamped_swiglu", limit=0.5)
    if not experts.supports(backend, "f32")[0]:
        pytest.skip(experts.supports(backend, "f32")[1])
    out = experts(x, idx, w)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel_err(out, ref) < 1e-5


def test_experts_forward_and_out_argument():
    g, x, idx, w = inputs(1)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    out = torch.full_like(x, float("nan"))
    got = moekit.experts_forward(x, idx, w, gate_up, down, out=out)
    assert got is out
    assert rel_err(out, loop_forward(x, idx, w, gate_up, down)) < 1e-5


def test_weights_are_used_in_place():
    g, x, idx, w = inputs(2)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * 0.2
    down = torch.nn.Parameter(torch.randn(E, H, I, generator=g) * 0.2)  # requires_grad: still accepted
    experts = moekit.Experts(gate_up, down, implementation="eager")
    before = experts(x, idx, w)
    with torch.no_grad():
        down.mul_(2.0)  # eager reads the weights at each call: no copy was taken
    assert torch.allclose(experts(x, idx, w), 2 * before, rtol=1e-5, atol=1e-6)


def test_bf16_activations():
    g, x, idx, w = inputs(3)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    experts = moekit.Experts(gate_up.bfloat16(), down.bfloat16(), implementation="eager")
    out = experts(x.bfloat16(), idx, w)
    assert out.dtype == torch.bfloat16
    ref = loop_forward(x.bfloat16().float(), idx, w, gate_up.bfloat16().float(), down.bfloat16().float())
    assert rel_err(out.float(), ref) < 1e-2


def test_errors_carry_moekit_messages():
    g, x, idx, w = inputs(4)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    experts = moekit.Experts(gate_up, down)
    with pytest.raises(ValueError, match="hidden size 5"):
        experts(x[:, :5].contiguous(), idx, w)
    with pytest.raises(ValueError, match="unknown experts implementation 'nope'"):
        experts.set_implementation("nope")
    with pytest.raises(ValueError, match="top_k_index dtype"):
        experts(x, idx.float(), w)
    with pytest.raises(ValueError, match="exactly one of"):
        moekit.Experts(None, down)
    if not moekit.cuda_available():
        with pytest.raises(NotImplementedError, match="deepgemm"):
            moekit.Experts(gate_up, down, implementation="deepgemm")(x, idx, w)


@pytest.mark.skipif(not (torch.cuda.is_available() and moekit.cuda_available()), reason="needs a CUDA device")
def test_cuda_tensors_on_the_current_stream():
    g, x, idx, w = inputs(5)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    ref = loop_forward(x, idx, w, gate_up, down)
    experts = moekit.Experts(gate_up.cuda(), down.cuda(), implementation="grouped_mm")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = experts(x.cuda(), idx.cuda(), w.cuda())
    s.synchronize()
    assert out.is_cuda and rel_err(out.cpu(), ref) < 1e-5
