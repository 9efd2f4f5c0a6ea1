"""LoRA adapters' pure parts (issue 34): the `lora_modules` key, which model a change goes to,
the reason a refused adapter is given, the wire's messages and the audit record (no daemon, no
vLLM)."""

from __future__ import annotations

import msgspec
import pytest
from click.testing import CliRunner

from builders import config_error, config_from
from engine_core.chat_parsing import run_to_end
from engine_core.loras import reason
from manager.audit import CHANGING, Peer, audit_record
from manager.loras import Candidate, Refusal, lora_target
from servectl import config as C
from servectl.wire import control as P
from servectl.wire import status as WS
from servectl.wire.spawn import EngineSpec
from servectl.wire.vocab import ModelState

pytestmark = pytest.mark.unit

LORA_ARGS = "[models.engine_args]\nenable_lora = true\n"


MODEL = '[[models]]\nname = "base"\nmodel = "/m"\n'


@pytest.mark.parametrize("form", [
    'lora_modules = { sql = "/a/sql", code = "/a/code" }\n',
    'lora_modules = ["sql=/a/sql", "code=/a/code"]\n',
    'lora_modules = [{ name = "sql", path = "/a/sql" }, { name = "code", path = "/a/code" }]\n',
    'lora_modules = ["sql=/a/sql", { name = "code", path = "/a/code" }]\n',
])
def test_every_form_of_lora_modules_is_one_list(tmp_path, form):
    cfg = config_from(tmp_path, MODEL + form + LORA_ARGS)
    assert cfg.models[0].lora_modules == [C.LoraModule(name="sql", path="/a/sql"),
                                          C.LoraModule(name="code", path="/a/code")]
    # what finalize made survives the round trip the manager's spec takes (JSON, re-validated)
    again = C.decode(C.encode(cfg))
    assert again.models[0].lora_modules == cfg.models[0].lora_modules
    assert C.apply_overrides(cfg, C.Overrides()).models[0].lora_modules == cfg.models[0].lora_modules


def test_base_model_name_is_kept(tmp_path):
    cfg = config_from(tmp_path, MODEL + 'lora_modules = [{ name = "a", path = "/p", base_model_name = "base" }]\n'
               + LORA_ARGS)
    assert cfg.models[0].lora_modules[0].base_model_name == "base"


@pytest.mark.parametrize("form, words", [
    ('lora_modules = ["sql"]\n', ["lora_modules[0]", "name=path"]),
    ('lora_modules = ["sql="]\n', ["lora_modules[0]", "name=path"]),
    ('lora_modules = [{ name = "a" }]\n', ["lora_modules", "path"]),
    ('lora_modules = { "bad name" = "/p" }\n', ["lora_modules[0]", "name"]),
    ('lora_modules = [{ name = "a", path = "/p", rank = 8 }]\n', ["rank"]),
])
def test_a_bad_lora_module_names_the_key(tmp_path, form, words):
    text = config_error(tmp_path, MODEL + form + LORA_ARGS)
    assert all(w in text for w in words), text


def test_lora_modules_need_enable_lora(tmp_path):
    text = config_error(tmp_path, MODEL + 'lora_modules = { a = "/p" }\n')
    assert "enable_lora = true" in text and "models.base.lora_modules" in text


def test_an_adapter_name_is_unique_among_models_and_adapters(tmp_path):
    two = MODEL + 'lora_modules = { a = "/p" }\n' + LORA_ARGS + '[[models]]\nname = "other"\nmodel = "/m"\n'
    assert "already model 'base'" in config_error(tmp_path, MODEL + 'lora_modules = { base = "/p" }\n' + LORA_ARGS)
    assert "adapter of model 'base'" in config_error(
        tmp_path, two + 'lora_modules = { a = "/q" }\n' + LORA_ARGS)


def test_lora_modules_is_a_model_key_not_an_engine_argument(tmp_path):
    text = config_error(tmp_path, MODEL + '[models.engine_args]\nlora_modules = ["a=/p"]\n')
    assert "not an engine argument" in text


def test_adapters_are_part_of_what_outputs_depend_on(tmp_path):
    a = config_from(tmp_path, MODEL + 'lora_modules = { a = "/p" }\n' + LORA_ARGS).models[0]
    b = config_from(tmp_path, MODEL + 'lora_modules = { a = "/q" }\n' + LORA_ARGS).models[0]
    assert C.output_identity(a) != C.output_identity(b)
    assert C.lora_enabled(a) and not C.lora_enabled(C.default_model())


