"""The settings of one `generate` call: validated once, frozen, and the cache
key of compiled decoding loops."""

import dataclasses
import math
import random

import numpy as np

METHODS = ("greedy", "sample", "beam")
CACHE_DTYPES = (None, "int8", "float32", "bfloat16", "float16")
SAMPLING_ONLY = ("temperature", "top_k", "top_p", "seed")
DRAFT_TOKENS = 4  # `num_speculative_tokens=None` with a draft model
# The compiled loop's numeric inputs (`Settings.numbers()`).
NUMBERS = (
    "seed",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "length_penalty",
    "min_new_tokens",
)


def _number():
    """A setting that only changes numbers: an input of the compiled loop,
    left out of the cache key, so changing it compiles nothing."""
    return dataclasses.field(compare=False)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What `generate` was asked for, checked.

    Equality and hash cover only the fields that shape the compiled loop
    (`method`, `num_beams`, `end_token_ids`, `pad_token_id`, whether scores
    are kept and whether a repetition penalty applies), so a `Settings` is the
    cache key of compiled generators; the others are fed to the loop as
    numbers (`numbers()`): changing a penalty compiles nothing, switching it
    on or off compiles once.
    """

    method: str
    num_beams: int
    end_token_ids: tuple
    pad_token_id: int
    return_scores: bool
    penalized: bool
    cache_dtype: str | None
    max_length: int | None = _number()
    max_new_tokens: int | None = _number()
    min_new_tokens: int = _number()
    temperature: float = _number()
    top_k: int | None = _number()
    top_p: float | None = _number()
    repetition_penalty: float = _number()
    length_penalty: float = _number()
    seed: int | None = _number()

    @classmethod
    def from_arguments(
        cls,
        method,
        end_token_id,
        pad_token_id,
        return_scores,
        cache_dtype=None,
        **arguments,
    ):
        """Validate `generate`'s arguments, each once; raise naming the first
        bad one."""
        if method not in METHODS:
            raise ValueError(
                f"`method` must be one of {METHODS}. Received: method={method!r}."
            )
        if cache_dtype is not None and not isinstance(cache_dtype, str):
            raise TypeError(
                f"`cache_dtype` must be None or one of {list(CACHE_DTYPES[1:])}. "
                f"Received: cache_dtype={cache_dtype!r} of type "
                f"{type(cache_dtype).__name__}."
            )
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(
                f"`cache_dtype` must be one of {list(CACHE_DTYPES)}. "
                f"Received: cache_dtype={cache_dtype!r}."
            )
        _check_lengths(arguments["max_length"], arguments["max_new_tokens"])
        _check_int("min_new_tokens", arguments["min_new_tokens"], minimum=0)
        _check_int("num_beams", arguments["num_beams"], minimum=1)
        _check_int("pad_token_id", pad_token_id, minimum=0)
        _check_optional_int("seed", arguments["seed"], 0, 2**31 - 1)
        _check_optional_int("top_k", arguments["top_k"], 1)
        _check_float(
            "temperature", arguments["temperature"], "> 0", lambda t: 0 < t < math.inf
        )
        if arguments["top_p"] is not None:
            _check_float("top_p", arguments["top_p"], "in (0, 1]", lambda p: 0 < p <= 1)
        _check_float(
            "repetition_penalty",
            arguments["repetition_penalty"],
            "> 0 (1.0: none; inf: no repeats)",
            lambda r: r > 0,
        )
        _check_float(
            "length_penalty", arguments["length_penalty"], "finite", math.isfinite
        )
        _check_method_options(method, arguments)
        if not isinstance(return_scores, bool):
            raise TypeError(
                "`return_scores` must be a bool. "
                f"Received: return_scores={return_scores!r}."
            )
        return cls(
            method=method,
            num_beams=arguments["num_beams"] if method == "beam" else 1,
            end_token_ids=_end_token_ids(end_token_id),
            pad_token_id=int(pad_token_id),
            return_scores=return_scores,
            penalized=arguments["repetition_penalty"] != 1,
            cache_dtype=cache_dtype,
            **{k: v for k, v in arguments.items() if k != "num_beams"},
        )

    def numbers(self):
        """The loop's numeric inputs (`NUMBERS`), as arrays: changing them
        recompiles nothing. `top_k=0` and `top_p=1` keep every token; the
        seed defaults to a draw from Python's `random`."""
        seed = random.randrange(2**31 - 1) if self.seed is None else self.seed
        return {
            "seed": np.int32([seed]),
            "temperature": np.float32([self.temperature]),
            "top_k": np.int32([self.top_k or 0]),
            "top_p": np.float32([self.top_p or 1.0]),
            "repetition_penalty": np.float32([self.repetition_penalty]),
            "length_penalty": np.float32([self.length_penalty]),
            "min_new_tokens": np.int32([self.min_new_tokens]),
        }


