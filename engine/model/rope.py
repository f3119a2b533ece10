"""Rotary position embeddings as Hugging Face computes them, with its rotary scalings.

`RotaryEmbedding` gives each step's `Rotary` triple for `layer_ops.rotary_`: row indices and
float32 cos / signed-sin tables `[rows, head_dim]` whose row `rows[t]` rotates token `t`
(rotate-half convention: `cos` repeated over both halves, `sin` negated in the first half).

Scalings (`rope_type`, transformers' names; parameters from the scaling dict):
- `default`: `inv_freq = 1 / theta^(2i / head_dim)`.
- `linear`: `inv_freq / factor`.
- `llama3`: Llama 3.1's band-wise `factor` (`low_freq_factor`, `high_freq_factor`,
  `original_max_position_embeddings`).
- `yarn`: YaRN's ramp between interpolated and extrapolated frequencies, tables times its
  attention factor (`factor`, `original_max_position_embeddings`, optional `attention_factor`,
  `beta_fast`, `beta_slow`, `mscale`, `mscale_all_dim`, `truncate`).
- `dynamic`: NTK-aware: a sequence of length `L > max_position_embeddings` uses the base
  `theta * (factor * L / max_position_embeddings - (factor - 1))^(d / (d - 2))`; it is usable
  up to `max_position_embeddings * factor` positions (`max_positions`).
- `longrope` (older Phi-3 configs say `su`): `inv_freq / short_factor[i]` while the sequence is
  at most `original_max_position_embeddings` long, `/ long_factor[i]` beyond, tables times
  `attention_factor` (default `sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`,
  `factor` defaulting to `max_position_embeddings / original_max_position_embeddings`).

- `freq_factors` (not a transformers type: how a GGUF file states a scaling, llama.cpp's
  `rope_freqs` tensor, which is how its converter stores Llama 3's): `inv_freq / freq_factors[i]`.

`original_max_position_embeddings` defaults to `max_position_embeddings`, as transformers fills
it in; a family whose config keeps it outside the scaling (Phi-3) copies it into the dict.

`STATIC_TYPES` are one table over `max_position_embeddings` positions, built once. The others
(`SEQ_LEN_TYPES`) follow transformers' rule for one sequence generated on its own: a token's
frequencies are those of its sequence's length after the step that computes it (the largest
position of that step plus one). The engine passes each token's sequence length; a chunked
prefill therefore rotates a chunk's keys with the chunk's own length, as transformers would had
it been given the prompt in those pieces (it never is: it computes a prompt in one forward).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, Optional

import torch

__all__ = ["RotaryEmbedding", "STATIC_TYPES", "SEQ_LEN_TYPES", "check_scaling", "max_positions",
           "rope_type_of"]

#: `rope_type`s whose tables depend on the position only.
STATIC_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")
#: `rope_type`s whose tables depend on the sequence's length too.
SEQ_LEN_TYPES = ("dynamic", "longrope")
#: Older spellings of a `rope_type`.
_ALIASES = {"su": "longrope"}
#: The parameters each `rope_type` needs (`original_max_position_embeddings` has a default).
_REQUIRED = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
             "yarn": ("factor",), "longrope": ("short_factor", "long_factor"),
             "freq_factors": ("freq_factors",)}
#: The positive numbers each `rope_type` may be given.
_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast",
            "beta_slow", "mscale", "mscale_all_dim")

#: The step's row of each token (int64 `[T]`) and the float32 cos / signed sin tables.
Rotary = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rope_type_of(scaling: Optional[dict[str, Any]]) -> str:
    """The `rope_type` of a Hugging Face rotary scaling dict (older configs say `type`, and `su`
    for `longrope`); "default" for None."""
    if not scaling:
        return "default"
    kind = str(scaling.get("rope_type", scaling.get("type", "default")))
    return _ALIASES.get(kind, kind)


def check_scaling(scaling: Optional[dict[str, Any]]) -> str:
    """The `rope_type` of `scaling` once its parameters are checked; ValueError naming the
    `rope_type` when it is not supported, or the parameter that is missing or invalid."""
    rope_type = rope_type_of(scaling)
    if rope_type not in STATIC_TYPES + SEQ_LEN_TYPES:
        raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported; "
                         f"expected one of {list(STATIC_TYPES + SEQ_LEN_TYPES)}")
    scaling = scaling or {}
    for key in _REQUIRED[rope_type]:
        if scaling.get(key) is None:
            raise ValueError(f"rope_scaling: rope_type {rope_type!r} needs {key!r}, got "
                             f"{scaling!r}")
    for key in _NUMBERS:
        _check_number(scaling, key)
    _check_partial(scaling)
    orig = scaling.get("original_max_position_embeddings")
    if orig is not None and (isinstance(orig, bool) or not isinstance(orig, int) or orig < 1):
        raise ValueError(f"rope_scaling: original_max_position_embeddings: expected an int >= 1, "
                         f"got {orig!r}")
    for key in ("short_factor", "long_factor", "freq_factors"):
        if key in scaling and not _positive_list(scaling[key]):
            raise ValueError(f"rope_scaling: {key}: expected a list of numbers > 0, got "
                             f"{scaling[key]!r}")
    return rope_type


def _check_number(scaling: dict[str, Any], key: str) -> None:
    value = scaling.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 < value < math.inf:
        raise ValueError(f"rope_scaling: {key}: expected a finite number > 0, got {value!r}")


def _check_partial(scaling: dict[str, Any]) -> None:
    """The kernels rotate whole heads: a partial rotary factor other than 1 is refused."""
    partial = scaling.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"rope_scaling: partial_rotary_factor: expected 1.0 (rotary over the "
                         f"whole head), got {partial!r}")


def _positive_list(values: Any) -> bool:
    return isinstance(values, (list, tuple)) and all(
        isinstance(v, Real) and not isinstance(v, bool) and 0 < v < math.inf for v in values)


def max_positions(max_position_embeddings: int, scaling: Optional[dict[str, Any]]) -> int:
    """The number of positions a model with this rotary scaling can run:
    `max_position_embeddings`, times `factor` for `dynamic` (NTK scaling stretches the context
    the model was trained on by `factor`)."""
    if rope_type_of(scaling) == "dynamic":
        return int(max_position_embeddings * float(scaling["factor"]))
    return max_position_embeddings


def _exponents(head_dim: int) -> torch.Tensor:
    """float32 `2i / head_dim`, as transformers computes them."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """float32 `1 / theta^(2i / head_dim)`."""
    return 1.0 / (theta ** _exponents(head_dim))


def _llama3_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any],
                     original_max: int) -> torch.Tensor:
    """Llama 3.1's frequencies: wavelengths above `original_max / low_freq_factor` divided by
    `factor`, below `original_max / high_freq_factor` kept, smoothly interpolated between."""
    inv_freq = _default_inv_freq(head_dim, theta)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    low_freq_wavelen, high_freq_wavelen = original_max / low, original_max / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_attention_factor(scaling: dict[str, Any], factor: float) -> float:
    """YaRN's cos/sin multiplier: `attention_factor`, else `0.1 ln(factor) + 1` (a ratio of two
    such terms with `mscale` and `mscale_all_dim`)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any],
                   original_max: int) -> torch.Tensor:
    """YaRN's frequencies: extrapolated (unscaled) above `beta_fast` rotations over
    `original_max` positions, interpolated (`/ factor`) below `beta_slow`, a linear ramp
    between."""
    factor = scaling["factor"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original_max / (rotations * 2 * math.pi))
                ) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low),
                       0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs) * (1 - extrapolation)
            + 1.0 / pos_freqs * extrapolation)


