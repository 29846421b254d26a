"""Alias of `cula_core.reference_backend` (where the reference kernels live, outside this package so that
dispatch imports them without a circle), kept only until its last importers move there; new code imports
`cula_core.reference_backend`."""

import sys

from cula_core import reference_backend

sys.modules[__name__] = reference_backend
