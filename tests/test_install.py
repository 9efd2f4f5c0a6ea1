"""Installed as users install it (issue 51): the sdist and the wheel built from this checkout,
the wheel installed into a fresh virtualenv, and the daemon served from there, outside the tree.

The virtualenv sees this environment's packages (vLLM, the clients: `--system-site-packages`)
but servectl itself only from the wheel (`--no-deps`): a product file left out of the wheel is a
`ModuleNotFoundError` in some child, which these tests catch by serving. The unit is verified
with the installed command found where systemd looks for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, http

PRODUCT = ("servectl", "manager", "engine_core", "api_gateway")  # the packages a wheel ships


NOT_SOURCE = ("__pycache__", ".git", "build", "dist", ".pytest_cache", ".hypothesis")


def checkout_files(*under: str) -> list[str]:
    """The checkout's files (under ``under``, if given), as paths relative to the root: tracked and
    untracked-but-not-ignored ones (what a commit would ship); without git (an unpacked sdist),
    every file but caches and build output."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *under],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return sorted(f for f in out.splitlines() if (ROOT / f).is_file())
    tops = [ROOT / u for u in under] or [ROOT]
    return sorted(str(p.relative_to(ROOT)) for top in tops for p in top.rglob("*")
                  if p.is_file() and not any(part in NOT_SOURCE or part.endswith(".egg-info")
                                             for part in p.relative_to(ROOT).parts))


def product_files() -> list[str]:
    """The product files of the checkout: the four packages' files."""
    return checkout_files(*PRODUCT)


def wheel_files(wheel: Path) -> dict[str, str]:
    """A wheel's files but its metadata, each with its content's digest."""
    with zipfile.ZipFile(wheel) as z:
        return {n: hashlib.sha256(z.read(n)).hexdigest() for n in z.namelist()
                if ".dist-info/" not in n and not n.endswith("/")}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The sdist, the wheel built from it, and a wheel built straight from the tree.

    Built from a copy of the checkout's files (``checkout_files``: untracked ones too), so a
    stale build/ or egg-info in the checkout cannot slip into the wheel; with this environment's
    setuptools (no download)."""
    tmp = tmp_path_factory.mktemp("build")
    src = tmp / "src"
    for rel in checkout_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    build = [sys.executable, "-m", "build", "--no-isolation"]
    # `build` with no format: the sdist, then the wheel built from that sdist (as pip does from PyPI).
    proc = subprocess.run([*build, "--outdir", str(tmp / "dist"), str(src)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = subprocess.run([*build, "--wheel", "--outdir", str(tmp / "tree"), str(src)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = (tmp / "dist").glob("servectl-*.tar.gz")
    (wheel,) = (tmp / "dist").glob("servectl-*.whl")
    (tree_wheel,) = (tmp / "tree").glob("servectl-*.whl")
    return {"sdist": sdist, "wheel": wheel, "tree_wheel": tree_wheel}


def test_the_wheel_holds_every_product_file(built):
    shipped = wheel_files(built["wheel"])
    files = product_files()
    assert "engine_core/workers/worker.py" in files and "servectl/model/default/model.safetensors" in files
    missing = [f for f in files if f not in shipped]
    assert not missing, f"the wheel leaves out {len(missing)} product file(s): {missing}"
    extra = sorted(set(shipped) - set(files))
    assert not extra, f"the wheel ships files that are not the product's: {extra}"
    # Each byte as in the tree (weights included: no text-mode mangling, no stale copy).
    for f in ("servectl/model/default/model.safetensors", "api_gateway/ui/ui.js"):
        assert shipped[f] == hashlib.sha256((ROOT / f).read_bytes()).hexdigest(), f


def test_the_sdist_builds_the_wheel_the_tree_builds(built):
    assert wheel_files(built["wheel"]) == wheel_files(built["tree_wheel"])
    with tarfile.open(built["sdist"]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for f in ("pyproject.toml", "README.md", "engine_core/workers/worker.py", "servectl/model/tools/config.json"):
        assert f in names, f


def test_one_version_everywhere(built):
    """The metadata, `servectl --version`, `python -m servectl --version` and /version (unit-tested
    below for the gateway) say servectl/__init__.py's __version__."""
    import servectl

    with zipfile.ZipFile(built["wheel"]) as z:
        meta = next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    assert f"\nVersion: {servectl.__version__}\n" in meta
    assert built["wheel"].name == f"servectl-{servectl.__version__}-py3-none-any.whl"
    for argv in ([sys.executable, "-m", "servectl", "--version"], [sys.executable, "-m", "servectl.cli", "--version"]):
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert proc.returncode == 0 and proc.stdout.strip() == f"servectl, version {servectl.__version__}", proc


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory) -> Path:
    """A fresh virtualenv holding servectl from the wheel alone (this environment's other packages
    visible: vLLM and torch are not reinstalled)."""
    root = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root)], check=True, timeout=300)
    proc = subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index",
                           "--disable-pip-version-check", str(built["wheel"])], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return root


