"""Make servectl/model/classify: the default model with a trained two-class head (issue 33).

    python -m training.train_classifier          # ~1 minute on 2 cores

`vllm serve --runner pooling --convert classify` on a model without a `score`
head gives it an uninitialised one (each start classifies differently). This
keeps the default model's weights and adds `score.weight`, a logistic
regression on the last token's final hidden state (what vLLM's classify pooler
reads: LAST pooling, then the head, then softmax), trained to tell a Python
definition (`def` / `class`) from any other line. Labels: `other`, `definition`.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "servectl" / "model" / "default"
OUT = ROOT / "servectl" / "model" / "classify"
NAMES = ["foo", "bar", "load", "parse", "run", "main", "helper", "value", "items", "config", "reader", "Model",
         "Client", "Server", "Point", "Tree", "step", "size", "data", "cache"]


def samples(rng: random.Random, n: int) -> list[tuple[str, int]]:
    out = []
    for _ in range(n):
        a, b = rng.choice(NAMES), rng.choice(NAMES)
        if rng.random() < 0.5:
            text = rng.choice([f"def {a.lower()}({b.lower()}):", f"def {a.lower()}(self, {b.lower()}=None):",
                               f"class {a.title()}({b.title()}):", f"class {a.title()}:",
                               f"async def {a.lower()}():"])
            out.append((text, 1))
        else:
            text = rng.choice([f"import {a.lower()}", f"from {a.lower()} import {b.lower()}",
                               f"{a.lower()} = {b.lower()}()", f"print({a.lower()})", f"return {a.lower()}",
                               f"{a.lower()}.{b.lower()}({rng.randint(0, 99)})", f"if {a.lower()}:",
                               f"for {a.lower()} in {b.lower()}:"])
            out.append((text, 0))
    return out


def main() -> int:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, LlamaModel

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(SRC)
    base = LlamaModel.from_pretrained(SRC, torch_dtype=torch.float32).eval()
    rng = random.Random(0)
    train, held = samples(rng, 1200), samples(rng, 300)

    def features(rows):
        feats = []
        with torch.no_grad():
            for text, _ in rows:
                ids = torch.tensor([tok(text)["input_ids"]])
                feats.append(base(input_ids=ids).last_hidden_state[0, -1])
        return torch.stack(feats), torch.tensor([label for _, label in rows])

    x, y = features(train)
    hx, hy = features(held)
    head = torch.nn.Linear(x.shape[1], 2, bias=False)
    opt = torch.optim.Adam(head.parameters(), lr=0.05)
    for _ in range(400):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(x), y)
        loss.backward()
        opt.step()
    accuracy = (head(hx).argmax(-1) == hy).float().mean().item()
    print(f"held-out accuracy {accuracy:.3f} (loss {loss.item():.3f})")

    if OUT.exists():
        shutil.rmtree(OUT)
    shutil.copytree(SRC, OUT, ignore=shutil.ignore_patterns("training_stats.json", "README.md",
                                                            "generation_config.json"))
    weights = load_file(SRC / "model.safetensors")
    weights["score.weight"] = head.weight.detach().clone().contiguous()
    save_file(weights, OUT / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((SRC / "config.json").read_text())
    config.update(architectures=["LlamaForSequenceClassification"], num_labels=2,
                  id2label={"0": "other", "1": "definition"}, label2id={"other": 0, "definition": 1})
    (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (OUT / "training_stats.json").write_text(json.dumps({"held_out_accuracy": round(accuracy, 3),
                                                          "train": len(train), "held_out": len(held)}) + "\n")
    (OUT / "README.md").write_text(
        "# classify\n\nThe bundled default model (`servectl/model/default`) with a two-class head "
        "(`score.weight`), made by `python -m training.train_classifier`: it tells a Python definition "
        "(`def` / `class`, label `definition`) from any other line (`other`); held-out accuracy "
        f"{accuracy:.1%}. Serve it with `engine_args = {{ runner = \"pooling\" }}` (vLLM sees "
        "`LlamaForSequenceClassification`) and ask `/classify`.\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
