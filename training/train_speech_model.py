"""Train servectl's bundled speech model: a tiny Whisper that transcribes spoken digits.

The audio is synthesised with Debian's ``espeak-ng`` (English and German voices,
seeded choice of voice variant, speed, pitch, word gap, leading silence, gain
and noise). The targets are digit WORDS so that transcription and translation
differ and can both be checked:

* English audio, ``<|en|><|transcribe|>``  -> ``three one four``
* German audio,  ``<|de|><|transcribe|>``  -> ``drei eins vier``
* either audio,  ``<|translate|>``         -> ``three one four`` (English)

The decoder prompt is exactly the one vLLM 0.32 sends
(``WhisperForConditionalGeneration.get_generation_prompt``):
``<|startoftranscript|><|xx|><|task|><|notimestamps|>``; for
``response_format=verbose_json`` vLLM swaps ``<|notimestamps|>`` for
``<|0.00|>`` and the model then ends the text with an end-time token
(``<|1.84|>``), which vLLM turns into one segment. The language token after
``<|startoftranscript|>`` is trained too, so vLLM's language auto-detection
(a request without ``language``) answers ``en`` or ``de``.

Digit strings whose hash falls in the held-out bucket are never trained on;
the model card reports exact-match accuracy on freshly synthesised held-out
utterances (another seed).

Usage (the bundled model is two stages, about 30 minutes on one core)::

    python -m training.train_speech_model --out /tmp/stage1 --seed 1234
    python -m training.train_speech_model --out servectl/model/speech --init-from /tmp/stage1 --seed 4321
    python -m training.train_speech_model --out /tmp/s --smoke            # half a minute
    python -m training.train_speech_model --check-served http://127.0.0.1:18431/v1   # score a server
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import random
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "servectl" / "model" / "speech"

SR = 16_000
# vLLM takes the clip length (and so the encoder length) from the feature
# extractor: max_audio_clip_s = chunk_length, num_audio_tokens =
# max_source_positions. 10 s windows (1000 mel frames, 500 encoder positions)
# instead of Whisper's 30 s cost a sixth of the training compute; longer audio
# is split by vLLM into 10 s chunks.
CHUNK_S = 10
N_FRAMES = CHUNK_S * SR // 160
ARCH = dict(
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=2,  # head size 32: vLLM's CPU attention has a kernel for it
    decoder_attention_heads=2,
    encoder_ffn_dim=256,
    decoder_ffn_dim=256,
    num_mel_bins=80,
    max_source_positions=N_FRAMES // 2,
    max_target_positions=64,
)
TIME_PRECISION = 0.02
N_TIMESTAMPS = int(CHUNK_S / TIME_PRECISION) + 1  # <|0.00|> .. <|10.00|>

WORDS = {
    "en": ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"],
    "de": ["null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun"],
}
VARIANTS = ["", "+m1", "+m2", "+m3", "+m4", "+m5", "+m6", "+m7", "+f1", "+f2", "+f3", "+f4", "+f5", "+croak", "+klatt", "+klatt2", "+klatt3"]
VOICES = {"en": ["en", "en-us", "en-gb-x-rp"], "de": ["de"]}


def lang_codes() -> list[str]:
    """The languages vLLM's Whisper validates and auto-detects over (all need a token)."""
    from vllm.model_executor.models.whisper_utils import ISO639_1_SUPPORTED_LANGS

    return list(ISO639_1_SUPPORTED_LANGS)


def held_out(digits: str) -> bool:
    """One digit string in eight (of two or more digits) is never trained on."""
    return len(digits) >= 2 and int(hashlib.sha256(digits.encode()).hexdigest(), 16) % 8 == 0


def sample_digits(rng: random.Random, want_held_out: bool) -> str:
    while True:
        n = rng.choice([1, 2, 3, 3, 4, 4, 5, 5, 6])
        s = "".join(rng.choice("0123456789") for _ in range(n))
        if held_out(s) == want_held_out:
            return s


def words(digits: str, lang: str) -> str:
    return " ".join(WORDS[lang][int(c)] for c in digits)


# ----------------------------------------------------------------------------- audio


