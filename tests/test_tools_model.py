"""The bundled tool-calling model (servectl/model/tools): its card, its training script, the
parsers vLLM serves it with (that the wheel ships it: test_install.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

TOOLS_DIR = ROOT / "servectl" / "model" / "tools"
SHIPPED = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
           "chat_template.jinja", "README.md", "training_stats.json")
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
        "<tools>", "</tools>", "<|im_start|>", "<|im_end|>")


@pytest.mark.unit  # files only
def test_tools_model_card_figures():
    stats = json.loads((TOOLS_DIR / "training_stats.json").read_text())
    assert not stats["smoke"]
    ev = stats["held_out_eval"]
    # The card shows the held-out figures the script measured (the 90 % aim is not met yet: the
    # card says so; see its Status line).
    card = (TOOLS_DIR / "README.md").read_text()
    for key in ("tool_call", "parallel_call", "no_tool_decision", "copies_result"):
        r = ev[key]
        assert r["total"] > 0 and f"| {r['correct']}/{r['total']} | {100 * r['rate']:.1f} % |" in card, key
        assert (r["rate"] < 0.9) == (f"`{key}`" in card.split("\n\n", 2)[1]), key
    assert ev["reasoning_present"]["rate"] >= 0.9, ev
    cfg = json.loads((TOOLS_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["head_dim"] == 64
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    assert cfg["max_position_embeddings"] == 2048 and cfg["tie_word_embeddings"]
    assert (TOOLS_DIR / "model.safetensors").stat().st_size <= 16 * 1024 * 1024
    # The tags are single ids; <|im_end|> ends generation.
    vocab = json.loads((TOOLS_DIR / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    assert all(t in added for t in TAGS), sorted(added)
    gen = json.loads((TOOLS_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == added["<|im_end|>"]
    assert json.loads((TOOLS_DIR / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def test_tools_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOOLS_DIR)
    assert tok.chat_template == (TOOLS_DIR / "chat_template.jinja").read_text()
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "weather in Paris and Rome"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
            {"role": "tool", "tool_call_id": "a", "content": "sunny"},
            {"role": "tool", "tool_call_id": "b", "content": "rain"}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "\n<tools>\nget_weather(city)\n</tools><|im_end|>\n" in text  # each tool as its signature
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n') in text
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in text


@pytest.mark.vllm_unit
def test_vllm_parsers_accept_the_tokenizer():
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(TOOLS_DIR))
    assert ParserManager.get_parser(tool_parser_name="hermes", reasoning_parser_name="qwen3",
                                    enable_auto_tools=True, tokenizer=tok) is not None


def test_tool_training_script_smoke(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run([sys.executable, "-m", "training.train_tool_model", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in SHIPPED:
        assert (out / name).exists(), name
    st = json.loads((out / "training_stats.json").read_text())
    assert st["steps"] == 3 and st["smoke"] and "tool_call" in st["held_out_eval"]
