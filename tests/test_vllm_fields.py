"""docs/vllm_fields.json is what the installed vLLM defines (imports vLLM: not in the unit tier).

A vLLM upgrade that adds, removes or changes a field of its OpenAI request
classes fails here until ``python -m tools.vllm_fields`` regenerates the file;
the unit tier (test_api_fields_unit.py) then fails until the new field is
classified in api_gateway/fields.py and documented in docs/api.md.
"""

from __future__ import annotations

import inspect
import json
import typing

import pytest

from api_gateway.fields import LEGACY_GUIDED
from servectl.config import GenerationKey
from tools import vllm_fields

pytestmark = pytest.mark.vllm_unit  # the installed vLLM's classes, no daemon


def test_the_checked_in_field_list_is_the_installed_vllms():
    checked_in = json.loads(vllm_fields.OUT.read_text())
    assert checked_in == vllm_fields.collect(), "run python -m tools.vllm_fields and classify the new fields"


def test_the_legacy_guided_fields_are_vllms():
    from vllm.entrypoints.serve.engine.protocol import _REMOVED_GUIDED_FIELDS

    assert set(LEGACY_GUIDED) == set(_REMOVED_GUIDED_FIELDS)


def test_the_generation_config_keys_are_the_ones_vllm_reads():
    from vllm.config import ModelConfig

    source = inspect.getsource(ModelConfig.get_diff_sampling_param)
    listed = source.split("available_params = [", 1)[1].split("]", 1)[0]
    assert {k.strip().strip('"') for k in listed.split(",") if k.strip()} == set(typing.get_args(GenerationKey))