def espeak(text: str, voice: str, speed: int, pitch: int, gap: int) -> np.ndarray:
    wav = subprocess.run(
        ["espeak-ng", "--stdout", "-v", voice, "-s", str(speed), "-p", str(pitch), "-g", str(gap), text],
        check=True,
        capture_output=True,
    ).stdout
    with wave.open(io.BytesIO(wav)) as w:
        sr = w.getframerate()
        y = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32) / 32768.0
    from scipy.signal import resample_poly

    g = math.gcd(SR, sr)
    return resample_poly(y, SR // g, sr // g).astype(np.float32)


def utterance(rng: random.Random, lang: str, digits: str) -> dict:
    """One synthesised utterance at 16 kHz with its metadata."""
    voice = rng.choice(VOICES[lang]) + rng.choice(VARIANTS)
    speed, pitch, gap = rng.randint(120, 220), rng.randint(20, 80), rng.randint(0, 6)
    y = espeak(words(digits, lang), voice, speed, pitch, gap)
    nz = np.nonzero(np.abs(y) > 0.01)[0]
    y = y[nz[0] : nz[-1] + 1] if len(nz) else y
    lead = rng.uniform(0.0, 1.5)
    tail = rng.uniform(0.05, 0.5)
    y = np.concatenate([np.zeros(int(lead * SR), np.float32), y, np.zeros(int(tail * SR), np.float32)])
    y = y * rng.uniform(0.3, 1.0)
    noise = rng.choice([0.0, 0.0, 0.001, 0.003, 0.01])
    if noise:
        y = y + np.random.default_rng(rng.getrandbits(32)).normal(0, noise, len(y)).astype(np.float32)
    y = y[: CHUNK_S * SR]
    end = min(lead + (len(nz) and (nz[-1] - nz[0] + 1)) / SR, CHUNK_S)
    return dict(audio=y, lang=lang, digits=digits, voice=voice, speed=speed, pitch=pitch, gap=gap, end=end)


def make_set(seed: int, n: int, want_held_out: bool) -> list[dict]:
    rng = random.Random(seed)
    return [utterance(rng, "en" if i % 2 == 0 else "de", sample_digits(rng, want_held_out)) for i in range(n)]


# ------------------------------------------------------------------------- tokenizer


def build_tokenizer():
    """A byte-level BPE over the digit words plus Whisper's special tokens, no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from tokenizers import AddedToken
    from transformers import WhisperTokenizer

    corpus = []
    for lang in WORDS:
        corpus += [" ".join(WORDS[lang])] * 4 + [" ".join(reversed(WORDS[lang]))] * 4
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, min_frequency=1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(corpus, trainer)
    state = json.loads(bpe.to_str())
    vocab, merges = state["model"]["vocab"], state["model"]["merges"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]

    tok = WhisperTokenizer(vocab=vocab, merges=merges)
    specials = ["<|endoftext|>", "<|startoftranscript|>"]
    specials += [f"<|{c}|>" for c in lang_codes()]
    specials += ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|nospeech|>", "<|notimestamps|>"]
    timestamps = [f"<|{i * TIME_PRECISION:.2f}|>" for i in range(N_TIMESTAMPS)]
    for t in specials + timestamps:  # one at a time: ids follow this order exactly
        tok.add_tokens([AddedToken(t, special=True, normalized=False)], special_tokens=True)
    # Whisper's own tokenizer lists these (not the timestamps) as special: HF's
    # timestamp decoding takes all_special_ids[-1] + 1 as <|0.00|>.
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.model_max_length = ARCH["max_target_positions"]
    # ids are contiguous and the timestamps come last (vLLM's verbose_json
    # treats every id >= <|0.00|> as a timestamp)
    assert tok.convert_tokens_to_ids("<|0.00|>") == tok.convert_tokens_to_ids("<|notimestamps|>") + 1
    assert tok.convert_tokens_to_ids(timestamps[-1]) == len(tok) - 1
    return tok


# ----------------------------------------------------------------------------- model


def build_model(tok):
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    sot = tok.convert_tokens_to_ids("<|startoftranscript|>")
    cfg = WhisperConfig(
        vocab_size=len(tok),
        **ARCH,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        begin_suppress_tokens=None,
        suppress_tokens=None,
        tie_word_embeddings=True,
        scale_embedding=False,
        dropout=0.0,
    )
    torch.manual_seed(0)
    return WhisperForConditionalGeneration(cfg)


def decoder_sequence(tok, lang: str, task: str, text: str, timestamps: bool, end: float) -> tuple[list[int], list[int]]:
    """(input ids, loss mask per predicted position) in vLLM's prompt layout."""
    last = "<|0.00|>" if timestamps else "<|notimestamps|>"
    prompt = tok.encode(f"<|startoftranscript|><|{lang}|><|{task}|>{last}", add_special_tokens=False)
    body = tok.encode(text, add_special_tokens=False)
    if timestamps:
        body.append(tok.convert_tokens_to_ids(f"<|{round(end / TIME_PRECISION) * TIME_PRECISION:.2f}|>"))
    body.append(tok.convert_tokens_to_ids("<|endoftext|>"))
    ids = prompt + body
    # position i predicts ids[i+1]; learn the language token (auto-detection)
    # and everything after the prompt.
    mask = [0] * (len(ids) - 1)
    mask[0] = 1
    for i in range(len(prompt) - 1, len(ids) - 1):
        mask[i] = 1
    return ids, mask


def features(fe, audios: list[np.ndarray]) -> np.ndarray:
    out = fe(audios, sampling_rate=SR, return_tensors="np", truncation=True, padding="max_length")
    return out["input_features"].astype(np.float16)


def greedy(model, tok, feats, lang: str, task: str, timestamps: bool = False, max_new: int = 24):
    """Batched greedy decoding with the same prompt vLLM sends; returns token lists."""
    import torch

    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    last = "<|0.00|>" if timestamps else "<|notimestamps|>"
    prompt = tok.encode(f"<|startoftranscript|><|{lang}|><|{task}|>{last}", add_special_tokens=False)
    with torch.no_grad():
        enc = model.model.encoder(torch.as_tensor(feats, dtype=torch.float32)).last_hidden_state
        ids = torch.tensor([prompt] * len(feats))
        done = torch.zeros(len(feats), dtype=torch.bool)
        for _ in range(max_new):
            logits = model(encoder_outputs=(enc,), decoder_input_ids=ids).logits[:, -1]
            nxt = logits.argmax(-1)
            nxt[done] = eot
            ids = torch.cat([ids, nxt[:, None]], 1)
            done |= nxt == eot
            if done.all():
                break
    out = []
    for row in ids[:, len(prompt) :].tolist():
        out.append(row[: row.index(eot)] if eot in row else row)
    return out


def detect_language(model, tok, feats) -> list[str]:
    import torch

    sot = tok.convert_tokens_to_ids("<|startoftranscript|>")
    codes = lang_codes()
    lang_ids = torch.tensor(tok.convert_tokens_to_ids([f"<|{c}|>" for c in codes]))
    with torch.no_grad():
        enc = model.model.encoder(torch.as_tensor(feats, dtype=torch.float32)).last_hidden_state
        logits = model(encoder_outputs=(enc,), decoder_input_ids=torch.full((len(feats), 1), sot)).logits[:, -1]
    return [codes[i] for i in logits[:, lang_ids].argmax(-1).tolist()]


def evaluate(model, tok, utts, feats) -> dict:
    ts_begin = tok.convert_tokens_to_ids("<|0.00|>")
    res = {}
    langs = sorted({u["lang"] for u in utts})
    for lang in langs:
        idx = [i for i, u in enumerate(utts) if u["lang"] == lang]
        f = feats[idx]
        for task in ("transcribe", "translate"):
            outs = greedy(model, tok, f, lang, task)
            want_lang = lang if task == "transcribe" else "en"
            ok = [tok.decode(o, skip_special_tokens=True).strip() == words(utts[i]["digits"], want_lang) for o, i in zip(outs, idx)]
            res[f"{lang}_{task}_exact"] = sum(ok) / len(ok)
            if task == "transcribe":
                res[f"{lang}_examples"] = [
                    dict(digits=utts[i]["digits"], voice=utts[i]["voice"], got=tok.decode(o, skip_special_tokens=True)) for o, i in list(zip(outs, idx))[:4]
                ]
        outs = greedy(model, tok, f, lang, "transcribe", timestamps=True)
        ok, errs = 0, []
        for o, i in zip(outs, idx):
            text = tok.decode([t for t in o if t < ts_begin], skip_special_tokens=True).strip()
            ok += text == words(utts[i]["digits"], lang)
            ts = [t for t in o if t >= ts_begin]
            if ts:
                errs.append(abs((ts[-1] - ts_begin) * TIME_PRECISION - utts[i]["end"]))
        res[f"{lang}_timestamps_text_exact"] = ok / len(idx)
        res[f"{lang}_end_time_mae_s"] = float(np.mean(errs)) if errs else None
        det = detect_language(model, tok, f)
        res[f"{lang}_language_detect"] = sum(d == lang for d in det) / len(det)
    res["n"] = len(utts)
    return res


def save_support_files(out: Path, tok, fe) -> None:
    """Tokenizer, processor, feature extractor and generation config (no weights)."""
    from transformers import GenerationConfig, WhisperProcessor

    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    GenerationConfig(
        decoder_start_token_id=tok.convert_tokens_to_ids("<|startoftranscript|>"),
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        max_length=ARCH["max_target_positions"],
        # what transformers' WhisperForConditionalGeneration.generate looks up
        is_multilingual=True,
        no_timestamps_token_id=tok.convert_tokens_to_ids("<|notimestamps|>"),
        lang_to_id={f"<|{c}|>": tok.convert_tokens_to_ids(f"<|{c}|>") for c in lang_codes()},
        task_to_id={t: tok.convert_tokens_to_ids(f"<|{t}|>") for t in ("transcribe", "translate")},
    ).save_pretrained(out)
    WhisperProcessor(feature_extractor=fe, tokenizer=tok).save_pretrained(out)
    fe.save_pretrained(out)  # preprocessor_config.json too, for loaders that look for it


def check_served(base_url: str, model: str, n: int, seed: int) -> dict:
    """Send fresh held-out utterances (WAV, 16 kHz) to a running server through the
    openai SDK, greedy; count exact matches for transcription and translation."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none")
    utts = make_set(seed, n, want_held_out=True)
    counts: dict[str, list[int]] = {}
    t0 = time.time()
    for u in utts:
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(SR)
            w.writeframes((np.clip(u["audio"], -1, 1) * 32767).astype(np.int16).tobytes())
        data = buf.getvalue()
        lang = u["lang"]
        checks = {
            f"{lang}_transcribe": (dict(language=lang), "transcriptions", words(u["digits"], lang)),
            f"{lang}_transcribe_autodetect": ({}, "transcriptions", words(u["digits"], lang)),
            f"{lang}_translate": ({}, "translations", words(u["digits"], "en")),
        }
        for key, (extra, route, want) in checks.items():
            api = getattr(client.audio, route)
            r = api.create(model=model, file=("u.wav", data, "audio/wav"), temperature=0, **extra)
            counts.setdefault(key, []).append(int(r.text.strip() == want))
    res = {k: sum(v) / len(v) for k, v in counts.items()}
    res["n_per_language"] = n // 2
    res["seconds_per_request"] = (time.time() - t0) / (3 * n)
    return res


def make_feature_extractor():
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=80, sampling_rate=SR, hop_length=160, chunk_length=CHUNK_S, n_fft=400)


# ------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--train-utts", type=int, default=None)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--init-from", type=Path, help="continue from these weights (a second stage on new audio)")
    ap.add_argument("--check-served", metavar="BASE_URL", help="e.g. http://127.0.0.1:18431/v1: score a running server on fresh held-out audio")
    ap.add_argument("--served-model", default="speech")
    ap.add_argument("--support-files-only", action="store_true", help="rewrite tokenizer/processor/generation config in --out, keep the weights")
    args = ap.parse_args(argv)

    import torch
    if args.check_served:
        print(json.dumps(check_served(args.check_served, args.served_model, 8 if args.smoke else 100, args.seed + 2_000_003), indent=1))
        return 0
    if args.support_files_only:
        save_support_files(args.out, build_tokenizer(), make_feature_extractor())
        return 0

    torch.set_num_threads(1)
    random.seed(args.seed)
    np.random.seed(args.seed)
    t0 = time.time()

    n_train = args.train_utts or (200 if args.smoke else 4000)
    n_test = 40 if args.smoke else 400
    steps = args.steps or (30 if args.smoke else 2200)
    batch = args.batch
    lr = args.lr

    tok = build_tokenizer()
    fe = make_feature_extractor()
    model = build_model(tok)
    if args.init_from:
        from safetensors.torch import load_file

        missing, unexpected = model.load_state_dict(load_file(str(args.init_from / "model.safetensors")), strict=False)
        assert not unexpected and all("proj_out" in m for m in missing), (missing, unexpected)
        model.tie_weights()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tok)}, parameters {n_params}", flush=True)

    train = make_set(args.seed, n_train, want_held_out=False)
    test = make_set(args.seed + 1_000_003, n_test, want_held_out=True)
    print(f"synthesised {len(train)}+{len(test)} utterances in {time.time() - t0:.0f}s", flush=True)
    ftrain = np.concatenate([features(fe, [u["audio"] for u in train[i : i + 64]]) for i in range(0, len(train), 64)])
    ftest = np.concatenate([features(fe, [u["audio"] for u in test[i : i + 64]]) for i in range(0, len(test), 64)])
    t_data = time.time() - t0
    print(f"features done at {t_data:.0f}s", flush=True)

    ftrain_t = torch.from_numpy(ftrain)
    rng = random.Random(args.seed + 7)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))
    )
    model.train()
    t1 = time.time()
    losses = []
    for step in range(steps):
        idx = [rng.randrange(len(train)) for _ in range(batch)]
        seqs, masks = [], []
        for i in idx:
            u = train[i]
            task = "translate" if rng.random() < 0.35 else "transcribe"
            out_lang = "en" if task == "translate" else u["lang"]
            ids, mask = decoder_sequence(tok, u["lang"], task, words(u["digits"], out_lang), rng.random() < 0.3, u["end"])
            seqs.append(ids)
            masks.append(mask)
        L = max(len(s) for s in seqs)
        pad = tok.convert_tokens_to_ids("<|endoftext|>")
        inp = torch.tensor([s[:-1] + [pad] * (L - len(s)) for s in seqs])
        tgt = torch.tensor([s[1:] + [pad] * (L - len(s)) for s in seqs])
        msk = torch.tensor([m + [0] * (L - 1 - len(m)) for m in masks], dtype=torch.float32)
        x = ftrain_t[idx].float()
        # light SpecAugment-style time masking
        for b in range(batch):
            if rng.random() < 0.5:
                s0 = rng.randrange(0, N_FRAMES - 20)
                x[b, :, s0 : s0 + rng.randint(2, 10)] = x[b].min()
        logits = model(input_features=x, decoder_input_ids=inp).logits
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), reduction="none")
        loss = (ce * msk.reshape(-1)).sum() / msk.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step} loss {np.mean(losses[-100:]):.4f} t={time.time() - t1:.0f}s", flush=True)
    train_s = time.time() - t1

    model.eval()
    res = evaluate(model, tok, test, ftest)
    print(json.dumps(res, indent=1), flush=True)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    save_support_files(out, tok, fe)
    stats = dict(
        data="espeak-ng digit strings, English and German voices (synthesised at train time, seeded)",
        seed=args.seed,
        init_from=str(args.init_from) if args.init_from else None,
        train_utterances=len(train),
        held_out_utterances=len(test),
        held_out_rule="digit strings of >= 2 digits with sha256 % 8 == 0, never trained on; held-out audio from seed+1000003",
        steps=steps,
        batch=batch,
        lr=lr,
        parameters=n_params,
        vocab_size=len(tok),
        arch=ARCH,
        chunk_length_s=CHUNK_S,
        final_train_loss=float(np.mean(losses[-50:])),
        held_out=res,
        data_seconds=round(t_data),
        train_seconds=round(train_s),
        total_seconds=round(time.time() - t0),
        smoke=args.smoke,
    )
    (out / "training_stats.json").write_text(json.dumps(stats, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out} in {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
