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
    def __init__(self, *shape, dtype="bf16", meta=False):
        self.shape, self.dtype, self.is_meta = shape, dtype, meta


class Linear:
    def __init__(self, n, k, bias=None, skip_bias_add=False, dtype="bf16", row_parallel_rank=None):
        self.output_size_per_partition, self.input_size_per_partition = n, k
        self.bias, self.skip_bias_add = bias, skip_bias_add
        self.weight = Weight(0, dtype=dtype)  # vLLM empties a oneDNN layer's weight; its dtype stays
        self.cpu_linear = lambda x, w, b: None
        if row_parallel_rank is not None:
            self.input_is_parallel, self.tp_rank = True, row_parallel_rank


class Replicated:  # vLLM's ReplicatedLinear: whole sizes, no partition
    def __init__(self, n, k, dtype="fp32"):
        self.output_size, self.input_size, self.bias = n, k, None
        self.weight = Weight(0, dtype=dtype)
        self.cpu_linear = lambda x, w, b: None


class Embedding:  # vLLM's VocabParallelEmbedding / ParallelLMHead: its weight kept
    def __init__(self, vocab, hidden, meta=False):
        self.num_embeddings_per_partition = self.output_size_per_partition = vocab
        self.input_size_per_partition = hidden
        self.weight = Weight(vocab, hidden, meta=meta)
        self.cpu_linear = lambda x, w, b: None


def test_one_shape_per_size_bias_and_dtype_and_nothing_without_a_cpu_linear():
    q1, q2, o, down = Linear(384, 128), Linear(384, 128), Linear(128, 128), Linear(128, 384)
    biased = Linear(384, 128, bias=object())
    skipped = Linear(128, 128, bias=object(), skip_bias_add=True)  # its bias is added by its caller
    head32 = Linear(1, 128, dtype="fp32")  # a reward model's float32 head in a bfloat16 model
    gate = Replicated(8, 128)
    plain = Weight(3)  # a module vLLM did not dispatch: no cpu_linear
    got = shapes([q1, q2, o, plain, down, biased, skipped, head32, gate])
    assert [(s.layer, s.k, s.dtype) for s in got] == [(q1, 128, "bf16"), (o, 128, "bf16"), (down, 384, "bf16"),
                                                      (biased, 128, "bf16"), (head32, 128, "fp32"),
                                                      (gate, 128, "fp32")]
    assert [s.bias is not None for s in got] == [False, False, False, True, False, False]


def test_a_row_parallel_layer_past_rank_0_is_warmed_without_its_bias():
    bias = object()
    (rank0,) = shapes([Linear(128, 64, bias=bias, row_parallel_rank=0)])
    (rank1,) = shapes([Linear(128, 64, bias=bias, row_parallel_rank=1)])
    assert rank0.bias is bias and rank1.bias is None


def test_an_embedding_is_warmed_only_as_the_lm_head_and_only_to_the_rows_sampled():
    embed, head, unloaded = Embedding(2048, 128), Embedding(2048, 128), Embedding(4096, 128, meta=True)
    assert shapes([embed, head, unloaded]) == []  # no head: a pooling model's embedding is a lookup
    (got,) = shapes([embed, head, unloaded], head=head, head_rows=64)
    assert got.layer is head and got.rows == 64 and got.bias is None
    assert shapes([Linear(384, 128)], head=head, head_rows=64)[0].rows > DEFAULT_ROWS


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
