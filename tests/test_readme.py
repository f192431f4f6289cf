"""The README's code examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  assert blocks, "README has no python example"
  for block in blocks:
    namespace: dict = {}
    exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
    if "released" in namespace:
      assert namespace["released"].shape == namespace["w"].shape


def test_readme_quick_start_commands():
  text = README.read_text()
  assert "make run" in text and "make test" in text
