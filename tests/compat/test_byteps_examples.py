"""BytePS's own examples, unmodified, on byteps (tests/compat/examples.py runs them; docs/compat.md lists
each with its status). Every example that runs here runs twice, as BytePS's role processes and through
``bpslaunch --local``; one that fails outside byteps (a TensorFlow 1 or Keras 2 call, a torch signature)
runs once and must fail with that error, so the list cannot go stale; one that needs a GPU or ImageNet
skips with the reason. Marked ``compat`` (``make test-compat``)."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # --import-mode=importlib: find examples / harness
import examples  # noqa: E402
import harness  # noqa: E402

pytestmark = pytest.mark.compat

CASES = [(name, launch) for name, ex in examples.EXAMPLES.items()
         for launch in (("roles",) if ex.fails or ex.skip else ("roles", "local"))]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name,launch", CASES, ids=[f"{n}-{launch}" for n, launch in CASES])
def test_byteps_example(tmp_path, name, launch):
    example = examples.EXAMPLES[name]
    if example.skip:
        pytest.skip(example.skip)
    pinned, why = harness.compat_dir()
    if pinned is None:
        pytest.skip(why)
    outcome = examples.run_example(name, str(tmp_path), launch, timeout=300, pinned=pinned)
    verdict = outcome.verdict(example)
    assert verdict is None, f"{name} ({launch}): {verdict}\n{outcome.log[-4000:]}"
