"""moekit_* experts implementations inside transformers, against transformers' own grouped_mm, on the fixture
checkpoints of tests/fixtures/models: f32 logits within 1e-4 and the same greedy tokens."""
import pytest

from conftest import FIXTURES

moekit = pytest.importorskip("moekit")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
mt = pytest.importorskip("moekit.integrations.transformers")

MODELS = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").exists())
NAMES = ["moekit_eager", "moekit_batched_mm", "moekit_grouped_mm"]


@pytest.fixture(scope="module", autouse=True)
def registered():
    return mt.register()


def load(name, implementation):
    path = FIXTURES / name
    config = transformers.AutoConfig.from_pretrained(path)
    if name == "qwen3_vl_moe":
        cls = transformers.AutoModelForImageTextToText
    else:
        cls = transformers.AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float32, experts_implementation=implementation)
    return model.eval(), config


def prompt(config):
    text = getattr(config, "text_config", config)
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, text.vocab_size, (2, 7), generator=g)


def test_register_names(registered):
    from transformers.integrations.moe import ExpertsInterface

    assert set(NAMES) <= set(registered)
    for name in registered:
        assert name in ExpertsInterface._global_mapping


@pytest.mark.parametrize("name", MODELS)
def test_logits_and_greedy_tokens_match_transformers(name):
    ref_model, config = load(name, "grouped_mm")
    ids = prompt(config)
    with torch.no_grad():
        ref_logits = ref_model(ids).logits
        ref_tokens = ref_model.generate(ids, max_new_tokens=6, do_sample=False)
    model, _ = load(name, NAMES[0])
    for impl in NAMES:
        model.set_experts_implementation(impl)
        with torch.no_grad():
            logits = model(ids).logits
            tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        err = (logits - ref_logits).abs().max().item()
        assert err <= 1e-4, f"{name} {impl}: max |logits - grouped_mm's| = {err}"
        assert torch.equal(tokens, ref_tokens), f"{name} {impl}: greedy tokens differ"
    # The module really ran through moekit.
    assert any("_moekit_experts" in m.__dict__ for m in model.modules())


def test_unknown_gate_is_not_implemented():
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation
    class OddExperts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = 2
            self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 8, 4))
            self.down_proj = torch.nn.Parameter(torch.randn(2, 4, 4))

        def _apply_gate(self, gate_up):
            return gate_up[..., :4] * 2

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("not reached")

    cfg = transformers.PretrainedConfig()
    cfg._experts_implementation = "moekit_eager"
    m = OddExperts(cfg)
    with pytest.raises(NotImplementedError, match="own gate"):
        m(torch.randn(3, 4), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))


def test_decode_switch_map_and_cpu_generation_keeps_the_map():
    assert mt.decode_experts_implementation({"": "moekit_grouped_mm", "text_config": "eager"}) == {
        "": "moekit_batched_mm", "text_config": "eager"}
    assert mt.decode_experts_implementation({"": "grouped_mm"}) == {"": "grouped_mm"}
    model, config = load("qwen3_moe", "moekit_grouped_mm")
    seen = []
    from transformers.integrations.moe import ExpertsInterface

    grouped = ExpertsInterface._global_mapping["moekit_grouped_mm"]

    def spy(self, *args):
        seen.append(self.config._experts_implementation)
        return grouped(self, *args)

    ExpertsInterface.register("moekit_grouped_mm", spy)
    try:
        with torch.no_grad():
            model.generate(prompt(config), max_new_tokens=3, do_sample=False)
    finally:
        ExpertsInterface.register("moekit_grouped_mm", grouped)
    # On the CPU nothing switches: every call, prefill and decode, ran moekit_grouped_mm.
    assert seen and set(seen) == {"moekit_grouped_mm"}
    assert model.get_experts_implementation()[""] == "moekit_grouped_mm"


def test_decode_switch_on_a_gpu_model_and_restore_on_error(monkeypatch):
    model, _ = load("qwen3_moe", "moekit_grouped_mm")
    # The switch looks at model.device only: present the model as a GPU one for this check.
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    with model._optimize_model_for_decode():
        assert model.get_experts_implementation()[""] == "moekit_batched_mm"
    assert model.get_experts_implementation()[""] == "moekit_grouped_mm"
    with pytest.raises(RuntimeError, match="boom"):
        with model._optimize_model_for_decode():
            raise RuntimeError("boom")
    assert model.get_experts_implementation()[""] == "moekit_grouped_mm"
