"""Executable docs: every docstring example in the package and the README's Python block run."""

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import kvcodec

ROOT = Path(__file__).resolve().parents[1]
# modules that need the optional extras or a GPU to import
OPTIONAL = ("kvcodec.gpu", "kvcodec.harness", "kvcodec.integrations")


def _modules():
    yield "kvcodec"
    for m in pkgutil.walk_packages(kvcodec.__path__, "kvcodec."):
        if not m.name.startswith(OPTIONAL):
            yield m.name


@pytest.mark.parametrize("name", sorted(_modules()))
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.failed == 0, f"{res.failed} doctest failures in {name}"


def test_readme_python_example():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no Python example"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
