"""moekit: Mixture-of-Experts experts backends for torch tensors and transformers models.

    import moekit
    experts = moekit.Experts(gate_up_proj, down_proj, activation="silu")
    out = experts(hidden_states, top_k_index, top_k_weights)

Tensors (CPU or CUDA, float32 / bfloat16 / float16) are passed to the C++ library through DLPack without copies
or stream synchronisation; CUDA work runs on torch's current stream of the tensors' device, so it works under
``torch.no_grad()`` and inside ``torch.cuda.graph`` capture for the capturable backends (batched_mm,
grouped_mm, deepgemm; not eager, which synchronises with the host). moekit's errors arrive as ValueError (invalid arguments, unknown names), NotImplementedError
(a backend that cannot run these experts here), OSError and RuntimeError, with moekit's message.
"""

from __future__ import annotations

from typing import Any, Optional

from . import _moekit
from ._moekit import __version__, with_cuda

__all__ = ["Experts", "experts_forward", "backends", "cuda_available", "with_cuda", "__version__"]

_PARAM_NAMES = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


def backends() -> list[dict]:
    """The registered experts backends, in registry order: name, description, devices, and whether each runs
    here (available_cpu / available_cuda, with the reason when not)."""
    return _moekit.backends()


def cuda_available() -> bool:
    """Whether this build has the CUDA backends and a device is present."""
    return _moekit.cuda_available()


def _current_stream(t: Any) -> int:
    if getattr(t, "is_cuda", False):
        import torch

        return torch.cuda.current_stream(t.device).cuda_stream
    return 0


def _dl(t: Any) -> Any:
    """A DLPack capsule of a torch tensor (the same memory), else the object itself. torch's ``__dlpack__``
    may order the current stream against the default one (an event per tensor, which also breaks graph
    capture); the capsule does no stream work: moekit runs on the current stream itself."""
    if getattr(t, "requires_grad", False):
        t = t.detach()  # inference only: the forward never records a graph for autograd
    to_dlpack = _torch_to_dlpack(t)
    return to_dlpack(t) if to_dlpack is not None else t


def _torch_to_dlpack(t: Any) -> Any:
    mod = type(t).__module__
    if not mod.startswith("torch"):
        return None
    import torch.utils.dlpack

    return torch.utils.dlpack.to_dlpack


