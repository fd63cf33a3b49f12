"""The attention options `MultiHeadAttention` and the blocks share, declared
once: their names, defaults and checks, their attributes and their config."""

import dataclasses

from keras_attn._checks import (
    check_bool,
    check_key_value_heads,
    check_positive_float,
    check_positive_int,
)
from keras_attn.ops.plan import fused_limits, refuse_flash
from keras_attn.ops.positions import check_rope_scaling


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """What attention computes, beyond the number of heads and dropout.

    A layer takes these as keyword arguments (the `MultiHeadAttention`
    arguments Keras has, in Keras' positions), keeps each as an attribute of
    the same name (`apply`) and saves them in its config (`config_of`). The
    docstrings of the layers describe each.
    """

    key_dim: int | None = None
    num_key_value_heads: int | None = None
    flash_attention: bool | None = None
    use_gate: bool = False
    sliding_window: int | None = None
    use_bias: bool = True
    use_output_bias: bool | None = None
    normalize_qk: bool = False
    logit_soft_cap: float | None = None
    rope_max_wavelength: float | None = None
    rope_scaling_factor: float = 1.0
    rope_scaling: dict | None = None
    attention_scale: float | None = None
    attention_sinks: int | None = None
    use_sink_logits: bool = False

    @classmethod
    def names(cls):
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def take(cls, kwargs, num_heads, dropout, **given):
        """The options among `kwargs` (removed from it) and `given`, checked
        against `num_heads` and `dropout`; the rest of `kwargs` stays for
        Keras' `Layer`."""
        given.update({name: kwargs.pop(name) for name in cls.names() if name in kwargs})
        return cls._checked(num_heads, dropout, **given)

    @classmethod
    def _checked(cls, num_heads, dropout, **given):
        options = cls(**given)  # the defaults filled in, unchecked
        options = cls(
            key_dim=check_positive_int("key_dim", options.key_dim, allow_none=True),
            num_key_value_heads=check_key_value_heads(
                num_heads, options.num_key_value_heads
            ),
            flash_attention=check_bool(
                "flash_attention", options.flash_attention, allow_none=True
            ),
            use_gate=check_bool("use_gate", options.use_gate),
            sliding_window=check_positive_int(
                "sliding_window", options.sliding_window, allow_none=True
            ),
            use_bias=check_bool("use_bias", options.use_bias),
            use_output_bias=check_bool(
                "use_output_bias", options.use_output_bias, allow_none=True
            ),
            normalize_qk=check_bool("normalize_qk", options.normalize_qk),
            logit_soft_cap=check_positive_float(
                "logit_soft_cap", options.logit_soft_cap, allow_none=True
            ),
            rope_max_wavelength=check_positive_float(
                "rope_max_wavelength", options.rope_max_wavelength, allow_none=True
            ),
            rope_scaling_factor=check_positive_float(
                "rope_scaling_factor", options.rope_scaling_factor
            ),
            rope_scaling=check_rope_scaling(
                options.rope_scaling,
                "rope_scaling",
                options.rope_scaling_factor,
                "rope_scaling_factor",
            ),
            attention_scale=check_positive_float(
                "attention_scale", options.attention_scale, allow_none=True
            ),
            attention_sinks=check_positive_int(
                "attention_sinks", options.attention_sinks, allow_none=True
            ),
            use_sink_logits=check_bool("use_sink_logits", options.use_sink_logits),
        )
        options._check_together(dropout)
        return options

    def _check_together(self, dropout):
        if self.attention_sinks is not None and self.sliding_window is None:
            raise ValueError(
                "`attention_sinks` keeps the first positions visible beside a "
                "sliding window, and there is none without `sliding_window`. "
                f"Received: attention_sinks={self.attention_sinks}, "
                "sliding_window=None. Pass `sliding_window` (e.g. 4096)."
            )
        if self.rope_max_wavelength is None and self.rope_scaling_factor != 1.0:
            raise ValueError(
                "`rope_scaling_factor` scales rotary positions, and there are none "
                "without `rope_max_wavelength`. Received: rope_scaling_factor="
                f"{self.rope_scaling_factor}, rope_max_wavelength=None."
            )
        if self.rope_max_wavelength is None and self.rope_scaling is not None:
            raise ValueError(
                "`rope_scaling` scales rotary positions, and there are none "
                "without `rope_max_wavelength`. Received: rope_scaling="
                f"{self.rope_scaling}, rope_max_wavelength=None. Pass "
                "`rope_max_wavelength` (e.g. 10000.0)."
            )
        if self.flash_attention and dropout > 0:
            refuse_flash(
                fused_limits(dropout=True),
                f"dropout={dropout}",
                advice="Pass dropout=0.0, or flash_attention=None (fused "
                "kernels where possible).",
            )
        if self.flash_attention and self.logit_soft_cap is not None:
            refuse_flash(
                fused_limits(logit_soft_cap=self.logit_soft_cap),
                f"logit_soft_cap={self.logit_soft_cap}",
                advice="Pass flash_attention=None.",
            )
        if self.flash_attention and self.use_sink_logits:
            refuse_flash(
                fused_limits(sink_logits=True),
                "use_sink_logits=True",
                advice="Pass flash_attention=None.",
            )

    def apply(self, layer):
        """Set each option as an attribute of `layer`, by its name."""
        for name in self.names():
            setattr(layer, name, getattr(self, name))

    @classmethod
    def config_of(cls, layer):
        """The options of `layer` (its attributes), by name: config entries
        and the arguments of an attention sublayer. Dicts (`rope_scaling`)
        as plain copies: a layer's attribute is Keras' tracked dict."""
        options = {name: getattr(layer, name) for name in cls.names()}
        return {
            name: dict(value) if isinstance(value, dict) else value
            for name, value in options.items()
        }


def bias_switch(option, use_bias):
    """Whether the sublayers of a bias option (`use_output_bias`,
    `use_feedforward_bias`) have biases: the option where it is given, else
    `use_bias`."""
    return use_bias if option is None else option
