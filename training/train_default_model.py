"""Train servectl's default model: a tiny Llama that writes Python-looking code.

Corpus: the top-level modules of the CPython standard library that ships with
the interpreter (PSF licence), pinned by name and SHA-256 in ``corpus.tsv``
beside this file (the standard library differs between patch versions, so a
mismatch is an error, not a silent change of data). Files whose name hashes
into the held-out bucket are never trained on; the model card reports the
held-out loss in bits per byte against the same architecture at random init
and against a unigram baseline.

Usage::

    python -m training.train_default_model --out servectl/model/default      # full run
    python -m training.train_default_model --out /tmp/m --smoke               # seconds

Everything is seeded; the full run takes about half an hour on two CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS_LIST = HERE / "corpus.tsv"
# The trained model ships as package data of servectl.
DEFAULT_OUT = HERE.parent / "servectl" / "model" / "default"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS = "<|endoftext|>"
# ChatML-style template; the model never saw these markers, so chat answers
# read like code continuations, but the endpoint works end to end.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The architecture. Head size 64 because vLLM's CPU attention has no kernel
# for 16 or 32-wide heads below that list's smallest usable case here.
ARCH = dict(
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
SEQ_LEN = 256


def is_held_out(name: str) -> bool:
    """One file in twelve, chosen by a hash of its name: stable across runs."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 12 == 0


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def write_corpus_list() -> None:
    """Pin the corpus of this interpreter (run once, by a maintainer)."""
    rows = []
    for path in sorted(stdlib_dir().glob("*.py")):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        rows.append(f"{path.name}\t{digest}")
    CORPUS_LIST.write_text("# name\tsha256 (CPython %s Lib/*.py)\n" % sys.version.split()[0] + "\n".join(rows) + "\n")


def load_corpus() -> tuple[dict[str, str], dict[str, str]]:
    """Return (train, held_out) mappings of file name to text, hashes checked."""
    train: dict[str, str] = {}
    held: dict[str, str] = {}
    bad = []
    for line in CORPUS_LIST.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, digest = line.split("\t")
        path = stdlib_dir() / name
        data = path.read_bytes() if path.exists() else b""
        if hashlib.sha256(data).hexdigest() != digest:
            bad.append(name)
            continue
        (held if is_held_out(name) else train)[name] = data.decode("utf-8")
    if bad:
        raise SystemExit(
            f"corpus mismatch: {len(bad)} pinned files differ or are missing in {stdlib_dir()} "
            f"(e.g. {bad[:3]}); the model is pinned to {CORPUS_LIST.read_text().splitlines()[0]}"
        )
    return train, held


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Every document starts with BOS in training; prompts get it too.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def bits_per_byte(model, ids: list[int], text_bytes: int, window: int = SEQ_LEN) -> float:
    """Negative log-likelihood of ids[1:] given their prefixes (in windows), in bits per byte."""
    import torch

    total = 0.0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start: start + window + 1]
            x = torch.tensor([chunk[:-1]])
            y = torch.tensor([chunk[1:]])
            logits = model(x).logits.float()
            total += torch.nn.functional.cross_entropy(logits[0], y[0], reduction="sum").item()
    return total / math.log(2) / text_bytes


