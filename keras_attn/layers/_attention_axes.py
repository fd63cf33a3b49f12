"""Attention over chosen axes of inputs of any rank, as attention over sequences."""

import math

from keras import ops


class AttentionAxes:
    """Folds inputs `(B, d_1, ..., d_n, width)` into sequences `(B', L, width)`.

    As in Keras' `attention_axes`: attention runs over the chosen inner axes
    (flattened, in order, into one sequence axis of length `L`), and the other
    inner axes act as batch axes (`B' = B * their sizes`). Softmax over several
    key axes is softmax over their flattened positions, so attention over the
    sequences is exactly Keras' multi-axis attention. For inputs of rank 3 with
    the default axes, every fold is the identity.

    Args:
        attention_axes: `None` (all inner axes) or a tuple of axes of the
            inputs, negative ones counted from the end.
        rank: int >= 3. Rank of the query, key and value inputs.
    """

    def __init__(self, attention_axes, rank):
        inner = range(1, rank - 1)
        if attention_axes is None:
            attention_axes = tuple(inner)
        axes = tuple(sorted(a + rank if a < 0 else a for a in attention_axes))
        if len(set(axes)) != len(axes) or not set(axes) <= set(inner):
            raise ValueError(
                "`attention_axes` must name distinct axes between the batch and "
                f"the feature axis of inputs of rank {rank}, i.e. in [1, "
                f"{rank - 2}] or [{1 - rank}, -2]. "
                f"Received: attention_axes={attention_axes}."
            )
        self.rank = rank
        self.attention = axes
        self.batch = tuple(a for a in inner if a not in axes)
        self.identity = self.batch == () and rank == 3

    def _permutation(self, trailing):
        inner = self.rank - 1
        return (0, *self.batch, *self.attention, *range(inner, inner + trailing))

    def fold(self, x, trailing=1):
        """`(B, d_1, ..., d_n, *trailing)` -> `(B', L, *trailing)`.

        `trailing` is the number of axes after the inner ones: 1 for inputs
        (their width), 0 for padding masks `(B, d_1, ..., d_n)`.
        """
        if self.identity or x is None:
            return x
        x = ops.transpose(x, self._permutation(trailing))
        shape = ops.shape(x)
        first_attention = 1 + len(self.batch)
        length = math.prod(shape[first_attention : self.rank - 1])
        return ops.reshape(x, (-1, length, *shape[self.rank - 1 :]))

    def unfold(self, y, like, trailing):
        """Inverse of `fold` for `y` `(B', L, *trailing)`, folded from `like`."""
        if self.identity:
            return y
        shape = ops.shape(like)
        leading = [shape[a] for a in (0, *self.batch, *self.attention)]
        y = ops.reshape(y, (*leading, *ops.shape(y)[2:]))
        permutation = self._permutation(trailing)  # its inverse, in Python ints
        inverse = sorted(range(len(permutation)), key=permutation.__getitem__)
        return ops.transpose(y, inverse)

    def fold_attention_mask(self, mask, query, key):
        """`(B, *batch axes, *query axes, *key axes)` -> `(B', T, S)`.

        Axes of size 1 broadcast. `query` and `key` are the unfolded inputs.
        """
        if self.identity or mask is None:
            return mask
        query_shape, key_shape = ops.shape(query), ops.shape(key)
        full = [query_shape[a] for a in (0, *self.batch, *self.attention)]
        full += [key_shape[a] for a in self.attention]
        mask = ops.broadcast_to(mask, full)
        query_length = math.prod(
            full[1 + len(self.batch) : 1 + len(self.batch) + len(self.attention)]
        )
        return ops.reshape(
            mask, (-1, query_length, math.prod(full[-len(self.attention) :]))
        )

    def unfold_scores(self, scores, query, key):
        """`(B', H, T, S)` -> `(B, *batch axes, H, *query axes, *key axes)`."""
        if self.identity:
            return scores
        query_shape, key_shape = ops.shape(query), ops.shape(key)
        shape = [query_shape[a] for a in (0, *self.batch)] + [scores.shape[1]]
        shape += [query_shape[a] for a in self.attention]
        shape += [key_shape[a] for a in self.attention]
        return ops.reshape(scores, shape)

    def scores_shape(self, query_shape, key_shape, num_heads):
        """Static shape of `unfold_scores`' result."""
        return (
            query_shape[0],
            *(query_shape[a] for a in self.batch),
            num_heads,
            *(query_shape[a] for a in self.attention),
            *(key_shape[a] for a in self.attention),
        )

    def attention_mask_rank(self):
        return 1 + len(self.batch) + 2 * len(self.attention)