class Experts:
    """The routed experts of one MoE layer, over tensors in transformers' layout (SPEC section 1):

    - ``gate_up_proj`` ``[E, 2I, H]`` (``is_transposed``: ``[E, H, 2I]``), gate rows then up rows
      (``is_concatenated=False``: interleaved g0, u0, g1, u1, ...); or ``up_proj`` ``[E, I, H]`` without a gate;
    - ``down_proj`` ``[E, H, I]`` (``is_transposed``: ``[E, I, H]``);
    - optional biases ``gate_up_proj_bias`` ``[E, 2I]`` / ``up_proj_bias`` ``[E, I]``, ``down_proj_bias`` ``[E, H]``.

    The weights are used in place (no copy) and must stay alive and unchanged while this module is used.
    ``gate`` is ``"act_mul"`` (act(gate) * up) or ``"clamped_swiglu"`` (gpt-oss, with ``alpha`` and ``limit``).
    ``implementation`` names a backend (``moekit.backends()``); ``""`` picks the default.
    """

    def __init__(
        self,
        gate_up_proj: Any = None,
        down_proj: Any = None,
        *,
        up_proj: Any = None,
        gate_up_proj_bias: Any = None,
        up_proj_bias: Any = None,
        down_proj_bias: Any = None,
        activation: str = "silu",
        is_transposed: bool = False,
        is_concatenated: bool = True,
        gate: str = "act_mul",
        alpha: float = 1.702,
        limit: float = 7.0,
        implementation: str = "",
    ) -> None:
        has_gate = gate_up_proj is not None
        if has_gate == (up_proj is not None):
            raise ValueError("Experts: pass exactly one of gate_up_proj (gated experts) and up_proj (no gate)")
        if down_proj is None:
            raise ValueError("Experts: down_proj is required")
        first = gate_up_proj if has_gate else up_proj
        if len(first.shape) != 3 or len(down_proj.shape) != 3:
            raise ValueError(
                f"Experts: expert weights must be 3-D [E, out, in] (or [E, in, out] transposed), got "
                f"{tuple(first.shape)} and {tuple(down_proj.shape)}"
            )
        num_experts = int(first.shape[0])
        # down_proj: [E, H, I], or [E, I, H] transposed.
        hidden, intermediate = (int(down_proj.shape[2]), int(down_proj.shape[1])) if is_transposed else (
            int(down_proj.shape[1]), int(down_proj.shape[2]))
        tensors = {
            "gate_up_proj": gate_up_proj,
            "up_proj": up_proj,
            "down_proj": down_proj,
            "gate_up_proj_bias": gate_up_proj_bias,
            "up_proj_bias": up_proj_bias,
            "down_proj_bias": down_proj_bias,
        }
        params = {name: _detach(t) for name, t in tensors.items() if t is not None}
        has_bias = any(name.endswith("_bias") for name in params)
        self._params = params  # the C++ module wraps their memory
        self.device = getattr(down_proj, "device", None)
        self._module = _moekit.Experts(
            {name: _dl(t) for name, t in params.items()}, num_experts, hidden, intermediate, activation, has_gate, has_bias, is_transposed,
            is_concatenated, gate, float(alpha), float(limit), implementation)
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden, intermediate

    @property
    def implementation(self) -> str:
        return self._module.implementation

    def set_implementation(self, name: str) -> None:
        """Switches backend (no weight reload); an unknown name raises ValueError listing the valid ones."""
        self._module.set_implementation(name)

    def supports(self, backend: str, act_dtype: str = "f32") -> tuple[bool, str]:
        """Whether ``backend`` can run these experts with activations of ``act_dtype``, and why not."""
        return self._module.supports(backend, act_dtype)

    @property
    def spec(self) -> str:
        return self._module.spec

    def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any, *, out: Any = None,
                implementation: Optional[str] = None) -> Any:
        """``out = experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])``, a new tensor of
        ``hidden_states``' dtype and device unless ``out`` is given. Runs on torch's current CUDA stream."""
        if out is None:
            import torch

            out = torch.empty(hidden_states.shape, dtype=hidden_states.dtype, device=hidden_states.device)
        self._module.forward_into(_dl(hidden_states), _dl(top_k_index), _dl(top_k_weights), _dl(out),
                                  _current_stream(hidden_states), implementation)
        return out

    __call__ = forward

    def check_errors(self) -> None:
        """On CUDA, out-of-range expert ids are dropped on the device (that slot adds nothing) and recorded:
        this waits for torch's current stream and raises ValueError naming the first one since the last
        check. A no-op for CPU experts, whose ids are checked before every call."""
        if getattr(self.device, "type", "cpu") != "cuda":
            return
        import torch

        self._module.check_errors(torch.cuda.current_stream(self.device).cuda_stream)

    def clear_state(self) -> None:
        """Drops every backend's cached state (repacked weights, workspaces)."""
        self._module.clear_state()

    def __repr__(self) -> str:
        return f"moekit.Experts({self.spec}, implementation={self.implementation!r})"


def _detach(t: Any) -> Any:
    # DLPack export refuses tensors that require grad; the forward is inference-only.
    return t.detach() if getattr(t, "requires_grad", False) else t


def experts_forward(hidden_states: Any, top_k_index: Any, top_k_weights: Any, gate_up_proj: Any = None,
                    down_proj: Any = None, *, implementation: str = "", out: Any = None, **kwargs: Any) -> Any:
    """One Experts forward: ``Experts(gate_up_proj, down_proj, **kwargs)(hidden_states, top_k_index,
    top_k_weights)``. Backends prepare (repack) the weights on each call: keep an :class:`Experts` to reuse
    them."""
    experts = Experts(gate_up_proj, down_proj, implementation=implementation, **kwargs)
    return experts.forward(hidden_states, top_k_index, top_k_weights, out=out)