def installed_env() -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH pointing into this checkout."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_the_installed_wheel_serves_from_outside_the_tree(venv, daemon_factory, tmp_path):
    python = venv / "bin" / "python"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    probe = subprocess.run([str(python), "-c", "import json, sys, engine_core, servectl.config as C; print(json.dumps("
                            "{'engine_core': engine_core.__file__, 'model': str(C.DEFAULT_MODEL_DIR), 'path': sys.path}))"],
                           capture_output=True, text=True, cwd=outside, env=installed_env(), timeout=60)
    assert probe.returncode == 0, probe.stderr
    where = json.loads(probe.stdout)
    assert Path(where["engine_core"]).is_relative_to(venv), where["engine_core"]
    assert not any(p and Path(p).resolve() == ROOT for p in where["path"]), "the checkout is on sys.path"
    models = Path(where["model"]).parent
    assert models.is_relative_to(venv)
    config = f"""[manager]
warm_standby = false
[[models]]
name = "default"
model = "{models / 'default'}"
[[models]]
name = "tools"
model = "{models / 'tools'}"
enable_auto_tool_choice = true
tool_call_parser = "hermes"
[models.engine_args]
dtype = "float32"
"""
    d = daemon_factory(config, command=[str(venv / "bin" / "servectl")], cwd=outside, start=False)
    d.env = {**installed_env(), **{k: v for k, v in d.env.items() if k.startswith("SERVECTL_TEST")}}
    d.start()
    # Every process of the tree runs the venv's interpreter and imports the wheel's packages.
    for pid in d.tree():
        exe = os.readlink(f"/proc/{pid}/exe")
        assert Path(exe).resolve() == Path(os.readlink(python)).resolve() or exe.startswith(str(venv)), (pid, exe)
        env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in e)
        assert str(ROOT) not in env.get("PYTHONPATH", ""), (pid, env.get("PYTHONPATH"))
    engine = d.child("engine_core:default")
    cmdline = Path(f"/proc/{engine.pid}/cmdline").read_bytes().split(b"\0")
    assert cmdline[0].decode().startswith(str(venv)), cmdline

    api = d.openai()
    done = api.completions.create(model="default", prompt="def ", max_tokens=8, temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens == 8
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    r = api.chat.completions.create(model="tools", temperature=0, max_tokens=200, tools=[weather],
                                    messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}

    status = d.cli("status", check=True)
    assert "default" in status.stdout and "tools" in status.stdout and "ready" in status.stdout, status.stdout
    assert http(d, "GET", "/version").json()["version"] == __import__("servectl").__version__
    stop = d.cli("stop", check=True)
    assert stop.returncode == 0
    d.stop()  # waits until nothing of the tree is left (and the factory checks again)
    assert d.leftovers() == []


def verify_unit(unit: Path, bin_dir: Path) -> subprocess.CompletedProcess:
    """`systemd-analyze verify` of ``unit`` with ``bin_dir`` seen as /usr/local/bin (where pip puts
    a root install's commands), in a mount namespace of its own: nothing on the host changes."""
    script = f'mount --bind "{bin_dir}" /usr/local/bin && exec systemd-analyze verify "{unit}"'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=120)


def systemd_verify_available() -> str | None:
    """Why the unit cannot be verified here, or None."""
    if shutil.which("systemd-analyze") is None:
        return "systemd-analyze is not installed (Debian: apt-get install systemd)"
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return "verifying with the installed command needs root and unshare (a private mount namespace)"
    return None


def test_the_systemd_unit_runs_the_installed_command(venv, tmp_path):
    if (why := systemd_verify_available()) is not None:
        pytest.skip(why)
    text = (ROOT / "systemd" / "servectl.service").read_text()
    starts = [line for line in text.splitlines() if line.startswith(("ExecStart=", "ExecReload="))]
    assert starts and all(line.split("=", 1)[1].startswith("servectl ") for line in starts), starts
    unit = tmp_path / "servectl.service"
    unit.write_text(text)
    proc = verify_unit(unit, venv / "bin")
    problems = [line for line in proc.stderr.splitlines() if "servectl.service" in line
                and "Unknown user" not in line and "Unknown group" not in line]
    assert problems == [], proc.stderr
    # Positive control: with no servectl where systemd looks, verify fails naming the command.
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    bad = verify_unit(unit, empty)
    assert bad.returncode != 0 and "servectl" in bad.stderr, bad.stderr
