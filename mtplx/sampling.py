"""The public face of the NumPy float64 oracle (the seed API, spelled as it always was).

The oracle itself lives in `mtplx.sample.reference`; this module re-exports its public names
so ``from mtplx.sampling import distribution_from_logits, SamplerConfig`` keeps working.
Test and tool code: the runtime never imports it (tests/test_structure.py checks).
"""

from mtplx.sample.reference import *  # noqa: F403
from mtplx.sample.reference import __all__  # noqa: F401
