"""moekit's backends inside transformers: ``register()`` adds ``moekit_<backend>`` to transformers'
``ExpertsInterface``, so that

    import moekit.integrations.transformers as mt
    mt.register()
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moekit_grouped_mm")

runs every ``@use_experts_implementation`` Experts module through moekit. Each forward reads the attributes
transformers' own backends read: ``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated``,
``gate_up_proj`` / ``up_proj`` / ``down_proj`` and their ``*_bias``, the activation (``config.hidden_act``)
and the gate (the default ``act(gate) * up``, or gpt-oss' clamped SwiGLU with ``alpha`` and ``limit``).
The moekit module is built once per Experts module and rebuilt when its weights change (new tensors,
dtype or device). During generation on a GPU, ``moekit_grouped_mm`` switches to ``moekit_batched_mm`` for
the decode steps, as transformers does for its own ``grouped_mm`` (SPEC section 4).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import moekit

__all__ = ["register", "registered_names", "experts_forward_for", "decode_experts_implementation"]

# moekit backend -> transformers name: "moekit_" + the name. Which backends are registered is asked of moekit's
# registry (the ones that run in this build on this machine), not listed here.
_PREFIX = "moekit_"


def _gate_kind(module: Any) -> str:
    from transformers.integrations.moe import _default_apply_gate

    apply_gate = getattr(type(module), "_apply_gate", _default_apply_gate)
    if apply_gate is _default_apply_gate:
        return "act_mul"
    if hasattr(module, "alpha") and hasattr(module, "limit") and not module.is_concatenated:
        return "clamped_swiglu"  # gpt-oss: interleaved gate/up, min(gate, limit), clamp(up), (up + 1) * glu
    raise NotImplementedError(
        f"moekit: {type(module).__name__} has its own gate ({type(module).__name__}._apply_gate) that moekit does "
        f"not implement; use one of transformers' own experts implementations for this model")


def _activation(module: Any) -> str:
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    return act if isinstance(act, str) else "silu"


def _weights_key(module: Any) -> tuple:
    key = []
    for name in ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias"):
        t = getattr(module, name, None)
        key.append(None if t is None else (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device))
    return tuple(key)


def _moekit_experts(module: Any, backend: str) -> moekit.Experts:
    """The moekit Experts for a transformers Experts module, cached on it while its weights stay the same."""
    key = _weights_key(module)
    cached = module.__dict__.get("_moekit_experts")
    if cached is not None and cached[0] == key:
        return cached[1]
    if getattr(module, "has_post_expert_norm", False):
        raise NotImplementedError(f"moekit: {type(module).__name__} has a post-expert norm, which moekit does not run")
    has_gate = getattr(module, "has_gate", True)
    has_bias = getattr(module, "has_bias", False)
    kwargs = {}
    if getattr(module, "has_gate", True):
        kwargs["gate_up_proj"] = module.gate_up_proj
        if has_bias:
            kwargs["gate_up_proj_bias"] = module.gate_up_proj_bias
    else:
        kwargs["up_proj"] = module.up_proj
        if has_bias:
            kwargs["up_proj_bias"] = module.up_proj_bias
    if has_bias:
        kwargs["down_proj_bias"] = module.down_proj_bias
    gate = _gate_kind(module) if has_gate else "act_mul"
    if gate == "clamped_swiglu":
        kwargs["alpha"], kwargs["limit"] = float(module.alpha), float(module.limit)
    experts = moekit.Experts(
        down_proj=module.down_proj,
        activation=_activation(module),
        is_transposed=bool(getattr(module, "is_transposed", False)),
        is_concatenated=bool(getattr(module, "is_concatenated", True)),
        gate=gate,
        implementation=backend,
        **kwargs,
    )
    module.__dict__["_moekit_experts"] = (key, experts)
    return experts


def experts_forward_for(backend: str) -> Callable:
    """The ``ExpertsInterface`` function running moekit's ``backend``:
    ``fn(module, hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``."""

    def forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        experts = _moekit_experts(self, backend)
        hidden_states = hidden_states.contiguous()
        return experts.forward(hidden_states, top_k_index.contiguous(), top_k_weights.contiguous(),
                               implementation=backend)

    forward.__name__ = f"{_PREFIX}{backend}_experts_forward"
    forward.__qualname__ = forward.__name__
    return forward


def registered_names() -> list[str]:
    """The ``moekit_*`` names this build registers, in moekit's registry order: every backend that runs here
    (on the CPU, or on CUDA device 0 when one is present) and can be chosen per call (load-time-only
    backends are left out). A GPU build on a Hopper card has ``moekit_deepgemm`` (and ``moekit_sonicmoe``
    where that backend is built) besides ``moekit_eager``, ``moekit_batched_mm`` and ``moekit_grouped_mm``."""
    return [_PREFIX + b["name"] for b in moekit.backends()
            if (b["available_cpu"] or b["available_cuda"]) and not b["load_time_only"]]


def decode_experts_implementation(implementation: dict) -> dict:
    """The map of experts implementations for the decode steps of GPU generation (SPEC section 4):
    ``moekit_grouped_mm`` becomes ``moekit_batched_mm``; other values stay."""
    return {k: _PREFIX + "batched_mm" if v == _PREFIX + "grouped_mm" else v for k, v in implementation.items()}


def _install_decode_switch() -> None:
    """Extends transformers' decode-step switch (grouped_mm -> batched_mm after the prefill, on a GPU) to
    moekit's names; the original map is restored when generation ends, also on an error."""
    from transformers.generation.utils import GenerationMixin

    original = getattr(GenerationMixin, "_optimize_model_for_decode", None)
    if original is None or getattr(original, "_moekit_decode_switch", False):
        return

    @contextlib.contextmanager
    def _optimize_model_for_decode(self: Any):
        before = self.get_experts_implementation()
        switch = self.device.type != "cpu" and (_PREFIX + "grouped_mm") in before.values()
        if switch:
            self.set_experts_implementation(decode_experts_implementation(before))
        try:
            with original(self):
                yield
        finally:
            if switch:
                self.set_experts_implementation(before)

    _optimize_model_for_decode._moekit_decode_switch = True
    GenerationMixin._optimize_model_for_decode = _optimize_model_for_decode


def register() -> list[str]:
    """Registers ``moekit_eager``, ``moekit_batched_mm``, ``moekit_grouped_mm`` (and ``moekit_deepgemm``,
    ``moekit_sonicmoe`` where this build runs them) into transformers' ``ExpertsInterface``; returns the
    names registered."""
    from transformers.integrations.moe import ExpertsInterface

    names = registered_names()
    for name in names:
        ExpertsInterface.register(name, experts_forward_for(name[len(_PREFIX):]))
    _install_decode_switch()
    return names
