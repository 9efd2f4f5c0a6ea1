"""Config validation (servectl/config.py), without a daemon.

Every bad file is an error raised before anything starts, and its message
names the key and the file; start options (``Overrides``) are validated the
same way and survive the manager's JSON round trip.
"""

from __future__ import annotations

import msgspec
import pytest

from builders import config_error, config_file
from servectl import config as C

pytestmark = pytest.mark.unit

# An explicit, empty config file (no search of the working directory or /etc).
EMPTY = "/dev/null"
MODEL = "[[models]]\nname = '{name}'\nmodel = '/models/{name}'\n"


# ---- a good file --------------------------------------------------------------------

def test_no_file_serves_the_default_model_with_the_default_engine_args():
    cfg = C.finalize(C.Config())
    assert [(m.name, m.model) for m in cfg.models] == [(C.DEFAULT_MODEL_NAME, str(C.DEFAULT_MODEL_DIR))]
    assert cfg.models[0].engine_args == C.DEFAULT_ENGINE_ARGS
    assert cfg.gateway.port == 8000 and cfg.gateway.host == "127.0.0.1"


def test_a_full_file_is_read_with_every_value(tmp_path):
    path = config_file(tmp_path, """
[gateway]
host = "0.0.0.0"
port = 0
processes = 3
api_keys = ["k1"]

[manager]
backoff_initial_s = 0.5
freeze_grace_s = 0
warm_standby = false

[[models]]
name = "a.b-c_d"
model = "/models/a"
tensor_parallel_size = 2
devices = "0,1"
crash_loop_count = 7
env = { OMP_NUM_THREADS = "4" }
[models.engine_args]
max_num_seqs = 8
enforce_eager = false
""")
    cfg, found = C.load_config(path)
    assert found == path
    assert (cfg.gateway.host, cfg.gateway.port, cfg.gateway.processes, cfg.gateway.api_keys) == \
        ("0.0.0.0", 0, 3, ["k1"])
    assert (cfg.manager.backoff_initial_s, cfg.manager.freeze_grace_s, cfg.manager.warm_standby) == (0.5, 0, False)
    (m,) = cfg.models
    assert (m.name, m.model, m.tensor_parallel_size, m.devices, m.crash_loop_count, m.env) == \
        ("a.b-c_d", "/models/a", 2, "0,1", 7, {"OMP_NUM_THREADS": "4"})
    # The defaults fill what the file leaves out; what it says wins.
    assert m.engine_args == {**C.DEFAULT_ENGINE_ARGS, "max_num_seqs": 8, "enforce_eager": False}


@pytest.mark.parametrize("port", [0, 1, 65535])
def test_port_bounds_are_accepted(tmp_path, port):
    cfg, _ = C.load_config(config_file(tmp_path, f"[gateway]\nport = {port}\n"))
    assert cfg.gateway.port == port


def test_the_effective_config_survives_the_managers_json_round_trip(tmp_path):
    cfg, _ = C.load_config(config_file(tmp_path, MODEL.format(name="a") + MODEL.format(name="b")
                                 + "[models.engine_args]\nmax_num_seqs = 2\n"))
    assert C.decode(C.encode(cfg)) == cfg
    assert C.decode(C.encode(cfg).decode()) == cfg  # str too (it travels on argv)


# ---- bad files: the message names the key and the file -------------------------------