def _check_method_options(method, arguments):
    """Refuse options of another method: they would be ignored."""
    if method != "beam" and arguments["length_penalty"] != 1:
        raise ValueError(
            f"length_penalty={arguments['length_penalty']!r} only applies to "
            f"method='beam'. Received method={method!r}."
        )
    if method == "sample":
        return
    given = [
        f"{name}={arguments[name]!r}"
        for name in SAMPLING_ONLY
        if arguments[name] is not None
        and not (name == "temperature" and arguments[name] == 1)
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)} only apply to method='sample'. Received "
            f"method={method!r}. Pass method='sample', or leave them out."
        )


def _check_lengths(max_length, max_new_tokens):
    if (max_length is None) == (max_new_tokens is None):
        raise ValueError(
            "Pass exactly one of `max_length` (the returned length, prompt "
            "included) and `max_new_tokens`. Received: "
            f"max_length={max_length!r}, max_new_tokens={max_new_tokens!r}."
        )
    _check_optional_int("max_length", max_length, 1)
    _check_optional_int("max_new_tokens", max_new_tokens, 0)


def _end_token_ids(end_token_id):
    """`None`, an int or a list of ints -> a tuple of ints."""
    ids = end_token_id
    if ids is None:
        return ()
    if not isinstance(ids, list | tuple):
        ids = [ids]
    if not ids:
        raise ValueError("`end_token_id` must not be an empty list. Received: [].")
    for value in ids:
        _check_int("end_token_id", value, minimum=0)
    return tuple(int(value) for value in ids)


def _check_int(name, value, minimum, maximum=None):
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(
            f"`{name}` must be an int. Received: {name}={value!r} "
            f"of type {type(value).__name__}."
        )
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}. Received: {name}={value}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"`{name}` must be <= {maximum}. Received: {name}={value}.")


def _check_optional_int(name, value, minimum, maximum=None):
    if value is not None:
        _check_int(name, value, minimum, maximum)


def _check_float(name, value, expected, valid):
    number = int | float | np.integer | np.floating
    if isinstance(value, bool) or not isinstance(value, number):
        raise TypeError(
            f"`{name}` must be a number {expected}. Received: {name}={value!r} "
            f"of type {type(value).__name__}."
        )
    if math.isnan(value) or not valid(value):
        raise ValueError(
            f"`{name}` must be a number {expected}. Received: {name}={value!r}."
        )


def check_speculation(settings, draft_model, k, return_acceptance):
    """Refuse what speculative decoding cannot do, naming the argument;
    returns the draft tokens per round (`0`: no draft model;
    `DRAFT_TOKENS` for `k=None` with one)."""
    if not isinstance(return_acceptance, bool):
        raise TypeError(
            "`return_acceptance` must be a bool. "
            f"Received: return_acceptance={return_acceptance!r}."
        )
    if draft_model is None:
        if return_acceptance:
            raise ValueError(
                "`return_acceptance=True` reports a draft model's acceptance "
                "rate: pass a `draft_model`. Received draft_model=None."
            )
        if k is not None:
            raise ValueError(
                "`num_speculative_tokens` only applies with a `draft_model`. "
                f"Received num_speculative_tokens={k!r} and draft_model=None."
            )
        return 0
    k = DRAFT_TOKENS if k is None else k
    _check_int("num_speculative_tokens", k, minimum=1)
    refused = {
        "method": (settings.method == "beam", "speculative decoding needs "
                   "method='greedy' or 'sample', not 'beam'"),
        "repetition_penalty": (settings.penalized, "the penalty would depend on "
                               "draft tokens not yet accepted; leave it at 1.0"),
    }  # fmt: skip
    for name, (bad, why) in refused.items():
        if bad:
            value = getattr(settings, name, True)
            raise ValueError(
                f"`{name}={value!r}` cannot be used with a `draft_model`: {why}."
            )
    return k