# ---- which model a change goes to -----------------------------------------------------------

def cand(name, enabled=True, state=ModelState.READY, loras=()):
    return Candidate(name, enabled, state, tuple(loras))


def test_the_one_lora_model_is_the_default_target():
    models = [cand("base"), cand("plain", enabled=False)]
    assert lora_target(models, None, "a", loading=True) == "base"
    assert lora_target(models, "base", "a", loading=True) == "base"


def test_several_lora_models_need_a_name():
    r = lora_target([cand("x"), cand("y")], None, "a", loading=True)
    assert isinstance(r, Refusal) and r.status == 400 and "x, y" in r.message


def test_refusals():
    models = [cand("base", loras=["a"]), cand("other", loras=["b"]), cand("plain", enabled=False),
              cand("asleep", state=ModelState.RELEASED)]
    cases = {
        ("nope", "z", True): 404, ("plain", "z", True): 400,  # unknown; no enable_lora
        ("base", "other", True): 400, ("base", "b", True): 400,  # a model's name; another model's adapter
        ("asleep", "z", True): 409, ("base", "z", False): 404,  # not serving; unloading an unknown adapter
    }
    for (model, name, loading), status in cases.items():
        r = lora_target(models, model, name, loading)
        assert isinstance(r, Refusal) and r.status == status, (model, name, r)
    assert lora_target([cand("plain", enabled=False)], None, "a", True).status == 400


def test_an_unload_finds_the_adapter_s_model():
    models = [cand("x", loras=["a"]), cand("y", loras=["b"])]
    assert lora_target(models, None, "b", loading=False) == "y"
    assert lora_target(models, None, "a", loading=True).status == 400  # several LoRA models: name one


def test_a_load_in_place_of_an_adapter_of_the_same_model_is_vllm_s_to_judge():
    assert lora_target([cand("x", loras=["a"])], None, "a", loading=True) == "x"


# ---- the reason a refused adapter is given --------------------------------------------------

def test_reason_keeps_the_exception_lines_without_the_traceback():
    text = ("WorkerCallFailed: worker call add_lora failed: rank 0: ValueError: LoRA rank 64 is greater than "
            "max_lora_rank 8.\nTraceback (most recent call last):\n  File \"x.py\", line 3, in f\n    raise\n"
            "ValueError: LoRA rank 64 is greater than max_lora_rank 8.")
    assert reason(text) == "ValueError: LoRA rank 64 is greater than max_lora_rank 8."
    assert reason("") == "the adapter could not be loaded"
    assert "The above" not in reason("A: x\nThe above exception was the direct cause of the following exception:")


def test_run_to_end_runs_a_coroutine_that_awaits_nothing_pending():
    async def done():
        return 7

    assert run_to_end(done()) == 7

    class Pending:
        def __await__(self):
            yield

    async def waits():
        await Pending()

    with pytest.raises(RuntimeError):
        run_to_end(waits())


# ---- wire, audit, CLI ------------------------------------------------------------------------

def test_the_lora_messages_round_trip():
    lora = C.LoraModule(name="a", path="/p")
    for msg in (P.LoadLora(lora=lora, model="m", load_inplace=True), P.UnloadLora(name="a"),
                P.LoraDone(model="m", incarnation="i", call_id=3, ok=False, status=400, message="no", loras=[lora])):
        assert P.control_in_decoder.decode(P.encoder.encode(msg)) == msg
    for msg in (P.AddLora(call_id=1, lora=lora), P.RemoveLora(call_id=2, name="a")):
        assert P.to_engine_decoder.decode(P.encoder.encode(msg)) == msg
    reply = P.LoraReply(ok=True, status=200, message="ok", model="m", loras=[lora])
    assert P.control_out_decoder.decode(P.encoder.encode(reply)) == reply
    ev = WS.Event(component="model:m", kind="model", model="m", state="ready", pid=1, time=0.0, loras=[lora])
    assert WS.event_decoder.decode(P.encoder.encode(ev)).loras == [lora]
    spec = EngineSpec(model=C.default_model(), runtime_dir="/r", incarnation="i", freezing=True, freeze_grace_s=1,
                      worker_reply_timeout_s=1, loras=[lora])
    assert msgspec.json.decode(msgspec.json.encode(spec), type=EngineSpec).loras == [lora]