def _longrope_inv_freq(head_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE's frequencies: `1 / (factors[i] * theta^(2i / head_dim))`."""
    _check_length(factors, head_dim, "short_factor / long_factor")
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** _exponents(head_dim))


def _freq_factors_inv_freq(head_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """llama.cpp's `rope_freqs`: `1 / theta^(2i / head_dim) / factors[i]`."""
    _check_length(factors, head_dim, "freq_factors")
    return _default_inv_freq(head_dim, theta) / torch.tensor(factors, dtype=torch.float32)


def _check_length(factors: list[float], head_dim: int, name: str) -> None:
    if len(factors) != head_dim // 2:
        raise ValueError(f"rope_scaling: {name}: expected {head_dim // 2} numbers "
                         f"(head_dim / 2), got {len(factors)}")


def _tables(inv_freq: torch.Tensor, positions: torch.Tensor,
            attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin `[len(positions), head_dim]` (float32) for float32 `inv_freq`
    `[head_dim / 2]` (or one row of it per position, `[len(positions), head_dim / 2]`), each
    multiplied by `attention_factor`."""
    freqs = positions.float()[:, None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    sin[:, :inv_freq.shape[-1]].neg_()
    return cos, sin


class RotaryEmbedding:
    """The rotary embedding of one kind of layer: `head_dim`, base `theta`, Hugging Face
    `scaling` (None or a dict with `rope_type` and its parameters, module docstring), for
    positions `< max_positions` (`max_position_embeddings`, times `factor` for `dynamic`).

    ValueError naming the `rope_type` (or parameter) when the scaling is not supported.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict[str, Any]],
                 max_position_embeddings: int, device: Optional[torch.device] = None) -> None:
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = dict(scaling or {})
        self.rope_type = check_scaling(scaling)
        self.max_position_embeddings = max_position_embeddings
        self.max_positions = max_positions(max_position_embeddings, scaling)
        self.original_max_position_embeddings = int(self.scaling.get(
            "original_max_position_embeddings") or max_position_embeddings)
        self.depends_on_seq_len = self.rope_type in SEQ_LEN_TYPES
        self.device = torch.device(device or "cpu")
        inv_freq, self.attention_factor = self._static_inv_freq()
        self.trained_inv_freq = inv_freq
        positions = torch.arange(max_position_embeddings, dtype=torch.int64)
        cos, sin = _tables(inv_freq, positions, self.attention_factor)
        if self.rope_type == "longrope":  # rows [max_pos, 2 max_pos): the long factors
            long_freq = _longrope_inv_freq(head_dim, theta, self.scaling["long_factor"])
            long_cos, long_sin = _tables(long_freq, positions, self.attention_factor)
            cos, sin = torch.cat((cos, long_cos)), torch.cat((sin, long_sin))
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)

    def _static_inv_freq(self) -> tuple[torch.Tensor, float]:
        """The frequencies used for every position (`STATIC_TYPES`) or for sequences not past
        the length threshold (`SEQ_LEN_TYPES`), and the cos/sin multiplier."""
        d, theta, s = self.head_dim, self.theta, self.scaling
        orig = self.original_max_position_embeddings
        if self.rope_type == "linear":
            return _default_inv_freq(d, theta) / s["factor"], 1.0
        if self.rope_type == "llama3":
            return _llama3_inv_freq(d, theta, s, orig), 1.0
        if self.rope_type == "yarn":
            return _yarn_inv_freq(d, theta, s, orig), _yarn_attention_factor(s, s["factor"])
        if self.rope_type == "longrope":
            return _longrope_inv_freq(d, theta, s["short_factor"]), self._longrope_attention()
        if self.rope_type == "dynamic":
            return self._dynamic_inv_freq(None), 1.0
        if self.rope_type == "freq_factors":
            return _freq_factors_inv_freq(d, theta, s["freq_factors"]), 1.0
        return _default_inv_freq(d, theta), 1.0

    def _longrope_attention(self) -> float:
        s, orig = self.scaling, self.original_max_position_embeddings
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        factor = s.get("factor")
        if factor is None:
            factor = self.max_position_embeddings / orig
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))

    def _dynamic_inv_freq(self, seq_len: Optional[torch.Tensor]) -> torch.Tensor:
        """NTK frequencies for sequences of length `seq_len` (int64 `[U, 1]`, each longer than
        `max_position_embeddings`: float32 arithmetic, as transformers' update), or for the
        trained length (None: Python floats, as transformers' initial table)."""
        m, factor, d = self.max_position_embeddings, self.scaling["factor"], self.head_dim
        if seq_len is None:
            base = self.theta * ((factor * m / m) - (factor - 1)) ** (d / (d - 2))
            return 1.0 / (base ** _exponents(d))
        base = self.theta * ((factor * seq_len / m) - (factor - 1)) ** (d / (d - 2))
        return 1.0 / (base ** _exponents(d).to(seq_len.device))

    def for_step(self, positions: torch.Tensor,
                 token_seq_lens: Optional[torch.Tensor] = None) -> Rotary:
        """The `Rotary` triple of a step's tokens at `positions` (int64 `[T]`);
        `token_seq_lens` (int64 `[T]`, each token's sequence length after the step) is needed
        when the tables depend on it (`depends_on_seq_len`)."""
        if not self.depends_on_seq_len:
            return positions, self.cos, self.sin
        if token_seq_lens is None or token_seq_lens.shape != positions.shape:
            raise ValueError(f"token_seq_lens: expected an int64 tensor shaped like positions "
                             f"{tuple(positions.shape)} for rope_type {self.rope_type!r}, got "
                             f"{None if token_seq_lens is None else tuple(token_seq_lens.shape)}")
        if self.rope_type == "longrope":
            long = token_seq_lens > self.original_max_position_embeddings
            return positions + long * self.max_position_embeddings, self.cos, self.sin
        return self._dynamic_step(positions, token_seq_lens)

    def _dynamic_step(self, positions: torch.Tensor, token_seq_lens: torch.Tensor) -> Rotary:
        """Per-token tables for `dynamic`: tokens of sequences within `max_position_embeddings`
        read the trained table, the others get rows from their sequence length's frequencies."""
        beyond = token_seq_lens > self.max_position_embeddings
        if not bool(beyond.any()):
            return positions, self.cos, self.sin
        lens, which = torch.unique(token_seq_lens, return_inverse=True)
        longer = (lens > self.max_position_embeddings)[:, None]
        ntk = self._dynamic_inv_freq(lens[:, None].clamp(min=self.max_position_embeddings))
        inv_freq = torch.where(longer, ntk, self.trained_inv_freq.to(ntk.device))
        cos, sin = _tables(inv_freq[which], positions)
        rows = torch.arange(positions.shape[0], dtype=torch.int64, device=positions.device)
        return rows, cos, sin