@pytest.mark.parametrize("text,key,says", [
    ("bogus = 1\n", None, "unknown field `bogus`"),
    ("[gateway]\nprot = 1\n", "gateway", "unknown field `prot`"),
    ("[manager]\nbackof_initial_s = 1\n", "manager", "unknown field `backof_initial_s`"),
    (MODEL.format(name="a") + "moddel = 'x'\n", "models[0]", "unknown field `moddel`"),
    ("[gateway]\nport = 'eighty'\n", "gateway.port", "Expected `int`, got `str`"),
    ("[gateway]\nport = 8000.5\n", "gateway.port", "Expected `int`, got `float`"),
    ("[gateway]\nport = true\n", "gateway.port", "Expected `int`, got `bool`"),
    ("[gateway]\nport = -1\n", "gateway.port", "Expected `int` >= 0"),
    ("[gateway]\nport = 65536\n", "gateway.port", "Expected `int` <= 65535"),
    ("[gateway]\nprocesses = 0\n", "gateway.processes", "Expected `int` >= 1"),
    ("[gateway]\napi_keys = 'k'\n", "gateway.api_keys", "Expected `array`, got `str`"),
    ("[gateway]\nhold_timeout_s = 0\n", "gateway.hold_timeout_s", "Expected `float` > 0"),
    ("[manager]\ncrash_loop_count = 0\n", "manager.crash_loop_count", "Expected `int` >= 1"),
    ("[manager]\nfreeze_grace_s = -1\n", "manager.freeze_grace_s", "Expected `float` >= 0"),
    ("[manager]\nwarm_standby = 'yes'\n", "manager.warm_standby", "Expected `bool`, got `str`"),
    ("[models]\nname = 'a'\n", "models", "Expected `array`, got `object`"),
    ("[[models]]\nname = 'a'\n", "models[0]", "missing required field `model`"),
    ("[[models]]\nmodel = '/x'\n", "models[0]", "missing required field `name`"),
    (MODEL.format(name="a b"), "models[0].name", "matching regex"),
    (MODEL.format(name="a:b"), "models[0].name", "matching regex"),  # ':' separates component names
    (MODEL.format(name="-a"), "models[0].name", "matching regex"),
    (MODEL.format(name="a" * 64), "models[0].name", "matching regex"),
    (MODEL.format(name="a") + MODEL.format(name="b") + "tensor_parallel_size = 0\n",
     "models[1].tensor_parallel_size", "Expected `int` >= 1"),
    (MODEL.format(name="a") + "engine_args = 3\n", "models[0].engine_args", "Expected `object`, got `int`"),
    (MODEL.format(name="a") + "env = { A = 1 }\n", "models[0].env", "Expected `str`, got `int`"),
])
def test_bad_values_name_the_key_and_the_file(tmp_path, text, key, says):
    msg = config_error(tmp_path, text)
    path = tmp_path / "servectl.toml"
    assert msg.startswith(f"config error in {path}: "), msg
    rest = msg.removeprefix(f"config error in {path}: ")
    if key is None:
        assert rest.startswith("Object contains"), msg  # top level: no key path to name
    else:
        assert rest.startswith(f"{key}: ") or rest.startswith(f"{key}[...]: "), msg
    assert says in rest, msg
    assert "$." not in msg  # msgspec's JSON path is turned into a key path


def test_not_toml_names_the_file(tmp_path):
    msg = config_error(tmp_path, "not toml at all [")
    assert msg.startswith(f"config error in {tmp_path / 'servectl.toml'}: not valid TOML"), msg


def test_unreadable_file_names_the_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(C.ConfigError) as exc:
        C.load_config(missing)
    assert str(exc.value) == f"cannot read config {missing}: No such file or directory"
    with pytest.raises(C.ConfigError) as exc:
        C.load_config(tmp_path)
    assert str(exc.value) == f"cannot read config {tmp_path}: Is a directory"


def test_duplicate_model_names_are_named(tmp_path):
    msg = config_error(tmp_path, MODEL.format(name="a") + MODEL.format(name="b") + MODEL.format(name="a")
                     + MODEL.format(name="b") + MODEL.format(name="c"))
    assert msg == f"config error in {tmp_path / 'servectl.toml'}: models: duplicate name(s) ['a', 'b']"


# ---- api_key_file -----------------------------------------------------------------------