def test_lora_changes_are_audited_with_their_caller():
    assert P.LoadLora in CHANGING and P.UnloadLora in CHANGING
    who = P.HttpCaller(key_id="abc", address="127.0.0.1", gateway="gateway:0", route="POST /v1/load_lora_adapter")
    rec = audit_record(0.0, Peer(uid=0, gid=0, pid=1), P.LoadLora(lora=C.LoraModule(name="a", path="/p"),
                                                                       http=who), "accepted")
    assert rec["command"] == "load_lora" and rec["args"]["lora"] == {"name": "a", "path": "/p"}
    assert rec["via"] == "http" and rec["admin_key"] == "abc"


def test_the_cli_has_lora_load_unload_list():
    from servectl.cli import main

    out = CliRunner().invoke(main, ["lora", "--help"]).output
    assert all(verb in out for verb in ("load", "unload", "list"))
    bad = CliRunner().invoke(main, ["lora", "load", "bad name", "/p", "--runtime-dir", "/nonexistent-dir"])
    assert bad.exit_code == 2 and "bad adapter name" in bad.output


def test_a_configured_adapter_path_is_checked_before_anything_starts(tmp_path):
    from servectl.model_check import check_model_paths

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    adapter = tmp_path / "a"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    cfg = config_from(tmp_path, f'[[models]]\nname = "base"\nmodel = "{model}"\nlora_modules = {{ good = "{adapter}", '
                         f'gone = "{tmp_path / "nowhere"}", empty = "{model}" }}\n' + LORA_ARGS)
    problems = check_model_paths(cfg)
    assert len(problems) == 2, problems
    assert "lora_modules.gone" in problems[0] and "does not exist" in problems[0]
    assert "lora_modules.empty" in problems[1] and "adapter_config.json" in problems[1]


def test_the_bundled_adapter_beats_its_base_model_on_held_out_code():
    """Its card's figures (issue 34): held-out loss below the base model's, a prompt from a held-out
    file of its corpus, an adapter vLLM can load (rank and modules)."""
    import json

    lora = C.DEFAULT_MODEL_DIR.parent / "lora" / "vllm-code"
    stats = json.loads((lora / "training_stats.json").read_text())
    bpb = stats["held_out_bpb"]
    assert bpb["adapter"] < bpb["base"] - 0.1, bpb
    from training.train_lora_adapter import is_held_out  # (no torch at import)

    assert is_held_out(stats["prompt_check"]["file"]) and is_held_out(stats["probe"]["file"])
    assert stats["prompt_check"]["first_difference_at_token"] == 0
    config = json.loads((lora / "adapter_config.json").read_text())
    assert config["r"] == 8 and not config["base_model_name_or_path"].startswith("/")
    assert f"{bpb['base']:.3f}" in (lora / "README.md").read_text()
    assert f"{bpb['adapter']:.3f}" in (lora / "README.md").read_text()
    assert (lora / "adapter_model.safetensors").stat().st_size > 100_000


def test_configured_names_and_changes_under_way_are_refused():
    models = [cand("base")]
    r = lora_target(models, None, "later", loading=True, reserved=frozenset({"later"}))
    assert isinstance(r, Refusal) and r.status == 400  # a configured model not served now
    r = lora_target(models, None, "a", loading=True, pending=frozenset({"a"}))
    assert isinstance(r, Refusal) and r.status == 409
    r = lora_target(models, None, "a", loading=False, pending=frozenset({"a"}))
    assert isinstance(r, Refusal) and r.status == 409


def test_pooling_models_take_no_adapters(tmp_path):
    text = config_error(tmp_path, MODEL + 'lora_modules = { a = "/p" }\n[models.engine_args]\nenable_lora = true\n'
                      'runner = "pooling"\n')
    assert "generating models only" in text
    cfg = config_from(tmp_path, MODEL + '[models.engine_args]\nenable_lora = true\nrunner = "pooling"\n')
    assert not C.lora_enabled(cfg.models[0])


def test_a_hub_id_adapter_is_vllm_s_to_resolve():
    from servectl.model_check import adapter_path_problem

    assert adapter_path_problem("org/some-adapter") is None
    assert "does not exist" in adapter_path_problem("/no/such/adapter")
