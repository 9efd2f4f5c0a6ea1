"""Which row counts and weight shapes a CPU worker warms before it serves
(engine_core/workers/warm_rows.py), without vLLM or torch."""

from __future__ import annotations

import pytest

from engine_core.workers.warm_rows import (
    CACHE_ENV,
    DEFAULT_ROWS,
    WARM_ROWS_ENV,
    rows_to_warm,
    shapes,
)

pytestmark = pytest.mark.unit


class Weight:
    def __init__(self, *shape, meta=False):
        self.shape, self.is_meta = shape, meta

    def dim(self):
        return len(self.shape)


class Linear:
    def __init__(self, n, k, bias=None, skip_bias_add=False):
        self.output_size_per_partition, self.input_size_per_partition = n, k
        self.bias, self.skip_bias_add = bias, skip_bias_add
        self.weight = Weight(0)  # vLLM empties a oneDNN layer's weight
        self.cpu_linear = lambda x, w, b: None


class Head:  # an embedding used as the LM head: no partition sizes, its weight kept
    def __init__(self, vocab, hidden, meta=False):
        self.weight = Weight(vocab, hidden, meta=meta)
        self.cpu_linear = lambda x, w, b: None


def test_one_layer_per_weight_shape_and_bias_and_nothing_without_a_cpu_linear():
    q1, q2, o, down, head = Linear(384, 128), Linear(384, 128), Linear(128, 128), Linear(128, 384), Head(2048, 128)
    biased = Linear(384, 128, bias=object())
    skipped = Linear(128, 128, bias=object(), skip_bias_add=True)  # its bias is added by its caller
    plain = Weight(3)  # a module vLLM did not dispatch: no cpu_linear
    got = shapes([q1, q2, o, plain, down, head, biased, skipped])
    assert [(m, k) for m, k, _ in got] == [(q1, 128), (o, 128), (down, 384), (head, 128), (biased, 128)]
    assert [b is not None for _, _, b in got] == [False, False, False, False, True]


def test_a_head_whose_weight_is_not_loaded_is_left_out():
    assert shapes([Head(2048, 128, meta=True)]) == []


@pytest.mark.parametrize("env, max_num_seqs, n_shapes, want", [
    ({}, 256, 5, DEFAULT_ROWS),
    ({}, 16, 5, 32),  # twice max_num_seqs: every decode and a prompt beside them
    ({WARM_ROWS_ENV: "0"}, 256, 5, 0),
    ({WARM_ROWS_ENV: "64"}, 256, 5, 64),
    ({WARM_ROWS_ENV: "500"}, 256, 5, 204),  # no more than oneDNN's 1,024 primitives hold
    ({WARM_ROWS_ENV: "500", CACHE_ENV: "4096"}, 256, 5, 500),
    ({WARM_ROWS_ENV: "lots"}, 256, 5, DEFAULT_ROWS),  # not a number: the default
    ({WARM_ROWS_ENV: "-3"}, 256, 5, 0),
    ({}, 256, 0, DEFAULT_ROWS),
])
def test_rows_to_warm(env, max_num_seqs, n_shapes, want):
    assert rows_to_warm(max_num_seqs, n_shapes, env) == want