def test_api_key_file_keys_join_the_listed_ones_once(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k2\n  k3\tk1\n\nk2\n")
    cfg, _ = C.load_config(config_file(tmp_path, f"[gateway]\napi_keys = ['k1']\napi_key_file = '{keys}'\n"))
    assert cfg.gateway.api_keys == ["k1", "k2", "k3"]


def test_missing_api_key_file_names_the_key_and_the_key_file(tmp_path):
    missing = tmp_path / "no-keys"
    msg = config_error(tmp_path, f"[gateway]\napi_key_file = '{missing}'\n")
    assert "gateway.api_key_file" in msg and str(missing) in msg and "No such file or directory" in msg, msg


def test_missing_api_key_file_names_the_config_file_too(tmp_path):
    msg = config_error(tmp_path, f"[gateway]\napi_key_file = '{tmp_path / 'no-keys'}'\n")
    assert str(tmp_path / "servectl.toml") in msg, msg


# ---- overrides (start options, re-applied on every reload) --------------------------------

def test_overrides_replace_file_values_and_target_the_first_model(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-opt\n")
    path = config_file(tmp_path, "[gateway]\nport = 9000\nhost = '0.0.0.0'\n[manager]\nfreeze_grace_s = 5\n"
                 + MODEL.format(name="a") + "[models.engine_args]\nmax_num_seqs = 8\ndtype = 'float32'\n"
                 + MODEL.format(name="b"))
    ov = C.Overrides(runtime_dir="/rt", state_dir="/st", host="127.0.0.2", port=0, gateways=3, freeze_grace_s=0.0,
                     api_key_file=str(keys), model="/models/other", name="renamed", tensor_parallel_size=2,
                     engine_args={"max_num_seqs": 4})
    cfg, found = C.effective_config(path, ov)
    assert found == path
    assert (cfg.manager.runtime_dir, cfg.manager.state_dir, cfg.manager.freeze_grace_s) == ("/rt", "/st", 0.0)
    assert (cfg.gateway.host, cfg.gateway.port, cfg.gateway.processes) == ("127.0.0.2", 0, 3)
    assert cfg.gateway.api_key_file == str(keys) and cfg.gateway.api_keys == ["sk-opt"]
    first, second = cfg.models
    assert (first.name, first.model, first.tensor_parallel_size) == ("renamed", "/models/other", 2)
    assert first.engine_args == {**C.DEFAULT_ENGINE_ARGS, "max_num_seqs": 4, "dtype": "float32"}
    assert (second.name, second.model, second.tensor_parallel_size) == ("b", "/models/b", 1)
    assert second.engine_args == C.DEFAULT_ENGINE_ARGS


def test_empty_overrides_change_nothing(tmp_path):
    path = config_file(tmp_path, "[gateway]\nport = 9000\n" + MODEL.format(name="a"))
    assert C.effective_config(path, C.Overrides())[0] == C.load_config(path)[0]


def test_overrides_survive_the_managers_json_round_trip():
    ov = C.Overrides(port=0, freeze_grace_s=0.0, name="x", engine_args={"max_num_seqs": 2})
    data = msgspec.json.encode(ov)
    assert msgspec.json.decode(data, type=C.Overrides) == ov
    # Only what was given travels: port 0 and grace 0 are given, not defaults.
    assert msgspec.json.decode(data) == {"port": 0, "freeze_grace_s": 0.0, "name": "x",
                                         "engine_args": {"max_num_seqs": 2}}


@pytest.mark.parametrize("ov,key", [
    (C.Overrides(port=70000), "gateway.port: Expected `int` <= 65535"),
    (C.Overrides(port=-1), "gateway.port: Expected `int` >= 0"),
    (C.Overrides(gateways=-1), "gateway.processes: Expected `int` >= 1"),
    (C.Overrides(freeze_grace_s=-1.0), "manager.freeze_grace_s: Expected `float` >= 0.0"),
    (C.Overrides(tensor_parallel_size=-2), "models[0].tensor_parallel_size: Expected `int` >= 1"),
    (C.Overrides(name="a b"), "models[0].name: Expected `str` matching regex"),
])
def test_bad_options_are_named(ov, key):
    with pytest.raises(C.ConfigError) as exc:
        C.effective_config(EMPTY, ov)
    assert str(exc.value).startswith(f"bad option: {key}"), str(exc.value)


def test_an_option_that_duplicates_a_model_name_is_refused(tmp_path):
    path = config_file(tmp_path, MODEL.format(name="a") + MODEL.format(name="b"))
    with pytest.raises(C.ConfigError) as exc:
        C.effective_config(path, C.Overrides(name="b"))
    assert "models: duplicate name(s) ['b']" in str(exc.value)


def test_missing_api_key_file_option_is_an_error(tmp_path):
    with pytest.raises(C.ConfigError) as exc:
        C.effective_config(EMPTY, C.Overrides(api_key_file=str(tmp_path / "none")))
    assert f"gateway.api_key_file: cannot read {tmp_path / 'none'}" in str(exc.value)


@pytest.mark.parametrize("ov", [C.Overrides(gateways=0), C.Overrides(tensor_parallel_size=0)])
def test_zero_processes_or_ranks_as_an_option_is_refused(ov):
    with pytest.raises(C.ConfigError):
        C.effective_config(EMPTY, ov)


def test_a_model_name_with_a_final_newline_is_refused(tmp_path):
    msg = config_error(tmp_path, '[[models]]\nname = "ok\\n"\nmodel = "/m"\n')
    assert "models[0].name" in msg
