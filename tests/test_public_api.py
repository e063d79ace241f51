"""The public surface: what ``import beaconkv`` gives, one way to make a policy, one error family."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest

import beaconkv
import beaconkv.policies
from beaconkv.policies import policy_class, policy_names


def _modules():
    for info in pkgutil.walk_packages(beaconkv.__path__, "beaconkv."):
        yield importlib.import_module(info.name)


def test_every_registered_policy_class_is_importable_from_the_package():
    # the ones beaconkv registers (other tests of the same process register classes of their own)
    classes = {c for c in map(policy_class, policy_names()) if c.__module__.startswith("beaconkv.policies.")}
    assert len(classes) >= 11
    missing = sorted(c.__name__ for c in classes if getattr(beaconkv, c.__name__, None) is not c)
    assert not missing, f"registered policies not exported from beaconkv: {missing}"
    assert {c.__name__ for c in classes} <= set(beaconkv.__all__)


@pytest.mark.parametrize("name", ["SamplingParams", "make_policy", "register_policy", "policy_names",
                                  "EvictionPolicy", "EngineError", "PolicyConfigError", "BeaconKVError",
                                  "Schedule", "AtBudget", "Buffered", "Periodic"])
def test_what_a_user_reaches_for_is_importable_from_the_package(name):
    assert name in beaconkv.__all__ and hasattr(beaconkv, name)


def test_every_name_of_the_package_docstring_exists():
    used = set(re.findall(r"beaconkv\.([A-Za-z_]+)\(", beaconkv.__doc__))
    assert {"BeaconKV", "generate", "load_model", "make_policy"} <= used
    assert all(hasattr(beaconkv, name) for name in used), sorted(n for n in used if not hasattr(beaconkv, n))


def test_the_package_docstring_example_runs_from_import_beaconkv_alone(tiny_models):
    model = beaconkv.load_model(tiny_models["llama"][0])
    policy = beaconkv.BeaconKV(budget=16, n_recent=2)
    out = beaconkv.generate(model, None, [[5, 6, 7]], max_new_tokens=40, eos_token_ids=[], policy=policy)
    assert out.policy is policy and out.stats.evictions[0] > 0


def test_internals_are_out_of_the_policies_all():
    assert not {"select_keep", "BeaconState", "QuerySet"} & set(beaconkv.policies.__all__)


def test_every_error_beaconkv_defines_is_one_family_and_keeps_its_builtin_kind():
    strays = []
    for module in _modules():
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, Exception) and not issubclass(obj, Warning)
                    and obj.__module__ == module.__name__ and not issubclass(obj, beaconkv.BeaconKVError)):
                strays.append(f"{module.__name__}.{name}")
    assert not strays, f"errors outside the BeaconKVError family: {strays}"
    assert issubclass(beaconkv.PolicyConfigError, ValueError) and issubclass(beaconkv.CompileError, RuntimeError)


def test_a_sampler_setting_error_is_a_policy_config_error():
    from beaconkv.policies.query_selection import KMeans
    with pytest.raises(beaconkv.PolicyConfigError, match="n_iter=-1"):
        KMeans(n_iter=-1)
