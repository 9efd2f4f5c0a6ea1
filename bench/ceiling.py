"""The ceiling: the same load through vLLM's in-process ``LLM`` (no HTTP, no server), as a server's limit.

    python -m bench.ceiling --concurrency 1,16 --input-len 32 --output-len 64 --prompts 64

One fresh interpreter per concurrency (``max_num_seqs`` = the concurrency, so the
engine keeps that many requests in flight, as a closed-loop client does), with
the engine settings both servers get in ``bench.rounds`` (the bundled model,
eager, float32, the same KV cache and ``max_model_len``). At concurrency 1 the
prompts go one ``generate`` call each, as a client sends them one after another;
above it all go to one call. Random prompt tokens (seeded, as vLLM's random
dataset), ``ignore_eos``, the model's default sampling. Prints one JSON object:
output tokens per second by concurrency.

``bench.rounds --ceiling`` runs this after each round and reports each server's
share of it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.run import DTYPE, KV_BYTES, MAX_MODEL_LEN, ROOT

CHILD = "--one"


def prompts(n: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(input_len)] for _ in range(n)]


def one(concurrency: int, n: int, input_len: int, output_len: int) -> dict:
    """In this interpreter: one LLM, its warm-up, then the measured load."""
    from servectl.config import DEFAULT_MODEL_DIR
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(DEFAULT_MODEL_DIR), enforce_eager=True, kv_cache_memory_bytes=KV_BYTES,
              max_model_len=MAX_MODEL_LEN, dtype=DTYPE, max_num_seqs=concurrency)
    vocab = llm.get_tokenizer().vocab_size
    # The model's generation config, as both servers apply it to a request that sets no sampling.
    params = SamplingParams.from_optional(**{**llm.model_config.get_diff_sampling_param(),
                                             "max_tokens": output_len, "ignore_eos": True})
    todo = [TokensPrompt(prompt_token_ids=p) for p in prompts(n, input_len, vocab)]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(4, input_len, vocab, seed=1)], params,
                 use_tqdm=False)  # warm-up, not counted
    start = time.perf_counter()
    if concurrency == 1:
        outs = [o for p in todo for o in llm.generate([p], params, use_tqdm=False)]
    else:
        outs = llm.generate(todo, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": round(tokens / seconds, 1), "tokens": tokens, "seconds": round(seconds, 3)}


def measure(concurrency: list[int], prompts_per_cell: int, input_len: int, output_len: int) -> dict:
    """Each concurrency in a fresh interpreter: {"<c>": {"tok_s": …}} (an "error" where one failed)."""
    out = {}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    for c in concurrency:
        n = max(prompts_per_cell, 2 * c) if c > 1 else prompts_per_cell
        proc = subprocess.run([sys.executable, "-m", "bench.ceiling", CHILD, str(c), str(n), str(input_len),
                               str(output_len)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        out[str(c)] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "error": f"exit {proc.returncode}: {proc.stderr[-500:]}"}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [CHILD]:
        c, n, input_len, output_len = (int(x) for x in argv[1:5])
        print(json.dumps(one(c, n, input_len, output_len)), flush=True)
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    p = ap.parse_args(argv)
    print(json.dumps(measure([int(c) for c in p.concurrency.split(",")], p.prompts, p.input_len, p.output_len)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