def probe_text(held: dict[str, str]) -> tuple[str, str]:
    """The fixed held-out passage the served model is checked against."""
    name = sorted(held)[0]
    return name, held[name][:900]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a few steps on a slice: for the test suite")
    ap.add_argument("--pin-corpus", action="store_true", help="rewrite corpus.tsv from this interpreter")
    args = ap.parse_args(argv)

    if args.pin_corpus:
        write_corpus_list()
        return 0

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    train, held = load_corpus()
    if args.smoke:
        train = dict(list(sorted(train.items()))[:4])
        held = dict(list(sorted(held.items()))[:1])
        args.steps, args.batch = 3, 2
    t0 = time.time()
    vocab = ARCH["vocab_size"] if not args.smoke else 512
    tok = train_tokenizer([train[k] for k in sorted(train)], vocab)
    bos_id = tok.token_to_id(BOS)

    stream: list[int] = []
    for name in sorted(train):
        stream.extend(tok.encode(train[name]).ids)  # starts with BOS
    data = torch.tensor(stream, dtype=torch.long)
    print(f"corpus: {len(train)} train files, {len(held)} held out, {len(stream)} training tokens", flush=True)

    arch = dict(ARCH, vocab_size=tok.get_vocab_size(), bos_token_id=bos_id, eos_token_id=bos_id)
    config = LlamaConfig(**arch, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    random_init = LlamaForCausalLM(config)
    random_init.load_state_dict(model.state_dict())
    random_init.eval()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 30)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - SEQ_LEN - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[s: s + SEQ_LEN + 1] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}/{args.steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()

    # Held-out evaluation: trained, random init, unigram.
    held_ids = {k: tok.encode(v).ids for k, v in held.items()}
    held_bytes = sum(len(v.encode()) for v in held.values())
    ids_all = [i for k in sorted(held_ids) for i in held_ids[k]]

    def corpus_bpb(m) -> float:
        return sum(bits_per_byte(m, held_ids[k], 1) for k in sorted(held_ids)) / held_bytes

    counts = torch.bincount(data, minlength=tok.get_vocab_size()).double() + 1
    logp = torch.log(counts / counts.sum())
    unigram_bpb = -logp[torch.tensor(ids_all)].sum().item() / math.log(2) / held_bytes
    trained_bpb = corpus_bpb(model)
    random_bpb = corpus_bpb(random_init)
    probe_name, probe = probe_text(held)
    probe_ids = tok.encode(probe).ids
    probe_bpb = bits_per_byte(model, probe_ids, len(probe.encode()), window=len(probe_ids))
    print(f"held-out bits/byte: trained {trained_bpb:.3f}, random init {random_bpb:.3f}, unigram {unigram_bpb:.3f}")

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=BOS, pad_token=BOS, unk_token=None,
        model_max_length=ARCH["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # The model card's numbers, machine-readable for the test suite.
    stats = {
        "corpus": f"CPython {sys.version.split()[0]} Lib/*.py (PSF licence), pinned in corpus.tsv",
        "train_files": len(train),
        "held_out_files": sorted(held),
        "training_tokens": len(stream),
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": SEQ_LEN,
        "seed": args.seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "held_out_bpb": {"trained": trained_bpb, "random_init": random_bpb, "unigram": unigram_bpb},
        "probe": {"file": probe_name, "chars": len(probe), "bpb": probe_bpb},
        "train_seconds": round(time.time() - t0),
    }
    (out / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    (out / "README.md").write_text(model_card(stats))
    print(json.dumps(stats, indent=2))
    return 0


def model_card(s: dict) -> str:
    b = s["held_out_bpb"]
    return f"""# servectl-tiny-python

servectl's default model: a {s['parameters']:,}-parameter Llama (4 layers, hidden 128,
2 heads of size 64, vocabulary 2048 byte-level BPE, context 512) trained from
scratch with `python -m training.train_default_model` (seed {s['seed']}).

- Corpus: {s['corpus']}. {s['train_files']} files for training
  ({s['training_tokens']:,} tokens); held out, never trained on: {', '.join(s['held_out_files'])}.
- Licence: the weights are derived from Python Software Foundation
  Licence material; they are distributed under the same terms.
- Training: {s['steps']} steps of {s['batch']}×{s['seq_len']} tokens, AdamW, cosine
  schedule, {s['train_seconds']} s on the machine that built it.

## Held-out loss (bits per byte, lower is better)

| model | bits/byte |
|---|---|
| this model | {b['trained']:.3f} |
| same architecture, random init | {b['random_init']:.3f} |
| unigram over the training tokens | {b['unigram']:.3f} |

Probe passage (first {s['probe']['chars']} characters of `{s['probe']['file']}`),
scored the way the test suite scores the served model through `echo` +
`logprobs`: {s['probe']['bpb']:.3f} bits/byte.

It continues `def ` or `import ` with Python-looking code; it knows nothing
else. The chat template is ChatML; the model never saw it in training.
"""


if __name__ == "__main__":
    sys.exit(main())
