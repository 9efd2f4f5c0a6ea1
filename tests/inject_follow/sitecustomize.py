"""Loaded by every interpreter of a test daemon whose PYTHONPATH names this folder
(tests/test_task_death.py): in a gateway, ``ManagerLink.on_model_event`` raises while the
file named by SERVECTL_TEST_FOLLOW_FAILS holds a count above 0 (each raise takes one), so
its follow task dies as it would on EMFILE. Nothing else is touched."""

import importlib.abc
import importlib.util
import os
import sys

_COUNT = os.environ.get("SERVECTL_TEST_FOLLOW_FAILS")
_NAME = "api_gateway.manager_link"


def _patch(module) -> None:
    real = module.ManagerLink.on_model_event

    def on_model_event(self, *args, **kwargs):
        try:
            with open(_COUNT) as f:
                left = int(f.read().strip() or 0)
        except (OSError, ValueError):
            left = 0
        if left > 0:
            with open(_COUNT, "w") as f:
                f.write(str(left - 1))
            raise RuntimeError(f"injected failure in follow ({left - 1} left)")
        return real(self, *args, **kwargs)

    module.ManagerLink.on_model_event = on_model_event


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _COUNT:
    sys.meta_path.insert(0, _Hook())
