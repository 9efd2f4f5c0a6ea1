"""`python -m servectl.doctor [--fix]`: check (and mend) a machine for servectl.

On a CPU machine whose pip serves PyPI's torchvision/torchaudio/torchcodec
(built for CUDA torch), importing them next to the CPU torch fails
("operator torchvision::nms does not exist") and breaks `import transformers`.
vLLM's text path does not need them, so `--fix` uninstalls whichever of them
fails to import. It also checks that the bundled default model is present.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

OPTIONAL_TORCH_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


def imports(module: str) -> bool:
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    return proc.returncode == 0


def installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


# What the test suite runs beyond pip, and the Debian package each comes in: systemd-analyze
# (the unit file test), ip (network namespaces standing in for hosts: tests/test_hosts.py),
# chromium and its driver (the status page in a real browser: tests/test_ui_browser.py), espeak-ng
# (speech made fresh for the speech model's tests: tests/test_media.py).
TEST_COMMANDS = [("systemd-analyze", "systemd"), ("ip", "iproute2"), ("chromium", "chromium"),
                 ("chromedriver", "chromium-driver"), ("espeak-ng", "espeak-ng"),
                 ("promtool", "prometheus"), ("prometheus", "prometheus")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m servectl.doctor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fix", action="store_true", help="uninstall torch add-ons that fail to import")
    ap.add_argument("--tests", action="store_true",
                    help="also install what the test suite needs beyond pip (from Debian: TEST_COMMANDS)")
    args = ap.parse_args(argv)
    problems = 0
    broken = [p for p in OPTIONAL_TORCH_PACKAGES if installed(p) and not imports(p)]
    if broken:
        if args.fix:
            print(f"removing {', '.join(broken)}: they fail to import beside this torch build")
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", *broken], check=True,
                           stdout=subprocess.DEVNULL)
        else:
            print(f"broken: {', '.join(broken)} (run with --fix)")
            problems += 1
    missing = [(cmd, pkg) for cmd, pkg in TEST_COMMANDS if not shutil.which(cmd)] if args.tests else []
    if missing:
        packages = sorted({pkg for _, pkg in missing})
        print(f"installing Debian's {', '.join(packages)} for {', '.join(cmd for cmd, _ in missing)} (the tests)")
        subprocess.run(["apt-get", "update", "-q"], check=False, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages], check=False,
                       stdout=subprocess.DEVNULL)
        for cmd, _ in missing:
            if not shutil.which(cmd):
                print(f"{cmd} is still missing")
                problems += 1
    if not imports("vllm"):
        print("vllm does not import: install servectl with the `cpu` or `gpu` extra")
        problems += 1
    from servectl.config import DEFAULT_MODEL_DIR

    if not (DEFAULT_MODEL_DIR / "model.safetensors").exists():
        print(f"the default model is missing from {DEFAULT_MODEL_DIR}")
        problems += 1
    if not problems:
        print("ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
