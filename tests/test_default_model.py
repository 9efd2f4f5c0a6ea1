"""Issue 8: the default model has learned something, and the server loads it."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.fixture(scope="module")
def stats(model_dir):
    return json.loads((model_dir / "training_stats.json").read_text())


@pytest.mark.unit  # files only
def test_model_card_figures(stats, model_dir):
    b = stats["held_out_bpb"]
    assert b["trained"] < b["unigram"] < b["random_init"]
    assert (model_dir / "README.md").read_text().count(f"{b['trained']:.3f}") >= 1
    assert (model_dir / "model.safetensors").stat().st_size <= 8 * 1024 * 1024
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64


def probe(model_dir, stats) -> str:
    name = stats["probe"]["file"]
    sys.path.insert(0, str(ROOT))
    from training.train_default_model import load_corpus

    _, held = load_corpus()
    text = held[name][: stats["probe"]["chars"]]
    assert name in stats["held_out_files"]
    return text


def test_served_model_scores_held_out_text_like_the_card(daemon, model_dir, stats):
    text = probe(model_dir, stats)
    r = daemon.openai().completions.create(model="default", prompt=text, max_tokens=1, echo=True, logprobs=0,
                                           temperature=0)
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert lp.token_logprobs[0] is None
    nll = -sum(lp.token_logprobs[1:n_prompt])
    served_bpb = nll / math.log(2) / len(text.encode())
    card_bpb = stats["probe"]["bpb"]
    # The engine may run in bf16 where training evaluated fp32: a small tolerance.
    assert abs(served_bpb - card_bpb) / card_bpb < 0.05, (served_bpb, card_bpb)

    # The same architecture at random init, computed here, is far away.
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    random_model = LlamaForCausalLM(LlamaConfig.from_pretrained(model_dir)).eval()
    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    assert len(ids) == n_prompt
    with torch.no_grad():
        logits = random_model(torch.tensor([ids])).logits[0, :-1].float()
    random_nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
    random_bpb = random_nll / math.log(2) / len(text.encode())
    assert random_bpb > 1.5 * served_bpb, (random_bpb, served_bpb)


def test_continues_python(daemon):
    r = daemon.openai().completions.create(model="default", prompt="def ", max_tokens=48, temperature=0)
    text = r.choices[0].text
    assert "(" in text and ":" in text, text
    r = daemon.openai().completions.create(model="default", prompt="import ", max_tokens=24, temperature=0)
    assert r.choices[0].text.split()[0].replace(",", "").isidentifier(), r.choices[0].text


def test_training_script_smoke(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run([sys.executable, "-m", "training.train_default_model", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
                 "generation_config.json", "README.md", "training_stats.json"):
        assert (out / name).exists(), name
    st = json.loads((out / "training_stats.json").read_text())
    assert st["steps"] == 3 and math.isfinite(st["held_out_bpb"]["trained"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
