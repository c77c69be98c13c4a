"""The scikit-learn OpenMP + Grain index-shuffle hazard of seed 000, checked in a child.

Seed 000 saw ``mutex lock failed: Invalid argument`` when scikit-learn's OpenMP runtime
and Grain's index shuffle ran in one process (macOS, libomp). Here both run together in a
fresh interpreter: scikit-learn loads its OpenMP runtime and runs KMeans on its threads,
then Grain shuffles with reader threads. The child must exit cleanly with every item
seen once per epoch; a crash fails the test. `call_in_subprocess` (the workaround our
examples can use either way) must keep scikit-learn out of the calling process.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys
import numpy as np
from blox.data import ArraySource, call_in_subprocess, pipeline
from tests.data.helpers import sklearn_digits

def main():
    arrays = call_in_subprocess(sklearn_digits)
    print("sklearn in parent after call_in_subprocess:", "sklearn" in sys.modules)
    import sklearn.cluster
    from threadpoolctl import threadpool_info
    x = arrays["x"].reshape(len(arrays["x"]), -1)
    sklearn.cluster.KMeans(4, n_init=1, random_state=0).fit(x)
    print("runtimes:", sorted({i["user_api"] for i in threadpool_info()}))
    n = len(x)
    src = ArraySource({"id": np.arange(n), "x": arrays["x"]})
    ds = pipeline(src, batch_size=64, shuffle=True, seed=3, num_epochs=2, read_threads=4,
                  prefetch=8)
    ids = np.concatenate([b["id"] for b in ds])
    assert sorted(ids[:n].tolist()) == list(range(n)), "epoch 1 is not a permutation"
    assert sorted(ids[n:].tolist()) == list(range(n)), "epoch 2 is not a permutation"
    print("OK", n)

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_sklearn_openmp_and_grain_shuffle_share_a_process():
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "sklearn in parent after call_in_subprocess: False" in out, out
    assert "'openmp'" in out.split("runtimes:")[1].splitlines()[0], out  # OpenMP was loaded
    assert "OK 1797" in out, out
