"""ember/config.py: every switch starts from EMBER_<NAME> when that is set, parsed as the default's type."""
import ast
import os
import subprocess
import sys

import ember.config as config


def _values_under(env: dict) -> dict:
    code = "import ember.config as c; print({k: getattr(c, k) for k in dir(c) if k.isupper()})"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True)
    return ast.literal_eval(out.stdout)


def test_switches_and_limits_are_read_from_the_environment():
    got = _values_under({"EMBER_SPLIT_REDUCTIONS": "0", "EMBER_RECOMPILE_LIMIT": "3", "EMBER_OWN_SINCOS": "off",
                         "EMBER_BN_FLOAT64_SUMS_ON_GPU": "1", "EMBER_CPU_ISA": "avx2"})
    assert got["SPLIT_REDUCTIONS"] is False and got["OWN_SINCOS"] is False and got["BN_FLOAT64_SUMS_ON_GPU"] is True
    assert got["RECOMPILE_LIMIT"] == 3 and got["CPU_ISA"] == "avx2"
    assert got["ONE_HOT_SUMS"] is config.ONE_HOT_SUMS is True   # an unset one keeps its default


def test_every_switch_has_a_default_of_its_documented_kind():
    names = [k for k in dir(config) if k.isupper()]
    assert len(names) >= 14
    assert all(isinstance(getattr(config, k), (bool, int, str)) for k in names)
